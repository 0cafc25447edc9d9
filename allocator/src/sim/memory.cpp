// streamsafe: the simulated device's memory: segments, expandable address ranges and their
// mapped chunks, the contents model and bytes in use (device_model.hpp: state and lock).
#include "device_model.hpp"

#include <streamsafe/core/errors.hpp>

#include <algorithm>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>

namespace streamsafe::sim {

// ---- memory contents --------------------------------------------------------------------

std::optional<std::uint8_t> simulated_device::value_at(std::uintptr_t addr) const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  const auto& contents = impl_->contents_;
  auto it = contents.upper_bound(addr);
  if (it == contents.begin()) return std::nullopt;
  --it;
  if (addr < it->second.first) return it->second.second;
  return std::nullopt;
}

bool simulated_device::is_mapped(std::uintptr_t addr, std::size_t size_bytes) const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return !impl_->first_unbacked(addr, std::max<std::size_t>(size_bytes, 1)).has_value();
}

std::size_t simulated_device::bytes_in_use() const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return impl_->bytes_in_use_;
}

// ---- device_backend: segments -----------------------------------------------------------

int simulated_device::device() const noexcept { return impl_->config_.device; }

const char* simulated_device::name() const noexcept { return "simulated"; }

void* simulated_device::allocate_segment(std::size_t size_bytes) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  if (d.injected(call::allocate_segment)) return nullptr;
  if (size_bytes == 0 || size_bytes % 512 != 0) {
    d.fail("allocate_segment",
           "size " + std::to_string(size_bytes) + " is not a positive multiple of 512");
  }
  if (size_bytes > d.config_.total_bytes - d.bytes_in_use_) return nullptr;
  // One unused granule after each segment, so an overrun is an access_unmapped fault.
  const std::size_t span = round_up(size_bytes, d.config_.granularity_bytes) +
                           d.config_.granularity_bytes;
  std::uintptr_t base = d.next_address_;
  auto reuse = std::find_if(d.freed_ranges_.begin(), d.freed_ranges_.end(),
                            [span](const auto& r) { return r.second >= span; });
  if (reuse != d.freed_ranges_.end()) {
    base = reuse->first;
    if (reuse->second > span) d.freed_ranges_.emplace(base + span, reuse->second - span);
    d.freed_ranges_.erase(reuse);
  } else {
    d.next_address_ += span;
  }
  d.segments_.emplace(base, size_bytes);
  d.bytes_in_use_ += size_bytes;
  ++d.counters_.segment_allocs;
  if (d.capturing_streams_ != 0) ++d.counters_.segment_allocs_during_capture;
  return reinterpret_cast<void*>(base);
}

void simulated_device::free_segment(void* base, std::size_t size_bytes) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  d.throw_if_injected(call::free_segment);
  d.check_not_capturing("free_segment");
  const auto addr = reinterpret_cast<std::uintptr_t>(base);
  auto it = d.segments_.find(addr);
  if (it == d.segments_.end()) d.fail("free_segment", "unknown segment " + hex(addr));
  if (it->second != size_bytes) {
    d.fail("free_segment", "segment " + hex(addr) + " has " + std::to_string(it->second) +
                               " bytes, not " + std::to_string(size_bytes));
  }
  if (d.config_.free_segment_synchronizes && !d.advance_until([&d] { return d.idle(); })) {
    d.fail("free_segment",
           d.deadlock_message("the device-wide wait of free_segment (as cudaFree)"));
  }
  d.check_release("free_segment", addr, size_bytes);
  d.segments_.erase(it);
  d.bytes_in_use_ -= size_bytes;
  d.assign_contents(addr, addr + size_bytes, std::nullopt);
  if (d.config_.reuse_freed_addresses) {
    d.freed_ranges_.emplace(
        addr, round_up(size_bytes, d.config_.granularity_bytes) + d.config_.granularity_bytes);
  }
  ++d.counters_.segment_frees;
}

bool simulated_device::free_segment_synchronizes() const noexcept {
  return impl_->config_.free_segment_synchronizes;
}

// ---- device_backend: expandable segments ------------------------------------------------

bool simulated_device::supports_expandable() const noexcept {
  return impl_->config_.supports_expandable;
}

std::size_t simulated_device::map_granularity_bytes() const noexcept {
  return impl_->config_.granularity_bytes;
}

