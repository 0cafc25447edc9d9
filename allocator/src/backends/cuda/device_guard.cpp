// streamsafe: device_guard (see device_guard.hpp). Touches only the calling thread's current
// device; thread-safe in that sense.
#include <streamsafe/backends/cuda_check.hpp>
#include <streamsafe/backends/device_guard.hpp>

#include <cuda_runtime_api.h>

namespace streamsafe::cuda {

device_guard::device_guard(int device) : device_(device) {
  STREAMSAFE_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device_) STREAMSAFE_CUDA_CHECK(cudaSetDevice(device_));
}

device_guard::~device_guard() {
  if (previous_ != device_) STREAMSAFE_CUDA_CHECK_NOTHROW(cudaSetDevice(previous_));
}

}  // namespace streamsafe::cuda
