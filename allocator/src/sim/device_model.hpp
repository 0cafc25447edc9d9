// streamsafe: the simulated device's state and its work engine (internal to src/sim/; see
// simulated_device.hpp for the model). simulated_device.cpp (streams, work, capture, clock),
// memory.cpp (segments, expandable ranges, contents) and events.cpp (events, faults, counters)
// implement simulated_device on it.
//
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
#pragma once

#include <streamsafe/sim/simulated_device.hpp>
#include "core/common/format.hpp"

#include <streamsafe/core/errors.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace streamsafe::sim {

namespace detail {

inline constexpr std::uintptr_t address_space_base = 0x7f0000000000ULL;
inline constexpr std::uintptr_t host_address_base = 0x100000000000ULL;  // 1 TiB per device
inline constexpr std::size_t call_kinds = static_cast<std::size_t>(call::synchronize_device) + 1;
inline constexpr std::size_t max_items_in_message = 4;

inline const char* call_name(call c) noexcept {
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

using streamsafe::detail::hex;

inline std::string describe_range(std::uintptr_t begin, std::size_t size_bytes) {
  return "[" + hex(begin) + ", " + hex(begin + size_bytes) + ") (" + std::to_string(size_bytes) +
         " bytes)";
}

inline std::string describe_range(const range& r) {
  return std::string(r.mode == access::write ? "write of " : "read of ") +
         describe_range(r.begin, r.size_bytes);
}

inline bool overlaps(std::uintptr_t a, std::size_t a_size, std::uintptr_t b, std::size_t b_size) {
  return a_size != 0 && b_size != 0 && a < b + b_size && b < a + a_size;
}

inline std::size_t round_up(std::size_t value, std::size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

using vector_clock = std::map<std::uint64_t, std::uint64_t>;  // stream uid -> seq

inline void merge_into(vector_clock& into, const vector_clock& from) {
  for (const auto& [uid, seq] : from) {
    auto& mine = into[uid];
    mine = std::max(mine, seq);
  }
}

inline std::uint64_t clock_of(const vector_clock& clock, std::uint64_t uid) {
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
  bool opened = false;           // holds
  std::uint64_t depends_on = 0;  // waits: id of the record marker (0: none)
  // copy_async: on completion [copy_dst, copy_dst + copy_bytes) takes the contents of copy_src.
  std::uintptr_t copy_src = 0, copy_dst = 0;
  std::size_t copy_bytes = 0;
};

struct stream_state {
  stream_handle handle = 0;
  bool destroyed = false;
  std::deque<std::uint64_t> queue;  // pending item ids, in enqueue order
  std::uint64_t next_seq = 1;
  vector_clock clock;
  std::uint64_t capture = 0;  // id of the graph being captured on this stream (0: none)
  // Order inside a capture: the nodes this stream has captured (capture_order[own uid]) and
  // those of other streams it follows through captured events; cleared when a capture ends.
  vector_clock capture_order;
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
  std::uint64_t marker = 0;   // id of the current record marker
  vector_clock captured;      // the recording stream's clock at record time
  std::uint64_t capture = 0;  // last recorded on a capturing stream: that graph's id (0: not)
};

inline const char* kind_name(item_kind kind) {
  switch (kind) {
    case item_kind::kernel: return "kernel";
    case item_kind::hold: return "hold";
    case item_kind::record: return "event record";
    case item_kind::wait: return "event wait";
  }
  return "item";
}

}  // namespace detail

// The state types above are used unqualified by the device's translation units.
using namespace detail;

struct simulated_device::impl {
  explicit impl(device_config config) : config_(std::move(config)) {
    if (config_.granularity_bytes == 0 || config_.granularity_bytes % 512 != 0) {
      throw std::invalid_argument(
          "simulated_device: granularity_bytes must be a positive "
          "multiple of 512, got " +
          std::to_string(config_.granularity_bytes));
    }
    // Like unified virtual addressing: each device's addresses live in their own 16 TiB window.
    next_address_ = round_up(
        address_space_base + (static_cast<std::uintptr_t>(config_.device) << 44),
        config_.granularity_bytes);
    host_next_address_ = host_address_base + (static_cast<std::uintptr_t>(config_.device) << 40);
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
  std::map<std::uint64_t, stream_state> streams_;   // uid -> state
  std::map<stream_handle, std::uint64_t> handles_;  // live handle -> uid
  std::set<stream_handle> destroyed_handles_;       // destroyed and not (yet) recycled
  std::uint64_t next_stream_uid_ = 1;
  stream_handle next_stream_handle_ = 16;  // skips 1 and 2 (cudaStreamLegacy / PerThread)
  bool reuse_handles_ = false;

  // Events.
  std::map<event_handle, event_state> events_;
  event_handle next_event_handle_ = 1;

  // IPC (ipc.cpp). An opened interprocess event is an alias of the exported event (one state,
  // as the driver's two handles name one event); the exported event outlives its destruction by
  // the exporter while aliases are open. Imports are views of the exported range at the same
  // address (producer and consumer share this device).
  std::map<event_handle, event_handle> ipc_aliases_;  // alias -> exported event
  std::map<event_handle, int> ipc_alias_count_;       // exported event -> aliases open
  std::set<event_handle> ipc_orphans_;                // destroyed by the exporter, aliases open
  std::multimap<std::uintptr_t, std::size_t> ipc_imports_;  // open views: address -> bytes
  std::set<event_handle> ipc_events_;                       // created by create_ipc_event

  // True when `event` was an IPC alias or an exported event with aliases (handled here).
  bool destroy_ipc_event(event_handle event) {
    if (auto a = ipc_aliases_.find(event); a != ipc_aliases_.end()) {
      const event_handle target = a->second;
      ipc_aliases_.erase(a);
      if (--ipc_alias_count_[target] == 0) {
        ipc_alias_count_.erase(target);
        if (ipc_orphans_.erase(target) != 0) {
          events_.erase(target);
          ipc_events_.erase(target);
        }
      }
      return true;
    }
    if (ipc_alias_count_.count(event) != 0) {
      ipc_orphans_.insert(event);
      ++counters_.events_destroyed;
      return true;
    }
    ipc_events_.erase(event);
    return false;
  }

  // Memory.
  std::uintptr_t next_address_ = 0;
  std::map<std::uintptr_t, std::size_t> segments_;      // base -> size
  std::map<std::uintptr_t, std::size_t> freed_ranges_;  // base -> bytes (reuse_freed_addresses)
  std::map<std::uintptr_t, std::size_t> reservations_;  // base -> size
  std::set<std::uintptr_t> mapped_chunks_;
  // Physical memory behind mapped chunks: map() gives each chunk a memory of its own, map_alias
  // maps a chunk's memory at a second address. bytes_in_use_ counts memories, not addresses.
  std::map<std::uintptr_t, std::uint64_t> chunk_memory_;                // mapped chunk -> memory
  std::map<std::uint64_t, std::vector<std::uintptr_t>> memory_chunks_;  // memory -> its chunks
  std::uint64_t next_memory_ = 1;
  std::size_t aliased_memories_ = 0;  // memories mapped at more than one address
  std::map<std::uintptr_t, std::vector<int>> chunk_access_;  // mapped chunk -> its access set
  // Entries of chunk_access_ whose set is not {this device} alone: while there are none, a map
  // granting {this device} alone cannot differ from any chunk (map() skips its scan).
  std::size_t other_access_chunks_ = 0;
  bool own_access_only(const std::vector<int>& set) const {
    return set.size() == 1 && set.front() == config_.device;
  }
  // chunk_access_[chunk] = set, keeping other_access_chunks_.
  void set_chunk_access(std::uintptr_t chunk, std::vector<int> set) {
    auto [it, added] = chunk_access_.try_emplace(chunk);
    if (!added && !own_access_only(it->second)) --other_access_chunks_;
    if (!own_access_only(set)) ++other_access_chunks_;
    it->second = std::move(set);
  }
  void erase_chunk_access(std::uintptr_t chunk) {
    auto it = chunk_access_.find(chunk);
    if (it == chunk_access_.end()) return;
    if (!own_access_only(it->second)) --other_access_chunks_;
    chunk_access_.erase(it);
  }
  std::map<int, int> omitted_peer_maps_;  // device -> map calls still to leave it out (K13)
  std::size_t bytes_in_use_ = 0;
  std::map<std::uintptr_t, std::pair<std::uintptr_t, std::uint8_t>> contents_;  // b -> (e, v)
  // Pinned host memory (allocate_host): in segments_ too (so that work may touch it), not in
  // bytes_in_use_; its addresses come from host_next_address_.
  std::set<std::uintptr_t> host_segments_;
  std::uintptr_t host_next_address_ = 0;
  std::size_t host_bytes_ = 0;

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
    if (auto a = ipc_aliases_.find(event); a != ipc_aliases_.end()) event = a->second;
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

  void record_fault(fault_kind kind, const std::string& message) {
    faults_.push_back(fault{kind, std::string(to_string(kind)) + ": " + message, now_});
  }

  // A capture_violation: the call fails (backend_error) and every capture of the device is
  // invalidated, as a potentially unsafe call in global capture mode does on a GPU.
  [[noreturn]] void capture_violation(const char* what, const std::string& why) {
    std::string captures;
    for (auto& [id, g] : graphs_) {
      if (!g.capturing) continue;
      captures += (captures.empty() ? "" : ", ") + std::string("stream ") +
                  std::to_string(g.stream) + " (graph " + std::to_string(id) + ")";
      if (!g.invalidated) {
        g.invalidated = true;
        g.invalidated_by = std::string(what) + ": " + why;
      }
    }
    record_fault(
        fault_kind::capture_violation,
        std::string(what) + ": " + why + (captures.empty() ? "" : "; capturing: " + captures));
    fail(what, why + " (not permitted during stream capture; the capture is invalidated)");
  }

  // Releasing, synchronising and query calls are potentially unsafe while any stream captures.
  void check_not_capturing(const char* what) {
    if (capturing_streams_ != 0)
      capture_violation(what, "called while a stream of the device captures a graph");
  }

  // Appends a new item to the stream's queue and advances its vector clock.
  work_item& enqueue(stream_state& stream, std::uint64_t stream_uid, work_item item) {
    item.id = next_item_id_++;
    item.stream_uid = stream_uid;
    item.stream = stream.handle;
    item.seq = stream.next_seq++;
    stream.clock[stream_uid] = item.seq;
    if (item.label.empty())
      item.label = std::string(kind_name(item.kind)) + "#" + std::to_string(item.id);
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
    record_fault(fault_kind::release_under_pending_work, message);
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

  // dst takes the contents model of [src, src + bytes) (unknown bytes stay unknown).
  void copy_contents(std::uintptr_t dst, std::uintptr_t src, std::size_t bytes) {
    std::vector<std::pair<std::pair<std::uintptr_t, std::uintptr_t>, std::uint8_t>> parts;
    const std::uintptr_t end = src + bytes;
    auto it = contents_.upper_bound(src);
    if (it != contents_.begin()) --it;
    for (; it != contents_.end() && it->first < end; ++it) {
      const std::uintptr_t b = std::max(it->first, src), e = std::min(it->second.first, end);
      if (b < e) parts.push_back({{b - src, e - src}, it->second.second});
    }
    assign_contents(dst, dst + bytes, std::nullopt);
    for (const auto& [span, value] : parts)
      assign_contents(dst + span.first, dst + span.second, value);
  }

  void complete(std::uint64_t id) {
    auto it = pending_.find(id);
    const work_item& item = it->second;
    if (item.kind == item_kind::kernel && item.copy_bytes != 0) {
      copy_contents(item.copy_dst, item.copy_src, item.copy_bytes);
    } else if (item.kind == item_kind::kernel) {
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

  // The checks of a host wait on `event` (events.cpp); returns the record marker to wait for.
  std::uint64_t sync_marker(event_handle event, const char* what);

  // The ranges that reach the same memory as r at other addresses (map_alias), coalesced.
  std::vector<range> aliases_of(const range& r) const {
    std::vector<range> out;
    if (aliased_memories_ == 0 || r.size_bytes == 0) return out;
    const std::size_t gran = config_.granularity_bytes;
    const std::uintptr_t end = r.begin + r.size_bytes;
    for (std::uintptr_t chunk = r.begin / gran * gran; chunk < end; chunk += gran) {
      auto mem = chunk_memory_.find(chunk);
      if (mem == chunk_memory_.end()) continue;
      const auto& chunks = memory_chunks_.at(mem->second);
      if (chunks.size() < 2) continue;
      const std::uintptr_t lo = std::max(chunk, r.begin);
      const std::uintptr_t hi = std::min(chunk + gran, end);
      for (std::uintptr_t other : chunks) {
        if (other == chunk) continue;
        const std::uintptr_t b = other + (lo - chunk);
        if (!out.empty() && out.back().begin + out.back().size_bytes == b) {
          out.back().size_bytes += hi - lo;
        } else {
          out.push_back(range{b, hi - lo, r.mode, std::nullopt});
        }
      }
    }
    return out;
  }

  // launch() on a stream that is not capturing (mutex held).
  std::uint64_t launch_locked(stream_handle stream, std::uint64_t duration_us,
                              std::vector<range> ranges, std::string label);
};

}  // namespace streamsafe::sim
