// streamsafe: the simulated device (see simulated_device.hpp for the model).
//
// Lock: impl::mutex_ guards every member of impl. Every public member function of
// simulated_device takes it exactly once, on entry; the private helpers of impl (named
// *_locked or documented as such) assume it is held and never take it. Nothing calls out of
// the device while holding it (no callbacks), so it cannot deadlock.
//
// Invariants (true whenever the mutex is free):
//  * pending_ holds exactly the work items that have not completed; every pending item's id
//    is in the queue of its stream (streams_[item.stream_uid].queue) in enqueue order, and
//    every id in a queue is pending. Item ids grow from 1; an id below next_item_id_ that is
//    not pending has completed.
//  * The queues are settled: no queue head could make progress at now_ without the clock
//    moving or open() being called. Concretely, every head item has started; a head that is a
//    record marker, an opened hold, a zero-length kernel or a wait whose dependency completed
//    does not exist (it would have completed). So the only thing that can unblock a stuck
//    device is a running kernel finishing (start_us + duration_us > now_) or open().
//  * Streams are identified internally by a uid that is never reused; handles_ maps each live
//    stream handle to its uid. A destroyed stream stays in streams_ (without a handle) until
//    its queue drains. Vector clocks are keyed by uid, so a recycled handle value gets a fresh
//    clock and is unordered with the old stream's pending work.
//  * Vector clocks: stream.clock[stream uid] is the seq of the stream's last enqueued item.
//    Item X (on stream S') happens before everything later enqueued on stream S iff
//    X.seq <= S.clock[S'] (absent entries are 0).
//  * segments_, reservations_ never overlap each other or themselves; addresses come from a
//    bump pointer (next_address_) and are never handed out twice, unless
//    config_.reuse_freed_addresses: then freed segment ranges (with their guard granule) wait in
//    freed_ranges_ and allocate_segment takes the lowest that fits first. mapped_chunks_ holds the
//    granularity-aligned base of each mapped chunk, each inside a reservation.
//    bytes_in_use_ == sum of segment sizes + granularity * mapped_chunks_.size() <= total.
//  * contents_ is a set of disjoint half-open intervals [begin, end) -> byte value.
//  * An injected failure (fail_next) changes nothing, counters included: counters count the
//    calls that succeeded.

#include <streamsafe/sim/simulated_device.hpp>

#include <streamsafe/core/errors.hpp>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <utility>

namespace streamsafe::sim {

const char* to_string(fault_kind kind) noexcept {
  switch (kind) {
    case fault_kind::release_under_pending_work: return "release_under_pending_work";
    case fault_kind::cross_stream_race: return "cross_stream_race";
    case fault_kind::access_unmapped: return "access_unmapped";
    case fault_kind::capture_violation: return "capture_violation";
  }
  return "unknown_fault";
}

namespace {

constexpr std::uintptr_t address_space_base = 0x7f0000000000ULL;
constexpr std::size_t call_kinds = static_cast<std::size_t>(call::synchronize_device) + 1;
constexpr std::size_t max_items_in_message = 4;

const char* call_name(call c) noexcept {
  switch (c) {
    case call::allocate_segment: return "allocate_segment";
    case call::free_segment: return "free_segment";
    case call::reserve_address_range: return "reserve_address_range";
    case call::release_address_range: return "release_address_range";
    case call::map: return "map";
    case call::unmap: return "unmap";
    case call::create_event: return "create_event";
    case call::record_event: return "record_event";
    case call::query_event: return "query_event";
    case call::synchronize_event: return "synchronize_event";
    case call::stream_wait_event: return "stream_wait_event";
    case call::synchronize_device: return "synchronize_device";
  }
  return "unknown_call";
}

std::string hex(std::uintptr_t value) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "0x%llx", static_cast<unsigned long long>(value));
  return buffer;
}

std::string describe_range(std::uintptr_t begin, std::size_t size_bytes) {
  return "[" + hex(begin) + ", " + hex(begin + size_bytes) + ") (" + std::to_string(size_bytes) +
         " bytes)";
}

std::string describe_range(const range& r) {
  return std::string(r.mode == access::write ? "write of " : "read of ") +
         describe_range(r.begin, r.size_bytes);
}

bool overlaps(std::uintptr_t a, std::size_t a_size, std::uintptr_t b, std::size_t b_size) {
  return a_size != 0 && b_size != 0 && a < b + b_size && b < a + a_size;
}