void* simulated_device::reserve_address_range(std::size_t size_bytes) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  d.throw_if_injected(call::reserve_address_range);
  if (!d.config_.supports_expandable) d.fail("reserve_address_range", "not supported");
  const std::size_t gran = d.config_.granularity_bytes;
  if (size_bytes == 0 || size_bytes % gran != 0) {
    d.fail("reserve_address_range", "size " + std::to_string(size_bytes) +
                                        " is not a positive multiple of the granularity " +
                                        std::to_string(gran));
  }
  const std::uintptr_t base = d.next_address_;
  d.next_address_ += size_bytes + gran;  // a guard granule, as for segments
  d.reservations_.emplace(base, size_bytes);
  return reinterpret_cast<void*>(base);
}

void simulated_device::release_address_range(void* base, std::size_t size_bytes) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  d.throw_if_injected(call::release_address_range);
  d.check_not_capturing("release_address_range");
  const auto addr = reinterpret_cast<std::uintptr_t>(base);
  auto it = d.reservations_.find(addr);
  if (it == d.reservations_.end() || it->second != size_bytes) {
    d.fail("release_address_range", "no reservation " + describe_range(addr, size_bytes));
  }
  auto chunk = d.mapped_chunks_.lower_bound(addr);
  if (chunk != d.mapped_chunks_.end() && *chunk < addr + size_bytes) {
    d.fail("release_address_range",
           "chunk " + hex(*chunk) + " of " + describe_range(addr, size_bytes) + " is still mapped");
  }
  d.reservations_.erase(it);
}

bool simulated_device::map(void* addr_ptr, std::size_t size_bytes) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  if (d.injected(call::map)) return false;
  if (!d.config_.supports_expandable) d.fail("map", "not supported");
  const auto addr = reinterpret_cast<std::uintptr_t>(addr_ptr);
  const std::size_t gran = d.config_.granularity_bytes;
  if (size_bytes == 0 || size_bytes % gran != 0 || addr % gran != 0) {
    d.fail("map", describe_range(addr, size_bytes) + " is not aligned to the granularity " +
                      std::to_string(gran));
  }
  auto res = d.reservations_.upper_bound(addr);
  if (res == d.reservations_.begin() ||
      addr + size_bytes > std::prev(res)->first + std::prev(res)->second) {
    d.fail("map", describe_range(addr, size_bytes) + " is not inside a reserved range");
  }
  for (std::uintptr_t chunk = addr; chunk < addr + size_bytes; chunk += gran) {
    if (d.mapped_chunks_.count(chunk) != 0)
      d.fail("map", "chunk " + hex(chunk) + " is already mapped");
  }
  if (size_bytes > d.config_.total_bytes - d.bytes_in_use_) return false;
  // The access set: this device and every peer that can access it (K13), less the injected
  // omissions.
  std::vector<int> access{d.config_.device};
  for (const auto& peer : d.config_.peers) {
    if (!peer.can_access) continue;
    auto omit = d.omitted_peer_maps_.find(peer.device);
    if (omit != d.omitted_peer_maps_.end() && omit->second > 0) {
      if (--omit->second == 0) d.omitted_peer_maps_.erase(omit);
      continue;
    }
    access.push_back(peer.device);
  }
  std::sort(access.begin(), access.end());
  // The debug check: every chunk of a reserved range carries the same access set.
  const std::uintptr_t range_base = std::prev(res)->first;
  const std::uintptr_t range_end = range_base + std::prev(res)->second;
  const bool uniform = d.own_access_only(access) && d.other_access_chunks_ == 0;
  for (auto it = uniform ? d.chunk_access_.end() : d.chunk_access_.lower_bound(range_base);
       it != d.chunk_access_.end() && it->first < range_end; ++it) {
    if (it->second == access) continue;
    auto names = [](const std::vector<int>& set) {
      std::string text = "{";
      for (int dev : set) text += (text.size() > 1 ? ", " : "") + std::to_string(dev);
      return text + "}";
    };
    d.record_fault(fault_kind::access_mismatch, "map " + describe_range(addr, size_bytes) +
                                                    " grants access to devices " + names(access) +
                                                    ", chunk " + hex(it->first) +
                                                    " of the same range to " + names(it->second));
    break;
  }
  for (std::uintptr_t chunk = addr; chunk < addr + size_bytes; chunk += gran) {
    d.mapped_chunks_.insert(chunk);
    d.set_chunk_access(chunk, access);
    const std::uint64_t memory = d.next_memory_++;
    d.chunk_memory_[chunk] = memory;
    d.memory_chunks_[memory].push_back(chunk);
  }
  d.bytes_in_use_ += size_bytes;
  ++d.counters_.maps;
  if (d.capturing_streams_ != 0) ++d.counters_.maps_during_capture;
  d.counters_.bytes_mapped += size_bytes;
  return true;
}

