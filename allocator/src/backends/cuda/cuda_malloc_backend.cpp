// streamsafe: cuda_malloc_backend (see cuda_malloc_backend.hpp). Stateless apart from the
// device index; thread-safe.
#include <streamsafe/backends/capture_mode.hpp>
#include <streamsafe/backends/cuda_check.hpp>
#include <streamsafe/backends/cuda_malloc_backend.hpp>
#include <streamsafe/backends/device_guard.hpp>
#include <streamsafe/core/errors.hpp>

#include <cuda_runtime_api.h>

#include <string>

namespace streamsafe::cuda {
namespace {

[[noreturn]] void not_supported(const char* call) {
  throw backend_error(std::string("streamsafe: ") + call +
                      " is not supported by cuda_malloc backend (no expandable segments)");
}

}  // namespace

cuda_malloc_backend::cuda_malloc_backend(int device) : cuda_event_ops(device) {}

void* cuda_malloc_backend::allocate_segment(std::size_t size_bytes) {
  device_guard guard(device());
  relaxed_capture_mode relaxed;  // legal during a graph capture; not captured, not replayed
  void* base = nullptr;
  const cudaError_t result = cudaMalloc(&base, size_bytes);
  if (result == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // out of memory is an answer here, not a sticky error
    return nullptr;
  }
  if (result != cudaSuccess) {
    detail::throw_cuda_error(result, "cudaMalloc(&base, size_bytes)", __FILE__, __LINE__);
  }
  return base;
}

void cuda_malloc_backend::free_segment(void* base, std::size_t /*size_bytes*/) {
  if (base == nullptr) return;
  device_guard guard(device());
  STREAMSAFE_CUDA_CHECK(cudaFree(base));
}

void* cuda_malloc_backend::reserve_address_range(std::size_t /*size_bytes*/) {
  not_supported("reserve_address_range");
}

void cuda_malloc_backend::release_address_range(void* /*base*/, std::size_t /*size_bytes*/) {
  not_supported("release_address_range");
}

bool cuda_malloc_backend::map(void* /*addr*/, std::size_t /*size_bytes*/) { not_supported("map"); }

void cuda_malloc_backend::unmap(void* /*addr*/, std::size_t /*size_bytes*/) {
  not_supported("unmap");
}

}  // namespace streamsafe::cuda