std::size_t round_up(std::size_t value, std::size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

using vector_clock = std::map<std::uint64_t, std::uint64_t>;  // stream uid -> seq

void merge_into(vector_clock& into, const vector_clock& from) {
  for (const auto& [uid, seq] : from) {
    auto& mine = into[uid];
    mine = std::max(mine, seq);
  }
}

std::uint64_t clock_of(const vector_clock& clock, std::uint64_t uid) {
  auto it = clock.find(uid);
  return it == clock.end() ? 0 : it->second;
}

enum class item_kind { kernel, hold, record, wait };

struct work_item {
  std::uint64_t id = 0;
  item_kind kind = item_kind::kernel;
  std::uint64_t stream_uid = 0;
  stream_handle stream = 0;  // the handle at enqueue time, for messages
  std::uint64_t seq = 0;
  std::uint64_t duration_us = 0;
  std::vector<range> ranges;
  std::string label;
  bool started = false;
  std::uint64_t start_us = 0;
  bool opened = false;            // holds
  std::uint64_t depends_on = 0;   // waits: id of the record marker (0: none)
};

struct stream_state {
  stream_handle handle = 0;
  bool destroyed = false;
  std::deque<std::uint64_t> queue;  // pending item ids, in enqueue order
  std::uint64_t next_seq = 1;
  vector_clock clock;
  std::uint64_t capture = 0;  // id of the graph being captured on this stream (0: none)
};

// A captured kernel: replayed by launch_graph.
struct graph_node {
  std::uint64_t duration_us = 0;
  std::vector<range> ranges;
  std::string label;
};

struct graph_state {
  stream_handle stream = 0;  // the capturing stream
  bool capturing = true;
  bool invalidated = false;
  std::string invalidated_by;
  std::vector<graph_node> nodes;
};

struct event_state {
  bool recorded = false;
  std::uint64_t marker = 0;  // id of the current record marker
  vector_clock captured;     // the recording stream's clock at record time
  std::uint64_t capture = 0; // last recorded on a capturing stream: that graph's id (0: not)
};

const char* kind_name(item_kind kind) {
  switch (kind) {
    case item_kind::kernel: return "kernel";
    case item_kind::hold: return "hold";
    case item_kind::record: return "event record";
    case item_kind::wait: return "event wait";
  }
  return "item";
}

}  // namespace

struct simulated_device::impl {
  explicit impl(device_config config) : config_(config) {
    if (config_.granularity_bytes == 0 || config_.granularity_bytes % 512 != 0) {
      throw std::invalid_argument("simulated_device: granularity_bytes must be a positive "
                                  "multiple of 512, got " +
                                  std::to_string(config_.granularity_bytes));
    }
    // Like unified virtual addressing: each device's addresses live in their own 16 TiB window.
    next_address_ = round_up(address_space_base + (static_cast<std::uintptr_t>(config_.device) << 44),
                             config_.granularity_bytes);
    stream_state default_stream;
    default_stream.handle = 0;
    streams_.emplace(0, std::move(default_stream));
    handles_.emplace(0, 0);
  }

  mutable std::mutex mutex_;
  device_config config_;

  // Clock and work.
  std::uint64_t now_ = 0;
  std::uint64_t next_item_id_ = 1;
  std::map<std::uint64_t, work_item> pending_;
  std::map<std::uint64_t, stream_state> streams_;  // uid -> state
  std::map<stream_handle, std::uint64_t> handles_;  // live handle -> uid
  std::set<stream_handle> destroyed_handles_;       // destroyed and not (yet) recycled
  std::uint64_t next_stream_uid_ = 1;
  stream_handle next_stream_handle_ = 16;  // skips 1 and 2 (cudaStreamLegacy / PerThread)
  bool reuse_handles_ = false;

  // Events.
  std::map<event_handle, event_state> events_;
  event_handle next_event_handle_ = 1;

  // Memory.
  std::uintptr_t next_address_ = 0;
  std::map<std::uintptr_t, std::size_t> segments_;      // base -> size
  std::map<std::uintptr_t, std::size_t> freed_ranges_;  // base -> bytes (reuse_freed_addresses)
  std::map<std::uintptr_t, std::size_t> reservations_;  // base -> size
  std::set<std::uintptr_t> mapped_chunks_;
  std::size_t bytes_in_use_ = 0;
  std::map<std::uintptr_t, std::pair<std::uintptr_t, std::uint8_t>> contents_;  // b -> (e, v)

  // Graph capture (the mutex guards these too).
  std::map<std::uint64_t, graph_state> graphs_;
  std::uint64_t next_graph_id_ = 1;
  std::size_t capturing_streams_ = 0;

  // Faults, counters, injection.
  std::vector<fault> faults_;
  sim::counters counters_;
  int injected_[call_kinds] = {};