void simulated_device::unmap(void* addr_ptr, std::size_t size_bytes) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  d.throw_if_injected(call::unmap);
  d.check_not_capturing("unmap");
  if (!d.config_.supports_expandable) d.fail("unmap", "not supported");
  const auto addr = reinterpret_cast<std::uintptr_t>(addr_ptr);
  const std::size_t gran = d.config_.granularity_bytes;
  if (size_bytes == 0 || size_bytes % gran != 0 || addr % gran != 0) {
    d.fail("unmap", describe_range(addr, size_bytes) + " is not aligned to the granularity " +
                        std::to_string(gran));
  }
  for (std::uintptr_t chunk = addr; chunk < addr + size_bytes; chunk += gran) {
    if (d.mapped_chunks_.count(chunk) == 0)
      d.fail("unmap", "chunk " + hex(chunk) + " is not mapped");
  }
  d.check_release("unmap", addr, size_bytes);
  std::size_t freed = 0;
  for (std::uintptr_t chunk = addr; chunk < addr + size_bytes; chunk += gran) {
    d.mapped_chunks_.erase(chunk);
    d.erase_chunk_access(chunk);
    auto mem = d.chunk_memory_.find(chunk);
    auto& chunks = d.memory_chunks_.at(mem->second);
    if (chunks.size() == 2) --d.aliased_memories_;
    chunks.erase(std::find(chunks.begin(), chunks.end(), chunk));
    if (chunks.empty()) {
      d.memory_chunks_.erase(mem->second);
      freed += gran;  // its last mapping: the memory goes back
    }
    d.chunk_memory_.erase(mem);
  }
  d.bytes_in_use_ -= freed;
  d.assign_contents(addr, addr + size_bytes, std::nullopt);
  ++d.counters_.unmaps;
  d.counters_.bytes_unmapped += size_bytes;
}

bool simulated_device::map_alias(void* addr_ptr, const void* from_ptr, std::size_t size_bytes) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  if (d.injected(call::map)) return false;
  if (!d.config_.supports_expandable) d.fail("map_alias", "not supported");
  const auto addr = reinterpret_cast<std::uintptr_t>(addr_ptr);
  const auto from = reinterpret_cast<std::uintptr_t>(from_ptr);
  const std::size_t gran = d.config_.granularity_bytes;
  if (size_bytes == 0 || size_bytes % gran != 0 || addr % gran != 0 || from % gran != 0) {
    d.fail("map_alias", describe_range(addr, size_bytes) + " from " + hex(from) +
                            " is not aligned to the granularity " + std::to_string(gran));
  }
  auto res = d.reservations_.upper_bound(addr);
  if (res == d.reservations_.begin() ||
      addr + size_bytes > std::prev(res)->first + std::prev(res)->second) {
    d.fail("map_alias", describe_range(addr, size_bytes) + " is not inside a reserved range");
  }
  for (std::size_t off = 0; off < size_bytes; off += gran) {
    if (d.mapped_chunks_.count(addr + off) != 0)
      d.fail("map_alias", "chunk " + hex(addr + off) + " is already mapped");
    if (d.mapped_chunks_.count(from + off) == 0)
      d.fail("map_alias", "source chunk " + hex(from + off) + " is not mapped");
  }
  for (std::size_t off = 0; off < size_bytes; off += gran) {
    const std::uint64_t memory = d.chunk_memory_.at(from + off);
    auto& chunks = d.memory_chunks_.at(memory);
    if (chunks.size() == 1) ++d.aliased_memories_;
    chunks.push_back(addr + off);
    d.chunk_memory_[addr + off] = memory;
    d.mapped_chunks_.insert(addr + off);
    d.set_chunk_access(addr + off, d.chunk_access_.at(from + off));
  }
  d.copy_contents(addr, from, size_bytes);
  ++d.counters_.aliases;
  d.counters_.bytes_aliased += size_bytes;
  return true;
}

std::vector<int> simulated_device::access_devices(std::uintptr_t addr) const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  const impl& d = *impl_;
  const std::size_t gran = d.config_.granularity_bytes;
  auto it = d.chunk_access_.find(addr / gran * gran);
  return it == d.chunk_access_.end() ? std::vector<int>{} : it->second;
}

void simulated_device::omit_peer_on_next_maps(int device, int maps) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  if (maps > 0) impl_->omitted_peer_maps_[device] = maps;
}

}  // namespace streamsafe::sim
