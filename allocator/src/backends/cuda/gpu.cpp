// streamsafe: device_count and current_device (see gpu.hpp). Stateless; thread-safe.
#include <streamsafe/backends/cuda_check.hpp>
#include <streamsafe/backends/gpu.hpp>

#include <cuda_runtime_api.h>

namespace streamsafe::cuda {

int device_count() noexcept {
  int count = 0;
  const cudaError_t result = cudaGetDeviceCount(&count);
  if (result != cudaSuccess) {
    // cudaErrorInsufficientDriver (35), cudaErrorNoDevice (100) or anything else: no GPU for
    // us. Clear the error so that it does not surface in an unrelated check later.
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

int current_device() {
  int device = -1;
  STREAMSAFE_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

}  // namespace streamsafe::cuda
