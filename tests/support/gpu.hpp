// Test support: is there a GPU? [gpu] tests call STREAMSAFE_REQUIRE_GPU() first, which skips
// the test with a message where none is present (no driver: cudaErrorInsufficientDriver; a
// driver and no device: cudaErrorNoDevice). Tests that need several GPUs ([multigpu]) call
// STREAMSAFE_REQUIRE_GPUS(n), which skips them, with a message, where fewer are present.
#pragma once

#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>

namespace streamsafe::test {

inline int gpu_count() {
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return n;
  }();
  return count;
}

}  // namespace streamsafe::test

#define STREAMSAFE_REQUIRE_GPU()                                       \
  do {                                                                 \
    if (::streamsafe::test::gpu_count() == 0) {                        \
      WARN("skipped: no GPU present (cudaGetDeviceCount found none)"); \
      return;                                                          \
    }                                                                  \
  } while (0)

#define STREAMSAFE_REQUIRE_GPUS(n)                                                  \
  do {                                                                              \
    if (::streamsafe::test::gpu_count() < (n)) {                                    \
      WARN("skipped: needs " << (n) << " GPUs, " << ::streamsafe::test::gpu_count() \
                             << " present");                                        \
      return;                                                                       \
    }                                                                               \
  } while (0)
