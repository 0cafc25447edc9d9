// streamsafe: cuda::memory_resource, a CCCL cuda::mr async resource over cuda::allocator.
//
// Satisfies cuda::mr::async_resource_with<memory_resource, cuda::mr::device_accessible> of the
// CCCL shipped with CUDA 13.0 (CCCL 3.0; a static_assert below proves it), so it can be held in
// cuda::mr::async_resource_ref<cuda::mr::device_accessible> / resource_ref and passed wherever
// CCCL accepts those. thrust_allocator<T> adapts it to Thrust's execution policies
// (thrust::cuda::par_nosync(alloc).on(stream)) for their temporary storage.
//
// Needs CCCL's headers (<cuda/memory_resource>, under include/cccl of CUDA 13) and the
// experimental memory-resource switch, which this header defines when it is the first to include
// <cuda/memory_resource>: link the CMake target streamsafe::cccl, or define
// LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE for the whole program. Plain C++ (g++) or nvcc.
//
// Stream-ordering contract (that of cuda::allocator):
//  * allocate_async(bytes, alignment, s): usable on s at once; deallocate_async(p, ..., s): the
//    last use of p is on s (stream-ordered free).
//  * allocate / deallocate (the synchronous pair) are the allocation and the host free on the
//    legacy default stream, as RMM's resources do: memory from allocate() may be used at once on
//    the legacy stream and on blocking streams, which the legacy stream orders; before using it
//    on a non-blocking stream, order that stream after the legacy stream (or use
//    allocate_async). deallocate() requires the last use to be on the legacy stream, on a
//    blocking stream ordered before it, or recorded (record_stream).
// Alignment: every block is aligned to 512 bytes; a larger alignment, or one that is not a power
// of two, throws std::invalid_argument. Sizes are ignored on deallocation.
// Device: the resource serves the device it was constructed for, or (device -1, the default)
// the calling thread's current device at each allocation; deallocation is routed to the owning
// device. Two resources are equal when they share the allocator and the device.
// Errors: allocation throws streamsafe::out_of_memory (a std::bad_alloc) and the allocator's
// other errors; deallocate / deallocate_async are noexcept: a failure (e.g. a pointer this
// allocator did not hand out) is logged (logger "streamsafe") and ignored.
// Thread safety: as cuda::allocator (any thread); the resource itself is a pointer and an int.
#pragma once

#ifndef LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#define LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#endif

#include <streamsafe/frontends/allocator.hpp>

#include <cuda_runtime_api.h>
#include <cuda/memory_resource>
#include <cuda/stream_ref>

#include <cstddef>
#include <exception>
#include <stdexcept>
#include <string>

namespace streamsafe::cuda {

class memory_resource {
 public:
  static constexpr std::size_t alignment_bytes = 512;  // every block's alignment

  // Over the process allocator (allocator::instance(); throws its config_error).
  memory_resource() : memory_resource(allocator::instance()) {}
  // Over `alloc`, which must outlive the resource; device -1: the current device at each call.
  explicit memory_resource(allocator& alloc, int device = -1) noexcept
      : alloc_(&alloc), device_(device) {}

  void* allocate(std::size_t bytes, std::size_t alignment = alignment_bytes) {
    return allocate_async(bytes, alignment, ::cuda::stream_ref{cudaStreamLegacy});
  }
  void deallocate(void* ptr, std::size_t /*bytes*/,
                  std::size_t /*alignment*/ = alignment_bytes) noexcept {
    if (!ptr) return;
    try {
      alloc_->deallocate(ptr);
    } catch (const std::exception& e) {
      log_error(e.what());
    }
  }

  void* allocate_async(std::size_t bytes, std::size_t alignment, ::cuda::stream_ref stream) {
    check_alignment(alignment);
    const int device = device_ >= 0 ? device_ : alloc_->current_device();
    return alloc_->allocate(bytes, device, stream.get());
  }
  void deallocate_async(void* ptr, std::size_t /*bytes*/, std::size_t /*alignment*/,
                        ::cuda::stream_ref stream) noexcept {
    if (!ptr) return;
    try {
      alloc_->deallocate(ptr, stream.get());
    } catch (const std::exception& e) {
      log_error(e.what());
    }
  }

  // Tensor.record_stream for memory from this resource.
  void record_stream(void* ptr, ::cuda::stream_ref stream) {
    alloc_->record_stream(ptr, stream.get());
  }

  allocator& upstream_allocator() const noexcept { return *alloc_; }
  int device() const noexcept { return device_; }

  friend bool operator==(const memory_resource& a, const memory_resource& b) noexcept {
    return a.alloc_ == b.alloc_ && a.device_ == b.device_;
  }
  friend bool operator!=(const memory_resource& a, const memory_resource& b) noexcept {
    return !(a == b);
  }

  // Device memory: accessible from the device, not from the host.
  friend void get_property(const memory_resource&, ::cuda::mr::device_accessible) noexcept {}

 private:
  static void check_alignment(std::size_t alignment) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > alignment_bytes) {
      throw std::invalid_argument("streamsafe: memory_resource alignment " +
                                  std::to_string(alignment) + " is not a power of two up to 512");
    }
  }

  allocator* alloc_;
  int device_;
};

static_assert(::cuda::mr::resource<memory_resource>,
              "memory_resource must satisfy cuda::mr::resource");
static_assert(::cuda::mr::async_resource_with<memory_resource, ::cuda::mr::device_accessible>,
              "memory_resource must satisfy cuda::mr::async_resource_with<device_accessible>");
static_assert(!::cuda::mr::resource_with<memory_resource, ::cuda::mr::host_accessible>,
              "device memory is not host accessible");

// A Thrust allocator (value_type T, allocate(n) / deallocate(p, n)) over a memory_resource and
// one stream: thrust::cuda::par_nosync(alloc).on(stream) then takes its temporary storage from
// streamsafe, stream-ordered on that stream. Raw pointers: fine for temporary storage; for
// thrust::device_vector wrap them yourself (thrust::device_ptr).
template <class T>
class thrust_allocator {
 public:
  using value_type = T;
  using pointer = T*;
  using size_type = std::size_t;

  thrust_allocator(memory_resource resource, cudaStream_t stream) noexcept
      : resource_(resource), stream_(stream) {}
  template <class U>
  thrust_allocator(const thrust_allocator<U>& other) noexcept  // NOLINT: rebinding is implicit
      : resource_(other.resource()), stream_(other.stream()) {}

  T* allocate(std::size_t n) {
    return static_cast<T*>(resource_.allocate_async(n * sizeof(T), memory_resource::alignment_bytes,
                                                    ::cuda::stream_ref{stream_}));
  }
  void deallocate(T* p, std::size_t n) noexcept {
    resource_.deallocate_async(p, n * sizeof(T), memory_resource::alignment_bytes,
                               ::cuda::stream_ref{stream_});
  }

  memory_resource resource() const noexcept { return resource_; }
  cudaStream_t stream() const noexcept { return stream_; }

  friend bool operator==(const thrust_allocator& a, const thrust_allocator& b) noexcept {
    return a.resource_ == b.resource_ && a.stream_ == b.stream_;
  }
  friend bool operator!=(const thrust_allocator& a, const thrust_allocator& b) noexcept {
    return !(a == b);
  }

 private:
  memory_resource resource_;
  cudaStream_t stream_;
};

}  // namespace streamsafe::cuda