  // ---- helpers (mutex held) ---------------------------------------------------------------

  std::string prefix(const char* what) const {
    return "simulated_device(device " + std::to_string(config_.device) + "): " + what + ": ";
  }

  [[noreturn]] void fail(const char* what, const std::string& message) const {
    throw backend_error(prefix(what) + message);
  }

  // True (and consumes one) when the next call of kind c must fail.
  bool injected(call c) {
    int& left = injected_[static_cast<std::size_t>(c)];
    if (left <= 0) return false;
    --left;
    return true;
  }

  [[noreturn]] void fail_injected(call c) const {
    fail(call_name(c), "injected failure (fail_next)");
  }

  void throw_if_injected(call c) {
    if (injected(c)) fail_injected(c);
  }

  stream_state& live_stream(stream_handle handle, const char* what) {
    return const_cast<stream_state&>(std::as_const(*this).live_stream(handle, what));
  }

  const stream_state& live_stream(stream_handle handle, const char* what) const {
    auto it = handles_.find(handle);
    if (it == handles_.end()) {
      if (destroyed_handles_.count(handle) != 0) {
        fail(what, "stream " + std::to_string(handle) + " was destroyed");
      }
      fail(what, "unknown stream " + std::to_string(handle));
    }
    return streams_.at(it->second);
  }

  event_state& live_event(event_handle event, const char* what) {
    auto it = events_.find(event);
    if (it == events_.end()) fail(what, "unknown or destroyed event " + std::to_string(event));
    return it->second;
  }

  std::string describe_item(const work_item& item) const {
    std::string text = std::string(kind_name(item.kind)) + " '" + item.label + "' (#" +
                       std::to_string(item.id) + ") on stream " + std::to_string(item.stream);
    if (streams_.at(item.stream_uid).destroyed) text += " (destroyed)";
    return text;
  }

  void record_fault(fault_kind kind, std::string message) {
    faults_.push_back(fault{kind, std::string(to_string(kind)) + ": " + message, now_});
  }

  // A capture_violation: the call fails (backend_error) and every capture of the device is
  // invalidated, as a potentially unsafe call in global capture mode does on a GPU.
  [[noreturn]] void capture_violation(const char* what, const std::string& why) {
    std::string captures;
    for (auto& [id, g] : graphs_) {
      if (!g.capturing) continue;
      captures += (captures.empty() ? "" : ", ") + std::string("stream ") + std::to_string(g.stream) +
                  " (graph " + std::to_string(id) + ")";
      if (!g.invalidated) {
        g.invalidated = true;
        g.invalidated_by = std::string(what) + ": " + why;
      }
    }
    record_fault(fault_kind::capture_violation,
                 std::string(what) + ": " + why + (captures.empty() ? "" : "; capturing: " + captures));
    fail(what, why + " (not permitted during stream capture; the capture is invalidated)");
  }

  // Releasing, synchronising and query calls are potentially unsafe while any stream captures.
  void check_not_capturing(const char* what) {
    if (capturing_streams_ != 0) capture_violation(what, "called while a stream of the device captures a graph");
  }

  // Appends a new item to the stream's queue and advances its vector clock.
  work_item& enqueue(stream_state& stream, std::uint64_t stream_uid, work_item item) {
    item.id = next_item_id_++;
    item.stream_uid = stream_uid;
    item.stream = stream.handle;
    item.seq = stream.next_seq++;
    stream.clock[stream_uid] = item.seq;
    if (item.label.empty()) item.label = std::string(kind_name(item.kind)) + "#" +
                                         std::to_string(item.id);
    stream.queue.push_back(item.id);
    return pending_.emplace(item.id, std::move(item)).first->second;
  }

  // First byte of [begin, begin+size) not backed by a live segment or a mapped chunk.
  std::optional<std::uintptr_t> first_unbacked(std::uintptr_t begin, std::size_t size) const {
    const std::uintptr_t end = begin + size;
    std::uintptr_t pos = begin;
    while (pos < end) {
      auto seg = segments_.upper_bound(pos);
      if (seg != segments_.begin()) {
        --seg;
        if (pos < seg->first + seg->second) {
          pos = seg->first + seg->second;
          continue;
        }
      }
      const std::uintptr_t chunk = pos / config_.granularity_bytes * config_.granularity_bytes;
      if (mapped_chunks_.count(chunk) != 0) {
        pos = chunk + config_.granularity_bytes;
        continue;
      }
      return pos;
    }
    return std::nullopt;
  }

