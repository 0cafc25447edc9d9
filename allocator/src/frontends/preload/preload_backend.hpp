// streamsafe preload: the device backends of the interposer.
//
//  * real_malloc_backend: cuda_malloc_backend's segments through the REAL cudaMalloc / cudaFree
//    (real_cuda.hpp), since inside the preload library those names are the interposer's own.
//    Events, stream waits and memory info come from cuda_event_ops (not interposed).
//  * watching_backend: forwards every call to another backend and notes, for the calling
//    thread, whether a stream wait was issued on `watched` (the device's private stream, from
//    which cudaMalloc is served): a block handed out after such a wait is not idle for other
//    streams until that stream has run, so the interposer synchronises it before returning
//    from cudaMalloc. The note is per thread because the caching allocator issues the waits for
//    a block on the thread that allocates it.
// Thread safety: as the backends they wrap; the note is thread_local.
#pragma once

#include <streamsafe/backends/cuda_event_ops.hpp>
#include <streamsafe/backends/forwarding_backend.hpp>

#include <cstddef>
#include <memory>

namespace streamsafe::preload {

class real_malloc_backend final : public cuda::cuda_event_ops {
 public:
  explicit real_malloc_backend(int device) : cuda_event_ops(device) {}

  const char* name() const noexcept override { return "cuda_malloc"; }
  void* allocate_segment(std::size_t size_bytes) override;
  void free_segment(void* base, std::size_t size_bytes) override;
  bool free_segment_synchronizes() const noexcept override { return true; }  // the real cudaFree
  bool supports_expandable() const noexcept override { return false; }
  std::size_t map_granularity_bytes() const noexcept override { return 0; }
  void* reserve_address_range(std::size_t size_bytes) override;
  void release_address_range(void* base, std::size_t size_bytes) override;
  bool map(void* addr, std::size_t size_bytes) override;
  void unmap(void* addr, std::size_t size_bytes) override;
};

// The owned real backend, a base so that it exists before forwarding_backend refers to it.
struct owned_backend {
  std::unique_ptr<device_backend> owned;
};

// Forwards every call; notes stream waits on the watched stream (stream_wait_event).
class watching_backend final : private owned_backend, public forwarding_backend {
 public:
  watching_backend(std::unique_ptr<device_backend> inner, stream_handle watched)
      : owned_backend{std::move(inner)}, forwarding_backend(*owned), watched_(watched) {}

  // True when this thread issued a wait on the watched stream since the last call; clears it.
  static bool take_wait_note() noexcept;

  void stream_wait_event(stream_handle stream, event_handle event) override;

 private:
  stream_handle watched_;
};

}  // namespace streamsafe::preload
