// streamsafe: the simulated device's pinned host memory and stream-ordered copies
// (device_model.hpp: state and lock; host_view.hpp: the host backend).
#include "device_model.hpp"
#include "host_view.hpp"

#include <streamsafe/core/errors.hpp>

#include <mutex>
#include <string>

namespace streamsafe::sim {

void* simulated_device::host_view::device_backend_refuses(const char* call,
                                                          std::size_t size_bytes) const {
  throw backend_error(std::string("simulated_device(device ") + std::to_string(device()) +
                      "): " + call + " (" + std::to_string(size_bytes) +
                      " bytes): pinned host memory has no expandable segments");
}

void* simulated_device::allocate_host(std::size_t size_bytes) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  if (d.injected(call::allocate_segment)) return nullptr;
  if (size_bytes == 0 || size_bytes % 512 != 0) {
    d.fail("allocate_host",
           "size " + std::to_string(size_bytes) + " is not a positive multiple of 512");
  }
  const std::uintptr_t base = d.host_next_address_;
  // A guard granule after each range, as for device segments.
  d.host_next_address_ += round_up(size_bytes, d.config_.granularity_bytes) +
                          d.config_.granularity_bytes;
  d.segments_.emplace(base, size_bytes);
  d.host_segments_.insert(base);
  d.host_bytes_ += size_bytes;
  return reinterpret_cast<void*>(base);
}

void simulated_device::free_host(void* base, std::size_t size_bytes) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  d.throw_if_injected(call::free_segment);
  d.check_not_capturing("free_host");
  const auto addr = reinterpret_cast<std::uintptr_t>(base);
  auto it = d.segments_.find(addr);
  if (it == d.segments_.end() || d.host_segments_.count(addr) == 0 || it->second != size_bytes)
    d.fail("free_host", "no pinned host range " + describe_range(addr, size_bytes));
  d.check_release("free_host", addr, size_bytes);
  d.segments_.erase(it);
  d.host_segments_.erase(addr);
  d.host_bytes_ -= size_bytes;
  d.assign_contents(addr, addr + size_bytes, std::nullopt);
}

std::size_t simulated_device::host_bytes_in_use() const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return impl_->host_bytes_;
}

void simulated_device::copy_async(void* dst, const void* src, std::size_t bytes,
                                  stream_handle stream) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  if (bytes == 0) return;
  if (d.live_stream(stream, "copy_async").capture != 0)
    d.fail("copy_async", "stream " + std::to_string(stream) + " is capturing a graph");
  const auto to = reinterpret_cast<std::uintptr_t>(dst);
  const auto from = reinterpret_cast<std::uintptr_t>(src);
  std::vector<range> ranges{{from, bytes, access::read, std::nullopt},
                            {to, bytes, access::write, std::nullopt}};
  const std::uint64_t id = d.launch_locked(stream, 1 + (bytes >> 20), std::move(ranges),
                                           "copy_async");
  work_item& item = d.pending_.at(id);  // 1 us at least: still pending
  item.copy_src = from;
  item.copy_dst = to;
  item.copy_bytes = bytes;
}

device_backend* simulated_device::host_backend() noexcept {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  if (!host_) host_ = std::make_unique<host_view>(*this);
  return host_.get();
}

}  // namespace streamsafe::sim
