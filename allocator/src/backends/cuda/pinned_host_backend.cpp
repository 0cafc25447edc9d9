// streamsafe: pinned_host_backend (see pinned_host_backend.hpp). Stateless apart from the device
// index; thread-safe.
#include <streamsafe/backends/cuda_check.hpp>
#include <streamsafe/backends/device_guard.hpp>
#include <streamsafe/backends/pinned_host_backend.hpp>
#include <streamsafe/core/errors.hpp>

#include <cuda_runtime_api.h>

#include <string>

namespace streamsafe::cuda {
namespace {

[[noreturn]] void not_supported(const char* call) {
  throw backend_error(std::string("streamsafe: ") + call +
                      " is not supported by the pinned_host backend (no expandable segments)");
}

}  // namespace

pinned_host_backend::pinned_host_backend(int device) : cuda_event_ops(device) {}

void* pinned_host_backend::allocate_segment(std::size_t size_bytes) {
  device_guard guard(device());
  void* base = nullptr;
  const cudaError_t result = cudaHostAlloc(&base, size_bytes, cudaHostAllocPortable);
  if (result == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // out of host memory is an answer here, not a sticky error
    return nullptr;
  }
  if (result != cudaSuccess)
    detail::throw_cuda_error(result, "cudaHostAlloc(&base, size_bytes)", __FILE__, __LINE__);
  return base;
}

void pinned_host_backend::free_segment(void* base, std::size_t /*size_bytes*/) {
  if (base == nullptr) return;
  device_guard guard(device());
  STREAMSAFE_CUDA_CHECK(cudaFreeHost(base));
}

void* pinned_host_backend::reserve_address_range(std::size_t /*size_bytes*/) {
  not_supported("reserve_address_range");
}

void pinned_host_backend::release_address_range(void* /*base*/, std::size_t /*size_bytes*/) {
  not_supported("release_address_range");
}

bool pinned_host_backend::map(void* /*addr*/, std::size_t /*size_bytes*/) { not_supported("map"); }

void pinned_host_backend::unmap(void* /*addr*/, std::size_t /*size_bytes*/) {
  not_supported("unmap");
}

}  // namespace streamsafe::cuda
