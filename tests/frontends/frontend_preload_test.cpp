// Tests of the LD_PRELOAD interposer (libstreamsafe_preload.so) and of the CUB example, through
// child processes: examples/preload/loop, a plain CUDA program built with -cudart shared, runs
// with and without LD_PRELOAD. Without a GPU both runs must behave the same (every call passes
// through); on a GPU the checksums must agree, the cudaFree contract check must pass, and the
// interposer must make far fewer driver allocations than the program's cudaMalloc calls.
#include "support/gpu.hpp"

#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <cstdio>
#include <string>

namespace {

struct command_result {
  int status = -1;
  std::string output;
};

command_result run_command(const std::string& cmd) {
  command_result r;
  FILE* pipe = popen((cmd + " 2>&1").c_str(), "r");
  if (!pipe) return r;
  char buf[1024];
  while (std::fgets(buf, sizeof buf, pipe)) r.output += buf;
  const int raw = pclose(pipe);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  return r;
}

std::string line_starting(const std::string& text, const std::string& prefix) {
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

long long json_number(const std::string& text, const std::string& key) {
  const std::size_t at = text.find("\"" + key + "\": ");
  if (at == std::string::npos) return -1;
  return std::stoll(text.substr(at + key.size() + 4));
}

}  // namespace

#if defined(STREAMSAFE_PRELOAD_LOOP_PATH) && defined(STREAMSAFE_PRELOAD_LIB_PATH)

TEST_CASE("The interposer loads into a plain CUDA program and leaves its results unchanged",
          "[preload]") {
  const std::string loop = std::string("'") + STREAMSAFE_PRELOAD_LOOP_PATH + "' --iterations 300";
  const command_result plain = run_command(loop);
  const command_result preloaded = run_command(std::string("LD_PRELOAD='") +
                                               STREAMSAFE_PRELOAD_LIB_PATH + "' " + loop);
  INFO("without:\n" << plain.output << "with:\n" << preloaded.output);
  CHECK(plain.status == preloaded.status);
  if (streamsafe::test::gpu_count() == 0) {
    // No GPU: every call went to the runtime, which answered the same both times.
    CHECK(plain.status == 2);
    CHECK(plain.output == preloaded.output);
    return;
  }
  CHECK(plain.status == 0);
  CHECK_FALSE(line_starting(plain.output, "checksum:").empty());
  CHECK(line_starting(plain.output, "checksum:") == line_starting(preloaded.output, "checksum:"));
}

TEST_CASE(
    "On the GPU, the interposer keeps the cudaFree contract with far fewer driver allocations",
    "[gpu][preload]") {
  STREAMSAFE_REQUIRE_GPU();
  const command_result r = run_command(std::string("LD_PRELOAD='") + STREAMSAFE_PRELOAD_LIB_PATH +
                                       "' '" + STREAMSAFE_PRELOAD_LOOP_PATH +
                                       "' --iterations 1000");
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK_THAT(line_starting(r.output, "contract:"), Catch::EndsWith(": ok"));
  const std::string stats = line_starting(r.output, "interposer: {");
  REQUIRE_FALSE(stats.empty());
  CHECK(json_number(stats, "cudaMalloc") > 1000);
  CHECK(json_number(stats, "passthrough_allocs") == 0);
  CHECK(json_number(stats, "errors") == 0);
  const long long driver = json_number(stats, "num_device_alloc");
  CHECK(driver > 0);
  CHECK(driver * 20 < json_number(stats, "cudaMalloc") + json_number(stats, "cudaMallocAsync"));
  // One event per fenced stream per batch, not per free: at most one batch per allocation call.
  CHECK(json_number(stats, "free_batches") <=
        json_number(stats, "cudaMalloc") + json_number(stats, "cudaMallocAsync"));
}

#endif

#ifdef STREAMSAFE_CUB_EXAMPLE_PATH
TEST_CASE("On the GPU, CUB, Thrust and cuda::mr run with temporary storage from streamsafe",
          "[gpu][adapters]") {
  STREAMSAFE_REQUIRE_GPU();
  const command_result r = run_command(std::string("'") + STREAMSAFE_CUB_EXAMPLE_PATH +
                                       "' --iterations 50");
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK_THAT(r.output, Catch::Contains("cub example: all checks passed"));
}
#endif
