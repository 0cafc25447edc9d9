// streamsafe core: the trace recorder (a bounded ring of trace_event) and its JSON / CSV forms.
//
// The ring is a vector of capacity_ events allocated in the constructor; next_ is the slot the
// next record() writes and count_ how many slots hold events, so the oldest event sits at
// (next_ + capacity_ - count_) % capacity_. mu_ guards ring_, next_, count_ and recorded_.
// The writers emit only integers and fixed action names, so no JSON escaping is needed.
#include <streamsafe/core/trace.hpp>

#include <chrono>
#include <ostream>

namespace streamsafe {

const char* to_string(trace_action action) noexcept {
  switch (action) {
    case trace_action::alloc: return "alloc";
    case trace_action::free_requested: return "free_requested";
    case trace_action::free_completed: return "free_completed";
    case trace_action::segment_alloc: return "segment_alloc";
    case trace_action::segment_free: return "segment_free";
    case trace_action::segment_map: return "segment_map";
    case trace_action::segment_unmap: return "segment_unmap";
    case trace_action::release_deferred: return "release_deferred";
    case trace_action::oom: return "oom";
  }
  return "?";
}

std::optional<trace_action> parse_trace_action(std::string_view name) noexcept {
  for (auto a : {trace_action::alloc, trace_action::free_requested, trace_action::free_completed,
                 trace_action::segment_alloc, trace_action::segment_free, trace_action::segment_map,
                 trace_action::segment_unmap, trace_action::release_deferred, trace_action::oom}) {
    if (name == to_string(a)) return a;
  }
  return std::nullopt;
}

trace_recorder::trace_recorder(std::size_t capacity) : capacity_(capacity), ring_(capacity) {}

void trace_recorder::record(const trace_event& event) noexcept {
  std::lock_guard<std::mutex> lk(mu_);
  ++recorded_;
  if (capacity_ == 0) return;
  ring_[next_] = event;
  next_ = next_ + 1 == capacity_ ? 0 : next_ + 1;
  if (count_ < capacity_) ++count_;
}

void trace_recorder::record(trace_action action, std::uintptr_t address, std::size_t size,
                            stream_handle stream, int device) noexcept {
  record(trace_event{now_us(), action, address, size, stream, device});
}

std::vector<trace_event> trace_recorder::events() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<trace_event> out;
  out.reserve(count_);
  const std::size_t first = (next_ + capacity_ - count_) % (capacity_ == 0 ? 1 : capacity_);
  for (std::size_t i = 0; i < count_; ++i) out.push_back(ring_[(first + i) % capacity_]);
  return out;
}

std::size_t trace_recorder::size() const {
  std::lock_guard<std::mutex> lk(mu_);
  return count_;
}

std::uint64_t trace_recorder::recorded() const {
  std::lock_guard<std::mutex> lk(mu_);
  return recorded_;
}

std::uint64_t trace_recorder::dropped() const {
  std::lock_guard<std::mutex> lk(mu_);
  return recorded_ - count_;
}

void trace_recorder::clear() {
  std::lock_guard<std::mutex> lk(mu_);
  next_ = count_ = 0;
  recorded_ = 0;
}

void trace_recorder::to_json(std::ostream& os) const {
  std::vector<trace_event> copy = events();
  write_trace_json(os, copy, capacity_, dropped());
}

void trace_recorder::to_csv(std::ostream& os) const { write_trace_csv(os, events()); }

std::uint64_t trace_recorder::now_us() noexcept {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
}

void write_trace_json(std::ostream& os, const std::vector<trace_event>& events,
                      std::size_t capacity, std::uint64_t dropped) {
  os << "{\"capacity\":" << capacity << ",\"recorded\":" << events.size() + dropped
     << ",\"dropped\":" << dropped << ",\"events\":[";
  bool first = true;
  for (const trace_event& e : events) {
    os << (first ? "\n" : ",\n") << "{\"time_us\":" << e.time_us << ",\"action\":\""
       << to_string(e.action) << "\",\"addr\":" << e.address << ",\"size\":" << e.size
       << ",\"stream\":" << e.stream << ",\"device\":" << e.device << '}';
    first = false;
  }
  os << "\n]}\n";
}

void write_trace_csv(std::ostream& os, const std::vector<trace_event>& events) {
  os << "time_us,action,address,size,stream\n";
  for (const trace_event& e : events) {
    os << e.time_us << ',' << to_string(e.action) << ',' << e.address << ',' << e.size << ','
       << e.stream << '\n';
  }
}

}  // namespace streamsafe
