// streamsafe: the simulated device's model of interprocess sharing (simulated_device.hpp): the
// exporter and the importer are two allocators on this one device; an import is a view of the
// exported range at the same address, an opened event an alias of the exported one.
#include "device_model.hpp"

#include <cstring>

namespace streamsafe::sim {
namespace {

constexpr std::uint32_t k_memory_tag = 0x4d495353;  // "SSIM"
constexpr std::uint32_t k_event_tag = 0x45495353;   // "SSIE"

struct memory_wire {
  std::uint32_t tag = k_memory_tag;
  std::uint32_t device = 0;
  std::uint64_t addr = 0, size = 0;
};

struct event_wire {
  std::uint32_t tag = k_event_tag;
  std::uint32_t device = 0;
  std::uint64_t event = 0;
};

template <class T>
std::vector<std::uint8_t> to_bytes(const T& v) {
  std::vector<std::uint8_t> out(sizeof v);
  std::memcpy(out.data(), &v, sizeof v);
  return out;
}

}  // namespace

device_backend::ipc_memory simulated_device::export_memory(std::uintptr_t segment_base,
                                                           std::size_t segment_bytes,
                                                           std::uintptr_t addr,
                                                           std::size_t size_bytes) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  if (addr < segment_base || addr + size_bytes > segment_base + segment_bytes || size_bytes == 0)
    d.fail("export_memory", "the range " + hex(addr) + " is not inside its segment");
  if (auto gap = d.first_unbacked(addr, size_bytes))
    d.fail("export_memory", "the range " + hex(addr) + " is not backed at " + hex(*gap));
  memory_wire w;
  w.device = static_cast<std::uint32_t>(d.config_.device);
  w.addr = addr;
  w.size = size_bytes;
  ++d.counters_.ipc_exports;
  return ipc_memory{to_bytes(w), {}};
}

std::uintptr_t simulated_device::import_memory(const ipc_memory& memory) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  memory_wire w;
  if (memory.bytes.size() != sizeof w) d.fail("import_memory", "not a simulated export");
  std::memcpy(&w, memory.bytes.data(), sizeof w);
  if (w.tag != k_memory_tag || w.device != static_cast<std::uint32_t>(d.config_.device))
    d.fail("import_memory", "not an export of this simulated device");
  if (auto gap = d.first_unbacked(w.addr, w.size))
    d.fail("import_memory", "the exported range is no longer backed at " + hex(*gap));
  d.ipc_imports_.emplace(w.addr, w.size);
  ++d.counters_.ipc_imports;
  return w.addr;
}

void simulated_device::close_imported_memory(std::uintptr_t addr) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  auto it = d.ipc_imports_.find(addr);
  if (it == d.ipc_imports_.end()) d.fail("close_imported_memory", "no import at " + hex(addr));
  // Unmapping the consumer's view under its pending work faults on a GPU.
  d.check_release("close_imported_memory", addr, it->second);
  d.ipc_imports_.erase(it);
  ++d.counters_.ipc_closes;
}

event_handle simulated_device::create_ipc_event() {
  const event_handle e = create_event();
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl_->ipc_events_.insert(e);
  return e;
}

std::vector<std::uint8_t> simulated_device::export_event(event_handle event) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  if (d.ipc_events_.count(event) == 0)
    d.fail("export_event", "event " + std::to_string(event) + " is not an interprocess event");
  event_wire w;
  w.device = static_cast<std::uint32_t>(d.config_.device);
  w.event = event;
  return to_bytes(w);
}

event_handle simulated_device::open_ipc_event(const std::vector<std::uint8_t>& bytes) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  event_wire w;
  if (bytes.size() != sizeof w) d.fail("open_ipc_event", "not a simulated event handle");
  std::memcpy(&w, bytes.data(), sizeof w);
  const auto target = static_cast<event_handle>(w.event);
  if (w.tag != k_event_tag || d.ipc_events_.count(target) == 0 || d.ipc_orphans_.count(target) != 0)
    d.fail("open_ipc_event", "no such interprocess event");
  const event_handle alias = d.next_event_handle_++;
  d.ipc_aliases_.emplace(alias, target);
  ++d.ipc_alias_count_[target];
  return alias;
}

void simulated_device::close_ipc_event(event_handle event) noexcept { destroy_event(event); }

std::size_t simulated_device::open_import_count() const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return impl_->ipc_imports_.size();
}

}  // namespace streamsafe::sim