  // Records a release_under_pending_work fault if pending work touches the range.
  void check_release(const char* what, std::uintptr_t base, std::size_t size) {
    std::vector<std::string> offenders;
    std::size_t count = 0;
    for (const auto& [id, item] : pending_) {
      for (const range& r : item.ranges) {
        if (!overlaps(base, size, r.begin, r.size_bytes)) continue;
        ++count;
        if (offenders.size() < max_items_in_message) {
          offenders.push_back(describe_item(item) + (item.started ? " (running)" : " (queued)") +
                              " " + describe_range(r));
        }
        break;
      }
    }
    if (count == 0) return;
    std::string message = std::string(what) + " of " + describe_range(base, size) + " while " +
                          std::to_string(count) + " pending work item(s) touch it: ";
    for (std::size_t i = 0; i < offenders.size(); ++i) {
      message += (i == 0 ? "" : "; ") + offenders[i];
    }
    if (count > offenders.size()) message += "; ...";
    record_fault(fault_kind::release_under_pending_work, std::move(message));
  }

  // Writes value over [begin, end) of the contents model (nullopt: forgets what was there).
  void assign_contents(std::uintptr_t begin, std::uintptr_t end,
                       std::optional<std::uint8_t> value) {
    if (begin >= end) return;
    // Split an interval straddling begin.
    auto it = contents_.lower_bound(begin);
    if (it != contents_.begin()) {
      auto before = std::prev(it);
      if (before->second.first > begin) {
        const auto [old_end, old_value] = before->second;
        before->second.first = begin;
        if (old_end > end) contents_.emplace(end, std::make_pair(old_end, old_value));
      }
    }
    // Remove or trim the intervals starting inside [begin, end).
    it = contents_.lower_bound(begin);
    while (it != contents_.end() && it->first < end) {
      const auto [old_end, old_value] = it->second;
      it = contents_.erase(it);
      if (old_end > end) {
        contents_.emplace(end, std::make_pair(old_end, old_value));
        break;
      }
    }
    if (value) contents_.emplace(begin, std::make_pair(end, *value));
  }

  void complete(std::uint64_t id) {
    auto it = pending_.find(id);
    const work_item& item = it->second;
    if (item.kind == item_kind::kernel) {
      for (const range& r : item.ranges) {
        if (r.mode == access::write) assign_contents(r.begin, r.begin + r.size_bytes, r.value);
      }
    }
    pending_.erase(it);
  }

