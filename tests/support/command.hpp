// Test support: runs a shell command (a child program) and reads its output: the exit status
// and output of a command, the line that starts with a prefix, a number after a JSON key.
#pragma once

#include <sys/wait.h>
#include <cstdio>
#include <string>

namespace streamsafe::test {

struct command_result {
  int status = -1;
  std::string output;
};

inline command_result run_command(const std::string& cmd) {
  command_result r;
  FILE* pipe = popen((cmd + " 2>&1").c_str(), "r");
  if (!pipe) return r;
  char buf[1024];
  while (std::fgets(buf, sizeof buf, pipe)) r.output += buf;
  const int raw = pclose(pipe);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  return r;
}

inline std::string line_starting(const std::string& text, const std::string& prefix) {
  for (std::size_t pos = 0; pos < text.size();) {
    const std::size_t end = text.find('\n', pos);
    const std::string line = text.substr(pos,
                                         end == std::string::npos ? std::string::npos : end - pos);
    if (line.rfind(prefix, 0) == 0) return line;
    if (end == std::string::npos) break;
    pos = end + 1;
  }
  return {};
}

inline long long json_number(const std::string& text, const std::string& key) {
  const std::size_t at = text.find("\"" + key + "\": ");
  if (at == std::string::npos) return -1;
  return std::stoll(text.substr(at + key.size() + 4));
}

}  // namespace streamsafe::test
