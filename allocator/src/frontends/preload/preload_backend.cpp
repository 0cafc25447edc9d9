// streamsafe preload: real_malloc_backend and watching_backend (see preload_backend.hpp).
#include "preload_backend.hpp"

#include "real_cuda.hpp"

#include <streamsafe/backends/cuda_check.hpp>
#include <streamsafe/backends/device_guard.hpp>
#include <streamsafe/core/errors.hpp>

#include <string>

namespace streamsafe::preload {
namespace {

thread_local bool waited_on_watched = false;

[[noreturn]] void not_supported(const char* call) {
  throw backend_error(std::string("streamsafe preload: ") + call +
                      " is not supported by the cuda_malloc backend (no expandable segments)");
}

}  // namespace

void* real_malloc_backend::allocate_segment(std::size_t size_bytes) {
  cuda::device_guard guard(device());
  void* base = nullptr;
  const cudaError_t result = real().malloc(&base, size_bytes);
  if (result == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // out of memory is an answer here, not a sticky error
    return nullptr;
  }
  if (result != cudaSuccess) {
    cuda::detail::throw_cuda_error(result, "cudaMalloc (real)", __FILE__, __LINE__);
  }
  return base;
}

void real_malloc_backend::free_segment(void* base, std::size_t /*size_bytes*/) {
  if (base == nullptr) return;
  cuda::device_guard guard(device());
  STREAMSAFE_CUDA_CHECK(real().free(base));
}

void* real_malloc_backend::reserve_address_range(std::size_t) {
  not_supported("reserve_address_range");
}
void real_malloc_backend::release_address_range(void*, std::size_t) {
  not_supported("release_address_range");
}
bool real_malloc_backend::map(void*, std::size_t) { not_supported("map"); }
void real_malloc_backend::unmap(void*, std::size_t) { not_supported("unmap"); }

bool watching_backend::take_wait_note() noexcept {
  const bool noted = waited_on_watched;
  waited_on_watched = false;
  return noted;
}

void watching_backend::stream_wait_event(stream_handle stream, event_handle event) {
  inner().stream_wait_event(stream, event);
  if (stream == watched_) waited_on_watched = true;
}

}  // namespace streamsafe::preload
