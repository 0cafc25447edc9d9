// Test support: a device_backend that forwards every call to a simulated device. Tests derive
// from it and override the calls they hook (a delay, a callback, a remapped stream).
#pragma once

#include <streamsafe/sim/simulated_device.hpp>

namespace streamsafe::test {

class forwarding_device : public device_backend {
 public:
  explicit forwarding_device(sim::simulated_device& dev) : dev_(dev) {}

  int device() const noexcept override { return dev_.device(); }
  const char* name() const noexcept override { return dev_.name(); }
  void* allocate_segment(std::size_t n) override { return dev_.allocate_segment(n); }
  void free_segment(void* base, std::size_t n) override { dev_.free_segment(base, n); }
  bool free_segment_synchronizes() const noexcept override {
    return dev_.free_segment_synchronizes();
  }
  bool supports_expandable() const noexcept override { return dev_.supports_expandable(); }
  std::size_t map_granularity_bytes() const noexcept override {
    return dev_.map_granularity_bytes();
  }
  void* reserve_address_range(std::size_t n) override { return dev_.reserve_address_range(n); }
  void release_address_range(void* base, std::size_t n) override {
    dev_.release_address_range(base, n);
  }
  bool map(void* p, std::size_t n) override { return dev_.map(p, n); }
  void unmap(void* p, std::size_t n) override { dev_.unmap(p, n); }
  event_handle create_event() override { return dev_.create_event(); }
  void destroy_event(event_handle e) noexcept override { dev_.destroy_event(e); }
  void record_event(event_handle e, stream_handle s) override { dev_.record_event(e, s); }
  bool query_event(event_handle e) override { return dev_.query_event(e); }
  void synchronize_event(event_handle e) override { dev_.synchronize_event(e); }
  void stream_wait_event(stream_handle s, event_handle e) override { dev_.stream_wait_event(s, e); }
  bool query_stream(stream_handle s) override { return dev_.query_stream(s); }
  void synchronize_device() override { dev_.synchronize_device(); }
  void memory_info(std::size_t& free_bytes, std::size_t& total_bytes) override {
    dev_.memory_info(free_bytes, total_bytes);
  }
  bool stream_is_capturing(stream_handle s) noexcept override {
    return dev_.stream_is_capturing(s);
  }

 protected:
  sim::simulated_device& dev_;
};

}  // namespace streamsafe::test
