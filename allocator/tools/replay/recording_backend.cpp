// streamsafe-replay: recording_backend (see the header). Each memory call is forwarded first,
// without the lock; only a call that succeeded is noted, under mu_.
#include "recording_backend.hpp"

namespace streamsafe::replay {

void recording_backend::set_context(std::uint64_t time_us, stream_handle trace_stream,
                                    bool small_request) noexcept {
  std::lock_guard<std::mutex> lk(mu_);
  time_us_ = time_us;
  stream_ = trace_stream;
  small_ = small_request;
}

void recording_backend::set_recorder(trace_recorder* recorder) noexcept {
  std::lock_guard<std::mutex> lk(mu_);
  recorder_ = recorder;
}

std::int64_t recording_backend::reserved_bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return reserved_;
}

recording_backend::counts recording_backend::operation_counts() const {
  std::lock_guard<std::mutex> lk(mu_);
  return counts_;
}

std::map<std::uintptr_t, recording_backend::segment_view> recording_backend::segments() const {
  std::lock_guard<std::mutex> lk(mu_);
  return segments_;
}

void recording_backend::note_locked(trace_action action, std::uintptr_t address, std::size_t size) {
  if (recorder_)
    recorder_->record(trace_event{time_us_, action, address, size, stream_, inner().device()});
}

recording_backend::segment_view* recording_backend::range_containing_locked(
    std::uintptr_t address) {
  auto it = segments_.upper_bound(address);
  if (it == segments_.begin()) return nullptr;
  --it;
  segment_view& s = it->second;
  return s.expandable && address < s.base + s.size_bytes ? &s : nullptr;
}

void* recording_backend::allocate_segment(std::size_t size_bytes) {
  void* base = inner().allocate_segment(size_bytes);
  if (!base) return nullptr;
  std::lock_guard<std::mutex> lk(mu_);
  const auto addr = reinterpret_cast<std::uintptr_t>(base);
  segment_view& s = segments_[addr];
  s.base = addr;
  s.size_bytes = size_bytes;
  s.stream = stream_;
  s.small = small_;
  reserved_ += static_cast<std::int64_t>(size_bytes);
  ++counts_.segment_allocs;
  note_locked(trace_action::segment_alloc, addr, size_bytes);
  return base;
}

void recording_backend::free_segment(void* base, std::size_t size_bytes) {
  inner().free_segment(base, size_bytes);
  std::lock_guard<std::mutex> lk(mu_);
  const auto addr = reinterpret_cast<std::uintptr_t>(base);
  segments_.erase(addr);
  reserved_ -= static_cast<std::int64_t>(size_bytes);
  ++counts_.segment_frees;
  note_locked(trace_action::segment_free, addr, size_bytes);
}

void* recording_backend::reserve_address_range(std::size_t size_bytes) {
  void* base = inner().reserve_address_range(size_bytes);
  std::lock_guard<std::mutex> lk(mu_);
  const auto addr = reinterpret_cast<std::uintptr_t>(base);
  segment_view& s = segments_[addr];
  s.base = addr;
  s.size_bytes = size_bytes;
  s.expandable = true;
  s.stream = stream_;
  s.small = small_;
  return base;
}

void recording_backend::release_address_range(void* base, std::size_t size_bytes) {
  inner().release_address_range(base, size_bytes);
  std::lock_guard<std::mutex> lk(mu_);
  segments_.erase(reinterpret_cast<std::uintptr_t>(base));
}

bool recording_backend::map(void* addr, std::size_t size_bytes) {
  if (!inner().map(addr, size_bytes)) return false;
  std::lock_guard<std::mutex> lk(mu_);
  const auto a = reinterpret_cast<std::uintptr_t>(addr);
  if (segment_view* s = range_containing_locked(a)) s->mapped[a] = size_bytes;
  reserved_ += static_cast<std::int64_t>(size_bytes);
  ++counts_.maps;
  note_locked(trace_action::segment_map, a, size_bytes);
  return true;
}

void recording_backend::unmap(void* addr, std::size_t size_bytes) {
  inner().unmap(addr, size_bytes);
  std::lock_guard<std::mutex> lk(mu_);
  const auto a = reinterpret_cast<std::uintptr_t>(addr);
  if (segment_view* s = range_containing_locked(a)) {
    // The range is a union of whole mapped ranges.
    s->mapped.erase(s->mapped.lower_bound(a), s->mapped.lower_bound(a + size_bytes));
  }
  reserved_ -= static_cast<std::int64_t>(size_bytes);
  ++counts_.unmaps;
  note_locked(trace_action::segment_unmap, a, size_bytes);
}

}  // namespace streamsafe::replay
