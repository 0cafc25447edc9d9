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
#include <streamsafe/backends/device_backend.hpp>

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

class watching_backend final : public device_backend {
 public:
  watching_backend(std::unique_ptr<device_backend> inner, stream_handle watched)
      : inner_(std::move(inner)), watched_(watched) {}

  // True when this thread issued a wait on the watched stream since the last call; clears it.
  static bool take_wait_note() noexcept;

  int device() const noexcept override { return inner_->device(); }
  const char* name() const noexcept override { return inner_->name(); }
  void* allocate_segment(std::size_t size_bytes) override {
    return inner_->allocate_segment(size_bytes);
  }
  void free_segment(void* base, std::size_t size_bytes) override {
    inner_->free_segment(base, size_bytes);
  }
  bool free_segment_synchronizes() const noexcept override {
    return inner_->free_segment_synchronizes();
  }
  bool supports_expandable() const noexcept override { return inner_->supports_expandable(); }
  std::size_t map_granularity_bytes() const noexcept override {
    return inner_->map_granularity_bytes();
  }
  void* reserve_address_range(std::size_t size_bytes) override {
    return inner_->reserve_address_range(size_bytes);
  }
  void release_address_range(void* base, std::size_t size_bytes) override {
    inner_->release_address_range(base, size_bytes);
  }
  bool map(void* addr, std::size_t size_bytes) override { return inner_->map(addr, size_bytes); }
  void unmap(void* addr, std::size_t size_bytes) override { inner_->unmap(addr, size_bytes); }
  event_handle create_event() override { return inner_->create_event(); }
  void destroy_event(event_handle event) noexcept override { inner_->destroy_event(event); }
  void record_event(event_handle event, stream_handle stream) override {
    inner_->record_event(event, stream);
  }
  bool query_event(event_handle event) override { return inner_->query_event(event); }
  void synchronize_event(event_handle event) override { inner_->synchronize_event(event); }
  void stream_wait_event(stream_handle stream, event_handle event) override;
  bool query_stream(stream_handle stream) override { return inner_->query_stream(stream); }
  void synchronize_device() override { inner_->synchronize_device(); }
  void memory_info(std::size_t& free_bytes, std::size_t& total_bytes) override {
    inner_->memory_info(free_bytes, total_bytes);
  }
  bool stream_is_capturing(stream_handle stream) noexcept override {
    return inner_->stream_is_capturing(stream);
  }
  bool stream_is_per_thread(stream_handle stream) const noexcept override {
    return inner_->stream_is_per_thread(stream);
  }

 private:
  std::unique_ptr<device_backend> inner_;
  stream_handle watched_;
};

}  // namespace streamsafe::preload
