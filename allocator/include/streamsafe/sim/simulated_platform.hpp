// streamsafe: simulated_platform, the cuda::allocator front end over simulated devices, for
// host tests and the C API's simulated mode (no GPU needed).
//
// Device d is a sim::simulated_device whose addresses are shifted by address_offset(d), so that
// the devices' address ranges are disjoint, as under CUDA's unified virtual addressing (every
// simulated device numbers its memory from the same base). Work launched on a simulated device
// names the device's own addresses: pass pointers through device_address() first.
//
// The "current device" is per host thread and shared by every simulated_platform of the
// process (set_current_device, default 0). Streams are the simulated devices' handles; since
// those repeat across devices, stream_device() answers the current device. There is no
// per-thread default stream (cudaStreamPerThread): use 0 or created streams.
//
// Lifetime: the platform owns the devices; every allocator made over make_platform() must be
// destroyed before it. Thread safety: as sim::simulated_device (one mutex per device).
#pragma once

#include <streamsafe/backends/forwarding_backend.hpp>
#include <streamsafe/frontends/allocator.hpp>
#include <streamsafe/sim/simulated_device.hpp>

#include <cstdint>
#include <memory>
#include <vector>

namespace streamsafe::cuda {

class simulated_platform {
 public:
  explicit simulated_platform(int device_count, sim::device_config config = {}) {
    for (int d = 0; d < device_count; ++d) {
      sim::device_config c = config;
      c.device = d;
      devices_.push_back(std::make_unique<sim::simulated_device>(c));
    }
  }

  int device_count() const noexcept { return static_cast<int>(devices_.size()); }
  sim::simulated_device& device(int d) { return *devices_.at(static_cast<std::size_t>(d)); }

  // 4 TiB windows: device d's addresses are its simulated device's plus d * 4 TiB.
  static std::uintptr_t address_offset(int device) noexcept {
    return static_cast<std::uintptr_t>(device) << 42;
  }
  // The simulated device's own address of a pointer the allocator handed out on `device`.
  static std::uintptr_t device_address(const void* ptr, int device) noexcept {
    return reinterpret_cast<std::uintptr_t>(ptr) - address_offset(device);
  }

  static void set_current_device(int device) noexcept { current_device_ref() = device; }
  static int current_device() noexcept { return current_device_ref(); }

  platform make_platform() {
    platform p;
    p.device_count = [this] { return device_count(); };
    p.current_device = [] { return current_device(); };
    p.stream_device = [](stream_handle) { return current_device(); };
    p.make_backend = [this](int d, const options&) -> std::unique_ptr<device_backend> {
      return std::make_unique<shifted_backend>(device(d), address_offset(d));
    };
    return p;
  }

 private:
  static int& current_device_ref() noexcept {
    thread_local int current = 0;
    return current;
  }

  // A simulated device seen through an address shift: the calls that take or return addresses
  // shift them, the rest pass through. Offload (copy_async, host_backend) is not offered:
  // pause(tag, offload) needs a simulated_device used directly.
  class shifted_backend final : public forwarding_backend {
   public:
    shifted_backend(sim::simulated_device& dev, std::uintptr_t offset)
        : forwarding_backend(dev), dev_(dev), offset_(offset) {}

    void* allocate_segment(std::size_t size_bytes) override {
      return out(dev_.allocate_segment(size_bytes));
    }
    void free_segment(void* base, std::size_t size_bytes) override {
      dev_.free_segment(in(base), size_bytes);
    }
    void* reserve_address_range(std::size_t size_bytes) override {
      return out(dev_.reserve_address_range(size_bytes));
    }
    void release_address_range(void* base, std::size_t size_bytes) override {
      dev_.release_address_range(in(base), size_bytes);
    }
    bool map(void* addr, std::size_t size_bytes) override { return dev_.map(in(addr), size_bytes); }
    void unmap(void* addr, std::size_t size_bytes) override { dev_.unmap(in(addr), size_bytes); }
    bool map_alias(void* addr, const void* from, std::size_t size_bytes) override {
      return dev_.map_alias(in(addr), in(const_cast<void*>(from)), size_bytes);
    }
    void copy_async(void* dst, const void* src, std::size_t bytes, stream_handle stream) override {
      device_backend::copy_async(dst, src, bytes, stream);  // refuses by name
    }
    device_backend* host_backend() noexcept override { return nullptr; }
    // IPC: addresses shifted both ways; events as the device's.
    ipc_memory export_memory(std::uintptr_t segment_base, std::size_t segment_bytes,
                             std::uintptr_t addr, std::size_t size_bytes) override {
      return dev_.export_memory(segment_base - offset_, segment_bytes, addr - offset_, size_bytes);
    }
    std::uintptr_t import_memory(const ipc_memory& memory) override {
      return dev_.import_memory(memory) + offset_;
    }
    void close_imported_memory(std::uintptr_t addr) override {
      dev_.close_imported_memory(addr - offset_);
    }
    event_handle create_ipc_event() override { return dev_.create_ipc_event(); }
    std::vector<std::uint8_t> export_event(event_handle event) override {
      return dev_.export_event(event);
    }
    event_handle open_ipc_event(const std::vector<std::uint8_t>& bytes) override {
      return dev_.open_ipc_event(bytes);
    }
    void close_ipc_event(event_handle event) noexcept override { dev_.close_ipc_event(event); }

   private:
    void* out(void* p) const noexcept {
      return p ? reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(p) + offset_) : nullptr;
    }
    void* in(void* p) const noexcept {
      return p ? reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(p) - offset_) : nullptr;
    }

    sim::simulated_device& dev_;
    std::uintptr_t offset_;
  };

  std::vector<std::unique_ptr<sim::simulated_device>> devices_;
};

}  // namespace streamsafe::cuda
