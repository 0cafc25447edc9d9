// The CUDA backends on any machine: a machine without a GPU (or without a driver) is handled
// without a crash. The test binary itself starting on a machine without a driver shows that
// nothing CUDA-related runs at static-init time and that nothing links libcuda. The backends
// on the GPU: cuda_backends_gpu_test.cpp.
#include "support/gpu.hpp"

#include <streamsafe/backends/cuda_malloc_backend.hpp>
#include <streamsafe/backends/driver_api.hpp>
#include <streamsafe/backends/expandable_backend.hpp>
#include <streamsafe/backends/gpu.hpp>
#include <streamsafe/core/errors.hpp>

#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>

#include <string>

namespace {

using streamsafe::backend_error;
using streamsafe::cuda::cuda_malloc_backend;
using streamsafe::cuda::expandable_backend;

}  // namespace

TEST_CASE(
    "device_count returns zero without a GPU and the CUDA backends refuse a missing "
    "device with backend_error instead of crashing",
    "[backends]") {
  const int count = streamsafe::cuda::device_count();
  REQUIRE(count == streamsafe::test::gpu_count());
  // Without a driver the runtime's initialisation error stays sticky (every call, even
  // cudaGetLastError, returns cudaErrorInsufficientDriver); with a GPU the error slot is clean.
  if (count > 0) REQUIRE(cudaGetLastError() == cudaSuccess);
  REQUIRE_THROWS_AS(cuda_malloc_backend(-1), backend_error);
  REQUIRE_THROWS_AS(cuda_malloc_backend(count), backend_error);
  REQUIRE_THROWS_AS(expandable_backend(count), backend_error);
  if (count == 0) {
    REQUIRE_THROWS_AS(cuda_malloc_backend(0), backend_error);
    REQUIRE_THROWS_AS(expandable_backend(0), backend_error);
  }
  // The driver entry points load on demand, or fail with a message saying why.
  try {
    streamsafe::cuda::driver::load();
    REQUIRE(streamsafe::cuda::driver::available());
  } catch (const backend_error& error) {
    REQUIRE_FALSE(streamsafe::cuda::driver::available());
    REQUIRE(std::string(error.what()).find("cuMemCreate") != std::string::npos);
    REQUIRE(std::string(streamsafe::cuda::driver::error_name(CUDA_ERROR_OUT_OF_MEMORY)).size() > 0);
  }
  if (count > 0) REQUIRE(cudaGetLastError() == cudaSuccess);
}
