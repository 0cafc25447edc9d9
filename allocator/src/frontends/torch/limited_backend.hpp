// streamsafe PyTorch extension: limited_backend (internal), the device backend under each
// device's streamsafe allocator: it enforces torch.cuda.set_per_process_memory_fraction (a cap
// on the bytes backed by device memory) and reports segment events to the memory history
// (torch_history.cpp defines note()).
#pragma once

#include <streamsafe/backends/device_backend.hpp>

#include <c10/core/CachingDeviceAllocator.h>

#include <atomic>
#include <cstddef>
#include <memory>

namespace streamsafe::torch_ext {

namespace cda = c10::CachingDeviceAllocator;

class torch_allocator;

// Forwards every call to the device's real backend; refuses growth beyond a per-device cap on
// reserved bytes (set_per_process_memory_fraction) as the device being out of memory, so that
// streamsafe's out-of-memory path (release behind a fence, retry, out_of_memory) applies; and
// reports segment events to the history.
class limited_backend final : public device_backend {
 public:
  limited_backend(std::unique_ptr<device_backend> inner, std::atomic<std::size_t>* limit_bytes,
                  torch_allocator* owner)
      : inner_(std::move(inner)), limit_bytes_(limit_bytes), owner_(owner) {}

  int device() const noexcept override { return inner_->device(); }
  const char* name() const noexcept override { return inner_->name(); }
  void* allocate_segment(std::size_t size_bytes) override {
    if (!take(size_bytes)) return nullptr;
    void* p = nullptr;
    try {
      p = inner_->allocate_segment(size_bytes);
    } catch (...) {
      backed_bytes_.fetch_sub(size_bytes);
      throw;
    }
    if (!p) {
      backed_bytes_.fetch_sub(size_bytes);
      return nullptr;
    }
    note(cda::TraceEntry::SEGMENT_ALLOC, p, size_bytes);
    return p;
  }
  void free_segment(void* base, std::size_t size_bytes) override {
    inner_->free_segment(base, size_bytes);
    backed_bytes_.fetch_sub(size_bytes);
    note(cda::TraceEntry::SEGMENT_FREE, base, size_bytes);
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
  bool map(void* addr, std::size_t size_bytes) override {
    if (!take(size_bytes)) return false;
    bool ok = false;
    try {
      ok = inner_->map(addr, size_bytes);
    } catch (...) {
      backed_bytes_.fetch_sub(size_bytes);
      throw;
    }
    if (!ok) {
      backed_bytes_.fetch_sub(size_bytes);
      return false;
    }
    note(cda::TraceEntry::SEGMENT_MAP, addr, size_bytes);
    return true;
  }
  void unmap(void* addr, std::size_t size_bytes) override {
    inner_->unmap(addr, size_bytes);
    backed_bytes_.fetch_sub(size_bytes);
    note(cda::TraceEntry::SEGMENT_UNMAP, addr, size_bytes);
  }
  event_handle create_event() override { return inner_->create_event(); }
  void destroy_event(event_handle event) noexcept override { inner_->destroy_event(event); }
  void record_event(event_handle event, stream_handle stream) override {
    inner_->record_event(event, stream);
  }
  bool query_event(event_handle event) override { return inner_->query_event(event); }
  void synchronize_event(event_handle event) override { inner_->synchronize_event(event); }
  void stream_wait_event(stream_handle stream, event_handle event) override {
    inner_->stream_wait_event(stream, event);
  }
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
  bool take(std::size_t size_bytes) {
    const std::size_t limit = limit_bytes_->load(std::memory_order_relaxed);
    const std::size_t before = backed_bytes_.fetch_add(size_bytes);
    if (limit != 0 && before + size_bytes > limit) {
      backed_bytes_.fetch_sub(size_bytes);
      return false;
    }
    return true;
  }
  void note(cda::TraceEntry::Action action, void* addr, std::size_t size_bytes) noexcept;

  std::unique_ptr<device_backend> inner_;
  std::atomic<std::size_t>* limit_bytes_;
  torch_allocator* owner_;
  std::atomic<std::size_t> backed_bytes_{0};
};

}  // namespace streamsafe::torch_ext
