// streamsafe core: creates the "streamsafe" logger once (a function-local static, so creation
// is thread-safe); spdlog's logger is itself thread-safe. Configuration: logging.hpp.
// The logger is never destroyed: blocks are still freed during process exit (PyTorch frees the
// storages of CUDA IPC exports from a static destructor), after this file's statics would be
// gone, and a warning logged then must not touch a destroyed logger.
#include "core/common/logging.hpp"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <string>

namespace streamsafe::detail {

spdlog::logger& log() {
  // NOLINTNEXTLINE(cppcoreguidelines-owning-memory): immortal on purpose, see above
  static const auto* const logger = new std::shared_ptr<spdlog::logger>([] {
    if (auto existing = spdlog::get("streamsafe")) return existing;
    std::shared_ptr<spdlog::logger> made;
    const char* file = std::getenv("STREAMSAFE_LOG_FILE");
    try {
      made = file && *file ? spdlog::basic_logger_mt("streamsafe", file)
                           : spdlog::stderr_color_mt("streamsafe");
    } catch (const spdlog::spdlog_ex&) {
      made = spdlog::get("streamsafe");
    }
    made->set_pattern("[streamsafe %L] %v");
    made->set_level(spdlog::level::warn);
    if (const char* level = std::getenv("STREAMSAFE_LOG_LEVEL"); level && *level) {
      made->set_level(spdlog::level::from_str(level));
    }
    return made;
  }());
  return **logger;
}

}  // namespace streamsafe::detail