  // Completes everything that can complete at now_ without the clock moving (see invariants).
  void settle() {
    bool progress = true;
    while (progress) {
      progress = false;
      for (auto& [uid, stream] : streams_) {
        while (!stream.queue.empty()) {
          work_item& head = pending_.at(stream.queue.front());
          if (!head.started) {
            head.started = true;
            head.start_us = now_;
          }
          bool done = false;
          switch (head.kind) {
            case item_kind::kernel: done = head.duration_us == 0; break;
            case item_kind::hold: done = head.opened; break;
            case item_kind::record: done = true; break;
            case item_kind::wait:
              done = head.depends_on == 0 || pending_.count(head.depends_on) == 0;
              break;
          }
          if (!done) break;
          stream.queue.pop_front();
          complete(head.id);
          progress = true;
        }
      }
    }
    for (auto it = streams_.begin(); it != streams_.end();) {
      if (it->second.destroyed && it->second.queue.empty()) {
        it = streams_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // The earliest time a running kernel finishes (nullopt: nothing can finish on its own).
  std::optional<std::uint64_t> next_finish() const {
    std::optional<std::uint64_t> next;
    for (const auto& [uid, stream] : streams_) {
      if (stream.queue.empty()) continue;
      const work_item& head = pending_.at(stream.queue.front());
      if (head.kind != item_kind::kernel || !head.started) continue;
      const std::uint64_t finish = head.start_us + head.duration_us;
      if (!next || finish < *next) next = finish;
    }
    return next;
  }

  // Moves the clock to `at` (the next finish time) and completes what finishes then.
  void step_to(std::uint64_t at) {
    now_ = at;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> finishing;  // (item id, stream uid)
    for (const auto& [uid, stream] : streams_) {
      if (stream.queue.empty()) continue;
      const work_item& head = pending_.at(stream.queue.front());
      if (head.kind == item_kind::kernel && head.started &&
          head.start_us + head.duration_us == now_) {
        finishing.emplace_back(head.id, uid);
      }
    }
    std::sort(finishing.begin(), finishing.end());  // ties complete in enqueue order
    for (const auto& [id, uid] : finishing) {
      streams_.at(uid).queue.pop_front();
      complete(id);
    }
    settle();
  }

  void advance(std::uint64_t duration_us) {
    const std::uint64_t target = duration_us > std::numeric_limits<std::uint64_t>::max() - now_
                                     ? std::numeric_limits<std::uint64_t>::max()
                                     : now_ + duration_us;
    for (;;) {
      const auto next = next_finish();
      if (!next || *next > target) break;
      step_to(*next);
    }
    now_ = target;
  }

  // Advances until done() holds; false when it never can (an unopened hold blocks it).
  template <class Done>
  bool advance_until(Done done) {
    while (!done()) {
      const auto next = next_finish();
      if (!next) return false;
      step_to(*next);
    }
    return true;
  }

  std::string blocking_holds() const {
    std::string text;
    for (const auto& [uid, stream] : streams_) {
      if (stream.queue.empty()) continue;
      const work_item& head = pending_.at(stream.queue.front());
      if (head.kind != item_kind::hold) continue;
      text += (text.empty() ? "" : "; ") + describe_item(head);
    }
    return text.empty() ? "no hold at a queue head" : text;
  }

  std::string deadlock_message(const std::string& what) const {
    return what + " would never complete: the host would deadlock (blocked by unopened " +
           blocking_holds() + ")";
  }

  bool idle() const { return pending_.empty(); }

  // launch() on a stream that is not capturing (mutex held).
  std::uint64_t launch_locked(stream_handle stream, std::uint64_t duration_us, std::vector<range> ranges,
                              std::string label);
};

// ---- construction ---------------------------------------------------------------------

simulated_device::simulated_device(device_config config)
    : impl_(std::make_unique<impl>(config)) {}

simulated_device::~simulated_device() = default;

// ---- streams and work -----------------------------------------------------------------

stream_handle simulated_device::create_stream() {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  stream_handle handle = 0;
  if (d.reuse_handles_ && !d.destroyed_handles_.empty()) {
    handle = *d.destroyed_handles_.begin();
    d.destroyed_handles_.erase(d.destroyed_handles_.begin());
  } else {
    handle = d.next_stream_handle_++;
  }
  const std::uint64_t uid = d.next_stream_uid_++;
  stream_state state;
  state.handle = handle;
  d.streams_.emplace(uid, std::move(state));
  d.handles_[handle] = uid;
  return handle;
}

void simulated_device::destroy_stream(stream_handle stream) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  if (stream == 0) d.fail("destroy_stream", "stream 0 (the legacy default stream) cannot be "
                                            "destroyed");
  stream_state& state = d.live_stream(stream, "destroy_stream");
  if (state.capture != 0) d.fail("destroy_stream", "stream " + std::to_string(stream) + " is capturing a graph");
  state.destroyed = true;
  d.handles_.erase(stream);
  d.destroyed_handles_.insert(stream);
  d.settle();  // drops the stream's state now if its queue is empty
}

void simulated_device::set_reuse_stream_handles(bool reuse) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl_->reuse_handles_ = reuse;
}

std::uint64_t simulated_device::launch(stream_handle stream, std::uint64_t duration_us,
                                       std::vector<range> ranges, std::string label) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  stream_state& state = d.live_stream(stream, "launch");
  if (state.capture != 0) {
    d.graphs_.at(state.capture).nodes.push_back(graph_node{duration_us, std::move(ranges), std::move(label)});
    return 0;
  }
  return d.launch_locked(stream, duration_us, std::move(ranges), std::move(label));
}

std::uint64_t simulated_device::impl::launch_locked(stream_handle stream, std::uint64_t duration_us,
                                                    std::vector<range> ranges, std::string label) {
  impl& d = *this;
  stream_state& state = d.live_stream(stream, "launch");
  const std::uint64_t uid = d.handles_.at(stream);

  work_item item;
  item.kind = item_kind::kernel;
  item.duration_us = duration_us;
  item.ranges = std::move(ranges);
  item.label = std::move(label);
  work_item& added = d.enqueue(state, uid, std::move(item));
  ++d.counters_.launches;

  // cross_stream_race: pending work on another stream touching the same bytes, one of the two
  // a write, that this stream's clock does not order before the new kernel.
  for (const auto& [id, other] : d.pending_) {
    if (other.stream_uid == uid || other.seq <= clock_of(state.clock, other.stream_uid)) continue;
    for (const range& mine : added.ranges) {
      const range* hit = nullptr;
      for (const range& theirs : other.ranges) {
        if ((mine.mode == access::write || theirs.mode == access::write) &&
            overlaps(mine.begin, mine.size_bytes, theirs.begin, theirs.size_bytes)) {
          hit = &theirs;
          break;
        }
      }
      if (hit == nullptr) continue;
      d.record_fault(fault_kind::cross_stream_race,
                     d.describe_item(added) + " " + describe_range(mine) + " while " +
                         d.describe_item(other) + (other.started ? " (running) " : " (queued) ") +
                         describe_range(*hit) + " is pending and not ordered before it");
      break;
    }
  }

  // access_unmapped: bytes not backed by a live segment or a mapped chunk.
  for (const range& r : added.ranges) {
    if (r.size_bytes == 0) continue;
    if (const auto bad = d.first_unbacked(r.begin, r.size_bytes)) {
      d.record_fault(fault_kind::access_unmapped,
                     d.describe_item(added) + " " + describe_range(r) + ": " + hex(*bad) +
                         " is not backed by a live segment or a mapped chunk");
    }
  }

  const std::uint64_t id = added.id;
  d.settle();
  return id;
}

