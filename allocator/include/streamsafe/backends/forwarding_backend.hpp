// streamsafe: forwarding_backend, a device_backend that passes every call to another one.
//
// The base of backends that change a few calls of a real one and keep the rest: derive, override
// what differs, and everything else (segments, expandable ranges, events, streams, copies, the
// host backend, IPC) reaches `inner`, which must outlive it. Thread safety: that of `inner`.
#pragma once

#include <streamsafe/backends/device_backend.hpp>

namespace streamsafe {

class forwarding_backend : public device_backend {
 public:
  explicit forwarding_backend(device_backend& inner) noexcept : inner_(inner) {}

  device_backend& inner() const noexcept { return inner_; }

  int device() const noexcept override { return inner_.device(); }
  const char* name() const noexcept override { return inner_.name(); }
  void* allocate_segment(std::size_t size_bytes) override {
    return inner_.allocate_segment(size_bytes);
  }
  void free_segment(void* base, std::size_t size_bytes) override {
    inner_.free_segment(base, size_bytes);
  }
  bool free_segment_synchronizes() const noexcept override {
    return inner_.free_segment_synchronizes();
  }
  bool supports_expandable() const noexcept override { return inner_.supports_expandable(); }
  std::size_t map_granularity_bytes() const noexcept override {
    return inner_.map_granularity_bytes();
  }
  void* reserve_address_range(std::size_t size_bytes) override {
    return inner_.reserve_address_range(size_bytes);
  }
  void release_address_range(void* base, std::size_t size_bytes) override {
    inner_.release_address_range(base, size_bytes);
  }
  bool map(void* addr, std::size_t size_bytes) override { return inner_.map(addr, size_bytes); }
  void unmap(void* addr, std::size_t size_bytes) override { inner_.unmap(addr, size_bytes); }
  bool synchronize_event_for(event_handle event, std::uint64_t timeout_us) override {
    return inner_.synchronize_event_for(event, timeout_us);
  }
  bool map_alias(void* addr, const void* from, std::size_t size_bytes) override {
    return inner_.map_alias(addr, from, size_bytes);
  }
  event_handle create_event() override { return inner_.create_event(); }
  void destroy_event(event_handle event) noexcept override { inner_.destroy_event(event); }
  void record_event(event_handle event, stream_handle stream) override {
    inner_.record_event(event, stream);
  }
  bool query_event(event_handle event) override { return inner_.query_event(event); }
  void synchronize_event(event_handle event) override { inner_.synchronize_event(event); }
  void stream_wait_event(stream_handle stream, event_handle event) override {
    inner_.stream_wait_event(stream, event);
  }
  bool query_stream(stream_handle stream) override { return inner_.query_stream(stream); }
  void synchronize_device() override { inner_.synchronize_device(); }
  void memory_info(std::size_t& free_bytes, std::size_t& total_bytes) override {
    inner_.memory_info(free_bytes, total_bytes);
  }
  bool stream_is_capturing(stream_handle stream) noexcept override {
    return inner_.stream_is_capturing(stream);
  }
  std::uint64_t capture_id(stream_handle stream) noexcept override {
    return inner_.capture_id(stream);
  }
  std::vector<std::uintptr_t> capture_position(stream_handle stream) override {
    return inner_.capture_position(stream);
  }
  bool capture_follows(stream_handle stream, const std::vector<std::uintptr_t>& position) override {
    return inner_.capture_follows(stream, position);
  }
  bool stream_is_per_thread(stream_handle stream) const noexcept override {
    return inner_.stream_is_per_thread(stream);
  }
  stream_handle create_stream() override { return inner_.create_stream(); }
  void destroy_stream(stream_handle stream) override { inner_.destroy_stream(stream); }
  void copy_async(void* dst, const void* src, std::size_t bytes, stream_handle stream) override {
    inner_.copy_async(dst, src, bytes, stream);
  }
  device_backend* host_backend() noexcept override { return inner_.host_backend(); }
  ipc_memory export_memory(std::uintptr_t segment_base, std::size_t segment_bytes,
                           std::uintptr_t addr, std::size_t size_bytes) override {
    return inner_.export_memory(segment_base, segment_bytes, addr, size_bytes);
  }
  std::uintptr_t import_memory(const ipc_memory& memory) override {
    return inner_.import_memory(memory);
  }
  void close_imported_memory(std::uintptr_t addr) override { inner_.close_imported_memory(addr); }
  event_handle create_ipc_event() override { return inner_.create_ipc_event(); }
  std::vector<std::uint8_t> export_event(event_handle event) override {
    return inner_.export_event(event);
  }
  event_handle open_ipc_event(const std::vector<std::uint8_t>& bytes) override {
    return inner_.open_ipc_event(bytes);
  }
  void close_ipc_event(event_handle event) noexcept override { inner_.close_ipc_event(event); }

 private:
  device_backend& inner_;
};

}  // namespace streamsafe
