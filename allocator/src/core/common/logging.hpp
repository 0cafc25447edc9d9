// streamsafe core: the "streamsafe" spdlog logger (internal). Level from STREAMSAFE_LOG_LEVEL
// (trace, debug, info, warn, error, off; default warn), output to stderr or to the file named by
// STREAMSAFE_LOG_FILE. Created once, thread-safe.
#pragma once

#include <spdlog/spdlog.h>

namespace streamsafe::detail {

spdlog::logger& log();

}  // namespace streamsafe::detail