std::uint64_t simulated_device::hold(stream_handle stream, std::string label) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  stream_state& state = d.live_stream(stream, "hold");
  if (state.capture != 0) {
    throw std::logic_error("simulated_device: hold on stream " + std::to_string(stream) +
                           ", which is capturing a graph: a captured hold is not modelled");
  }
  work_item item;
  item.kind = item_kind::hold;
  item.label = std::move(label);
  const std::uint64_t id = d.enqueue(state, d.handles_.at(stream), std::move(item)).id;
  d.settle();
  return id;
}

void simulated_device::open(std::uint64_t hold_id) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  if (hold_id == 0 || hold_id >= d.next_item_id_) {
    throw std::invalid_argument("simulated_device: open: unknown work item " +
                                std::to_string(hold_id));
  }
  auto it = d.pending_.find(hold_id);
  if (it == d.pending_.end()) return;  // already completed: opening twice is harmless
  if (it->second.kind != item_kind::hold) {
    throw std::invalid_argument("simulated_device: open: work item " + std::to_string(hold_id) +
                                " is not a hold");
  }
  it->second.opened = true;
  d.settle();
}

bool simulated_device::completed(std::uint64_t work_id) const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  if (work_id == 0 || work_id >= impl_->next_item_id_) {
    throw std::invalid_argument("simulated_device: completed: unknown work item " +
                                std::to_string(work_id));
  }
  return impl_->pending_.count(work_id) == 0;
}

bool simulated_device::stream_idle(stream_handle stream) const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return std::as_const(*impl_).live_stream(stream, "stream_idle").queue.empty();
}

// ---- CUDA graph capture -----------------------------------------------------------------

void simulated_device::begin_capture(stream_handle stream) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  if (stream == 0) d.fail("begin_capture", "the legacy default stream (0) cannot capture");
  stream_state& state = d.live_stream(stream, "begin_capture");
  if (state.capture != 0) {
    d.fail("begin_capture", "stream " + std::to_string(stream) + " is already capturing graph " +
                                std::to_string(state.capture));
  }
  const std::uint64_t id = d.next_graph_id_++;
  graph_state g;
  g.stream = stream;
  d.graphs_.emplace(id, std::move(g));
  state.capture = id;
  ++d.capturing_streams_;
}

std::uint64_t simulated_device::end_capture(stream_handle stream) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  stream_state& state = d.live_stream(stream, "end_capture");
  if (state.capture == 0) d.fail("end_capture", "stream " + std::to_string(stream) + " is not capturing");
  const std::uint64_t id = state.capture;
  state.capture = 0;
  --d.capturing_streams_;
  graph_state& g = d.graphs_.at(id);
  g.capturing = false;
  if (g.invalidated) {
    const std::string why = g.invalidated_by;
    d.graphs_.erase(id);
    d.fail("end_capture", "the capture of graph " + std::to_string(id) + " on stream " + std::to_string(stream) +
                              " was invalidated by " + why + " (cudaErrorStreamCaptureInvalidated)");
  }
  return id;
}

bool simulated_device::capturing(stream_handle stream) const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return std::as_const(*impl_).live_stream(stream, "capturing").capture != 0;
}

std::uint64_t simulated_device::launch_graph(std::uint64_t graph, stream_handle stream) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  auto it = d.graphs_.find(graph);
  if (it == d.graphs_.end() || it->second.capturing) {
    throw std::invalid_argument("simulated_device: launch_graph: no captured graph " + std::to_string(graph));
  }
  if (d.live_stream(stream, "launch_graph").capture != 0) {
    d.fail("launch_graph", "stream " + std::to_string(stream) + " is capturing");
  }
  std::uint64_t last = 0;
  for (const graph_node& node : it->second.nodes) {
    last = d.launch_locked(stream, node.duration_us, node.ranges,
                           node.label + " (graph " + std::to_string(graph) + ")");
  }
  ++d.counters_.graph_launches;
  return last;
}

