// streamsafe: checking the return codes of CUDA runtime and driver calls.
//
//  STREAMSAFE_CUDA_CHECK(call)          evaluates a runtime call (cudaError_t); on failure throws
//                                       streamsafe::backend_error naming the call text, the
//                                       error name and description, the current device, file
//                                       and line.
//  STREAMSAFE_CUDA_CHECK_NOTHROW(call)  for destructors and noexcept paths: on failure logs the
//                                       same message (spdlog logger "streamsafe" when one is
//                                       registered, else stderr) and goes on. Silent for
//                                       cudaErrorCudartUnloading (process teardown).
//  STREAMSAFE_CU_CHECK(call)            the same pair for driver API calls (CUresult, made
//  STREAMSAFE_CU_CHECK_NOTHROW(call)    through streamsafe::cuda::driver); the silent code is
//                                       CUDA_ERROR_DEINITIALIZED.
// Every failure path clears the runtime's last (non-sticky) error, so that a reported failure
// is not reported again by the next unrelated check.
//
// Thread safety: stateless; usable from any thread.
#pragma once

#include <streamsafe/backends/driver_api.hpp>
#include <streamsafe/core/errors.hpp>

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <string>

namespace streamsafe::cuda::detail {

// "streamsafe: <call> failed: <name> (<text>, code <n>) [current device <d>] at <file>:<line>"
inline std::string describe_failure(const char* call, const char* error_name,
                                    const char* error_text, int code, const char* file, int line) {
  std::string message = "streamsafe: ";
  message += call;
  message += " failed: ";
  message += error_name;
  message += " (";
  message += error_text;
  message += ", code ";
  message += std::to_string(code);
  message += ")";
  int device = -1;
  if (cudaGetDevice(&device) == cudaSuccess) {
    message += " [current device ";
    message += std::to_string(device);
    message += "]";
  }
  (void)cudaGetLastError();
  message += " at ";
  message += file;
  message += ":";
  message += std::to_string(line);
  return message;
}

// Writes one line to the spdlog logger "streamsafe" when one is registered, else to stderr.
inline void log_message(spdlog::level::level_enum level, const char* message) noexcept {
  try {
    if (auto logger = spdlog::get("streamsafe")) {
      logger->log(level, "{}", message);
      return;
    }
  } catch (...) {
  }
  std::fprintf(stderr, "%s\n", message);
}

inline void log_failure(const char* call, const char* error_name, const char* error_text, int code,
                        const char* file, int line) noexcept {
  try {
    const std::string message = describe_failure(call, error_name, error_text, code, file, line);
    log_message(spdlog::level::err, message.c_str());
  } catch (...) {
    std::fprintf(stderr, "streamsafe: %s failed (code %d) at %s:%d\n", call, code, file, line);
  }
}

[[noreturn]] inline void throw_cuda_error(cudaError_t error, const char* call, const char* file,
                                          int line) {
  (void)cudaGetLastError();
  throw backend_error(describe_failure(call, cudaGetErrorName(error), cudaGetErrorString(error),
                                       static_cast<int>(error), file, line));
}

inline void log_cuda_error(cudaError_t error, const char* call, const char* file,
                           int line) noexcept {
  (void)cudaGetLastError();
  if (error == cudaErrorCudartUnloading) return;
  log_failure(call, cudaGetErrorName(error), cudaGetErrorString(error), static_cast<int>(error),
              file, line);
}

[[noreturn]] inline void throw_cu_error(CUresult result, const char* call, const char* file,
                                        int line) {
  throw backend_error(describe_failure(call, driver::error_name(result),
                                       driver::error_string(result), static_cast<int>(result), file,
                                       line));
}

inline void log_cu_error(CUresult result, const char* call, const char* file, int line) noexcept {
  if (result == CUDA_ERROR_DEINITIALIZED) return;
  log_failure(call, driver::error_name(result), driver::error_string(result),
              static_cast<int>(result), file, line);
}

}  // namespace streamsafe::cuda::detail

#define STREAMSAFE_CUDA_CHECK(call)                                                          \
  do {                                                                                       \
    const cudaError_t streamsafe_cuda_status_ = (call);                                      \
    if (streamsafe_cuda_status_ != cudaSuccess) {                                            \
      ::streamsafe::cuda::detail::throw_cuda_error(streamsafe_cuda_status_, #call, __FILE__, \
                                                   __LINE__);                                \
    }                                                                                        \
  } while (0)

#define STREAMSAFE_CUDA_CHECK_NOTHROW(call)                                                \
  do {                                                                                     \
    const cudaError_t streamsafe_cuda_status_ = (call);                                    \
    if (streamsafe_cuda_status_ != cudaSuccess) {                                          \
      ::streamsafe::cuda::detail::log_cuda_error(streamsafe_cuda_status_, #call, __FILE__, \
                                                 __LINE__);                                \
    }                                                                                      \
  } while (0)

#define STREAMSAFE_CU_CHECK(call)                                                        \
  do {                                                                                   \
    const CUresult streamsafe_cu_status_ = (call);                                       \
    if (streamsafe_cu_status_ != CUDA_SUCCESS) {                                         \
      ::streamsafe::cuda::detail::throw_cu_error(streamsafe_cu_status_, #call, __FILE__, \
                                                 __LINE__);                              \
    }                                                                                    \
  } while (0)

#define STREAMSAFE_CU_CHECK_NOTHROW(call)                                                         \
  do {                                                                                            \
    const CUresult streamsafe_cu_status_ = (call);                                                \
    if (streamsafe_cu_status_ != CUDA_SUCCESS) {                                                  \
      ::streamsafe::cuda::detail::log_cu_error(streamsafe_cu_status_, #call, __FILE__, __LINE__); \
    }                                                                                             \
  } while (0)
