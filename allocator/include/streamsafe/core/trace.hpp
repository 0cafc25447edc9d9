// streamsafe: the allocator's trace, a bounded ring buffer of what it decided.
//
// Each trace_event says what happened (alloc, free_requested, free_completed, segment_alloc,
// segment_free, segment_map, segment_unmap, release_deferred, oom), when, at which address,
// how many bytes, on which stream and device. The actions and the CSV columns are those of
// PyTorch's allocator trace (torch.cuda.memory._record_memory_history), so the same tools read
// both; release_deferred is streamsafe's own.
//
// Meaning of address and size per action:
//   alloc, free_requested, free_completed   block address; the size the caller asked for
//   segment_alloc, segment_free             segment base; segment bytes
//   segment_map, segment_unmap              first mapped byte; mapped bytes (expandable)
//   release_deferred                        first byte of the batch; bytes queued behind a fence
//   oom                                     0; the request's bytes
//
// Invariants: the recorder holds at most capacity() events, the newest ones; when full, each
// record() overwrites the oldest event and counts it in dropped(). recorded() == size() +
// dropped() (until clear()). A recorder of capacity 0 records nothing and counts every event
// as dropped.
// Thread safety: every member may be called from any thread; one mutex guards the ring.
// record() allocates nothing (the ring is allocated once, at construction) and never throws.
#pragma once

#include <streamsafe/backends/device_backend.hpp>

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <mutex>
#include <optional>
#include <string_view>
#include <vector>

namespace streamsafe {

enum class trace_action : std::uint8_t {
  alloc,
  free_requested,
  free_completed,
  segment_alloc,
  segment_free,
  segment_map,
  segment_unmap,
  release_deferred,
  oom,
};

// The action's name as written in traces ("alloc", "segment_map", ...).
const char* to_string(trace_action action) noexcept;
// The action named `name` (exact, lower case), or nullopt.
std::optional<trace_action> parse_trace_action(std::string_view name) noexcept;

struct trace_event {
  std::uint64_t time_us = 0;  // microseconds since the Unix epoch (system clock)
  trace_action action = trace_action::alloc;
  std::uintptr_t address = 0;
  std::size_t size = 0;  // bytes; see the table above
  stream_handle stream = 0;
  int device = 0;
};

class trace_recorder {
 public:
  // capacity: the most events kept (the newest ones). Allocates the ring now.
  explicit trace_recorder(std::size_t capacity);
  trace_recorder(const trace_recorder&) = delete;
  trace_recorder& operator=(const trace_recorder&) = delete;

  // Appends one event, overwriting the oldest when full. No allocation, never throws.
  void record(const trace_event& event) noexcept;
  // Same, stamped with now_us().
  void record(trace_action action, std::uintptr_t address, std::size_t size, stream_handle stream,
              int device) noexcept;

  // The events held, oldest first.
  std::vector<trace_event> events() const;
  std::size_t size() const;
  std::size_t capacity() const noexcept { return capacity_; }
  std::uint64_t recorded() const;  // events ever passed to record() since construction / clear()
  std::uint64_t dropped() const;   // of those, the ones overwritten (or refused at capacity 0)
  void clear();

  // JSON: {"capacity":N,"recorded":N,"dropped":N,"events":[{"time_us":..,"action":"alloc",
  // "addr":..,"size":..,"stream":..,"device":..},...]} ("addr" as in PyTorch's trace entries).
  void to_json(std::ostream& os) const;
  // CSV of shared/traces/README.md: header "time_us,action,address,size,stream", decimal
  // numbers, oldest first. The device is not a column (one trace per device).
  void to_csv(std::ostream& os) const;

  // Microseconds since the Unix epoch (std::chrono::system_clock).
  static std::uint64_t now_us() noexcept;

 private:
  const std::size_t capacity_;
  mutable std::mutex mu_;
  std::vector<trace_event> ring_;  // guarded by mu_; size capacity_, allocated once
  std::size_t next_ = 0;           // guarded by mu_; slot the next record() writes
  std::size_t count_ = 0;          // guarded by mu_; events held, <= capacity_
  std::uint64_t recorded_ = 0;     // guarded by mu_
};

// The same two formats for any sequence of events (a copy taken with events(), or events a tool
// assembled itself).
void write_trace_json(std::ostream& os, const std::vector<trace_event>& events,
                      std::size_t capacity = 0, std::uint64_t dropped = 0);
void write_trace_csv(std::ostream& os, const std::vector<trace_event>& events);

}  // namespace streamsafe