std::size_t simulated_device::graph_kernel_count(std::uint64_t graph) const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  auto it = impl_->graphs_.find(graph);
  if (it == impl_->graphs_.end()) {
    throw std::invalid_argument("simulated_device: graph_kernel_count: no graph " + std::to_string(graph));
  }
  return it->second.nodes.size();
}

bool simulated_device::stream_is_capturing(stream_handle stream) noexcept {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  ++d.counters_.capture_queries;
  auto it = d.handles_.find(stream);
  return it != d.handles_.end() && d.streams_.at(it->second).capture != 0;
}

// ---- clock ------------------------------------------------------------------------------

std::uint64_t simulated_device::now_us() const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return impl_->now_;
}

void simulated_device::advance(std::uint64_t duration_us) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl_->advance(duration_us);
}

void simulated_device::run_until_idle() {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  if (!d.advance_until([&d] { return d.idle(); })) {
    throw std::logic_error("simulated_device: run_until_idle: " +
                           d.deadlock_message("the device"));
  }
}

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

// ---- faults, counters, injection --------------------------------------------------------

std::vector<fault> simulated_device::faults() const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return impl_->faults_;
}

std::size_t simulated_device::fault_count() const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return impl_->faults_.size();
}

void simulated_device::clear_faults() {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl_->faults_.clear();
}

sim::counters simulated_device::counters() const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return impl_->counters_;
}

void simulated_device::fail_next(call c, int count) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl_->injected_[static_cast<std::size_t>(c)] = std::max(count, 0);
}

// ---- device_backend: segments -----------------------------------------------------------

int simulated_device::device() const noexcept { return impl_->config_.device; }

const char* simulated_device::name() const noexcept { return "simulated"; }

void* simulated_device::allocate_segment(std::size_t size_bytes) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  if (d.injected(call::allocate_segment)) return nullptr;
  if (size_bytes == 0 || size_bytes % 512 != 0) {
    d.fail("allocate_segment", "size " + std::to_string(size_bytes) +
                                   " is not a positive multiple of 512");
  }
  if (size_bytes > d.config_.total_bytes - d.bytes_in_use_) return nullptr;
  // One unused granule after each segment, so an overrun is an access_unmapped fault.
  const std::size_t span = round_up(size_bytes, d.config_.granularity_bytes) + d.config_.granularity_bytes;
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
    d.fail("free_segment", d.deadlock_message("the device-wide wait of free_segment (as cudaFree)"));
  }
  d.check_release("free_segment", addr, size_bytes);
  d.segments_.erase(it);
  d.bytes_in_use_ -= size_bytes;
  d.assign_contents(addr, addr + size_bytes, std::nullopt);
  if (d.config_.reuse_freed_addresses) {
    d.freed_ranges_.emplace(addr, round_up(size_bytes, d.config_.granularity_bytes) + d.config_.granularity_bytes);
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
    d.fail("release_address_range",
           "no reservation " + describe_range(addr, size_bytes));
  }
  auto chunk = d.mapped_chunks_.lower_bound(addr);
  if (chunk != d.mapped_chunks_.end() && *chunk < addr + size_bytes) {
    d.fail("release_address_range", "chunk " + hex(*chunk) + " of " +
                                        describe_range(addr, size_bytes) + " is still mapped");
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
    if (d.mapped_chunks_.count(chunk) != 0) d.fail("map", "chunk " + hex(chunk) +
                                                              " is already mapped");
  }
  if (size_bytes > d.config_.total_bytes - d.bytes_in_use_) return false;
  for (std::uintptr_t chunk = addr; chunk < addr + size_bytes; chunk += gran) {
    d.mapped_chunks_.insert(chunk);
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
    if (d.mapped_chunks_.count(chunk) == 0) d.fail("unmap", "chunk " + hex(chunk) +
                                                                " is not mapped");
  }
  d.check_release("unmap", addr, size_bytes);
  for (std::uintptr_t chunk = addr; chunk < addr + size_bytes; chunk += gran) {
    d.mapped_chunks_.erase(chunk);
  }
  d.bytes_in_use_ -= size_bytes;
  d.assign_contents(addr, addr + size_bytes, std::nullopt);
  ++d.counters_.unmaps;
  d.counters_.bytes_unmapped += size_bytes;
}

// ---- device_backend: events and streams -------------------------------------------------

event_handle simulated_device::create_event() {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  d.throw_if_injected(call::create_event);
  const event_handle event = d.next_event_handle_++;
  d.events_.emplace(event, event_state{});
  ++d.counters_.events_created;
  return event;
}

