// streamsafe: the simulated device's pinned host memory as a device_backend (internal to
// src/sim/): segments are simulated_device::allocate_host ranges; streams, events and copies are
// the device's own. No expandable segments.
#pragma once

#include <streamsafe/backends/forwarding_backend.hpp>
#include <streamsafe/sim/simulated_device.hpp>

namespace streamsafe::sim {

class simulated_device::host_view final : public forwarding_backend {
 public:
  explicit host_view(simulated_device& dev) : forwarding_backend(dev), dev_(dev) {}

  const char* name() const noexcept override { return "simulated_host"; }
  void* allocate_segment(std::size_t size_bytes) override { return dev_.allocate_host(size_bytes); }
  void free_segment(void* base, std::size_t size_bytes) override {
    dev_.free_host(base, size_bytes);
  }
  bool free_segment_synchronizes() const noexcept override { return false; }
  bool supports_expandable() const noexcept override { return false; }
  std::size_t map_granularity_bytes() const noexcept override { return 0; }
  void* reserve_address_range(std::size_t size_bytes) override {
    return device_backend_refuses("reserve_address_range", size_bytes);
  }
  void release_address_range(void* /*base*/, std::size_t size_bytes) override {
    device_backend_refuses("release_address_range", size_bytes);
  }
  bool map(void* /*addr*/, std::size_t size_bytes) override {
    return device_backend_refuses("map", size_bytes) != nullptr;
  }
  void unmap(void* /*addr*/, std::size_t size_bytes) override {
    device_backend_refuses("unmap", size_bytes);
  }
  device_backend* host_backend() noexcept override { return nullptr; }

 private:
  [[noreturn]] void* device_backend_refuses(const char* call, std::size_t size_bytes) const;

  simulated_device& dev_;
};

}  // namespace streamsafe::sim