void simulated_device::destroy_event(event_handle event) noexcept {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  // Pending waits keep the marker id, so destroying a recorded event is safe (as in CUDA).
  if (impl_->events_.erase(event) != 0) ++impl_->counters_.events_destroyed;
}

void simulated_device::record_event(event_handle event, stream_handle stream) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  d.throw_if_injected(call::record_event);
  event_state& ev = d.live_event(event, "record_event");
  stream_state& state = d.live_stream(stream, "record_event");
  if (state.capture != 0) {  // a captured event: a node of the graph, nothing runs now
    ev.recorded = false;
    ev.marker = 0;
    ev.captured.clear();
    ev.capture = state.capture;
    ++d.counters_.events_recorded;
    return;
  }
  ev.capture = 0;
  work_item item;
  item.kind = item_kind::record;
  item.label = "event " + std::to_string(event);
  const std::uint64_t marker = d.enqueue(state, d.handles_.at(stream), std::move(item)).id;
  ev.recorded = true;
  ev.marker = marker;
  ev.captured = state.clock;  // includes the marker's own seq
  ++d.counters_.events_recorded;
  d.settle();
}

bool simulated_device::query_event(event_handle event) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  d.throw_if_injected(call::query_event);
  const event_state& ev = d.live_event(event, "query_event");
  d.check_not_capturing("query_event");
  if (ev.capture != 0) {
    d.capture_violation("query_event", "event " + std::to_string(event) + " was last recorded in a capture "
                                       "(cudaErrorCapturedEvent)");
  }
  ++d.counters_.event_queries;
  return !ev.recorded || d.pending_.count(ev.marker) == 0;
}

void simulated_device::synchronize_event(event_handle event) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  d.throw_if_injected(call::synchronize_event);
  const event_state& ev = d.live_event(event, "synchronize_event");
  d.check_not_capturing("synchronize_event");
  if (ev.capture != 0) {
    d.capture_violation("synchronize_event", "event " + std::to_string(event) + " was last recorded in a "
                                             "capture (cudaErrorCapturedEvent)");
  }
  const std::uint64_t marker = ev.recorded ? ev.marker : 0;
  if (!d.advance_until([&d, marker] { return d.pending_.count(marker) == 0; })) {
    d.fail("synchronize_event", d.deadlock_message("event " + std::to_string(event)));
  }
  ++d.counters_.event_syncs;
}

void simulated_device::stream_wait_event(stream_handle stream, event_handle event) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  d.throw_if_injected(call::stream_wait_event);
  const event_state& ev = d.live_event(event, "stream_wait_event");
  stream_state& state = d.live_stream(stream, "stream_wait_event");
  if (ev.capture != 0 && ev.capture != state.capture) {
    d.capture_violation("stream_wait_event",
                        "stream " + std::to_string(stream) + " waits on event " + std::to_string(event) +
                            ", captured in graph " + std::to_string(ev.capture) +
                            (state.capture ? ", from another capture" : ", from outside the capture"));
  }
  if (ev.capture == 0 && state.capture != 0 && ev.recorded) {
    d.capture_violation("stream_wait_event", "capturing stream " + std::to_string(stream) + " waits on event " +
                                                 std::to_string(event) +
                                                 ", recorded outside the capture (needs cudaEventWaitExternal)");
  }
  ++d.counters_.stream_waits;
  if (ev.capture != 0) return;  // inside its own capture: ordering within the graph
  if (!ev.recorded) return;  // waiting on a never-recorded event is a no-op, as in CUDA
  const std::uint64_t uid = d.handles_.at(stream);
  work_item item;
  item.kind = item_kind::wait;
  item.label = "wait on event " + std::to_string(event);
  item.depends_on = ev.marker;
  d.enqueue(state, uid, std::move(item));
  merge_into(state.clock, ev.captured);  // ordering is decided at enqueue time
  d.settle();
}

bool simulated_device::query_stream(stream_handle stream) { return stream_idle(stream); }

void simulated_device::synchronize_device() {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  d.throw_if_injected(call::synchronize_device);
  d.check_not_capturing("synchronize_device");
  if (!d.advance_until([&d] { return d.idle(); })) {
    d.fail("synchronize_device", d.deadlock_message("the device"));
  }
  ++d.counters_.device_syncs;
}

void simulated_device::memory_info(std::size_t& free_bytes, std::size_t& total_bytes) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  total_bytes = impl_->config_.total_bytes;
  free_bytes = total_bytes - impl_->bytes_in_use_;
}

}  // namespace streamsafe::sim
