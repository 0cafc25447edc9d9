// streamsafe: a snapshot of one device's allocator (every segment and block) and a readable
// summary of its statistics.
//
// memory_snapshot is plain data: the allocator fills it under its lock (or a tool assembles it
// from what it saw), and it can be copied, inspected, checked and written as JSON afterwards.
// Block states:
//   active        handed out, not yet freed by the host
//   pending_free  freed by the host; waits for events of the streams in waiting_on
//   inactive      free, cached in its pool (mapped memory)
//   unmapped      free address space of an expandable segment, not backed by memory
//   releasing     detached from its pool, behind a release fence, going back to the driver
// Invariants (check_consistency()): the blocks of a segment tile it exactly in address order;
// mapped_bytes == the sum of its blocks that are not unmapped; an unmapped block is only in an
// expandable segment; waiting_on is empty unless the block is pending_free.
//
// JSON (to_json): the key names of torch.cuda.memory_snapshot() where PyTorch has the same
// notion ("address", "total_size", "allocated_size", "active_size", "requested_size",
// "segment_type": "small"|"large", "is_expandable", block "state": "active_allocated" |
// "active_pending_free" | "inactive"), plus streamsafe's own ("mapped_size", "graph_pool": the id
// of the graph whose private pool holds the segment or 0, block states
// "unmapped" and "releasing", "waiting_on"); "stats" holds the statistics under PyTorch's flat
// key names ("allocated_bytes.all.current", ...).
// Thread safety: plain values; no internal synchronisation.
#pragma once

#include <streamsafe/backends/device_backend.hpp>
#include <streamsafe/core/statistics.hpp>

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace streamsafe {

enum class snapshot_block_state : std::uint8_t {
  active,
  pending_free,
  inactive,
  unmapped,
  releasing
};
enum class snapshot_pool : std::uint8_t { small, large };

// "active", "pending_free", "inactive", "unmapped", "releasing".
const char* to_string(snapshot_block_state state) noexcept;
// "small", "large".
const char* to_string(snapshot_pool pool) noexcept;

struct block_snapshot {
  std::uintptr_t address = 0;
  std::size_t size_bytes = 0;
  std::size_t requested_bytes = 0;  // what the caller asked for (active / pending_free), else 0
  snapshot_block_state state = snapshot_block_state::inactive;
  stream_handle stream = 0;               // the allocation stream (the segment's pool stream)
  std::vector<stream_handle> waiting_on;  // pending_free: streams whose events are pending
};

struct segment_snapshot {
  std::uintptr_t address = 0;
  std::size_t size_bytes = 0;    // address span (reserved range of an expandable segment)
  std::size_t mapped_bytes = 0;  // bytes backed by memory: what counts in reserved bytes
  stream_handle stream = 0;      // the pool's stream
  snapshot_pool pool = snapshot_pool::large;
  bool expandable = false;
  std::string tag;               // the tag of its memory ("" untagged; core/sleep.hpp)
  std::uint64_t graph_pool = 0;  // a CUDA graph's private pool: its first graph's id; else 0
  std::size_t paused_bytes = 0;  // given back by pause: mapped again at resume
  // Of the mapped blocks: queued memory that another pool mapped again at its own address and
  // counts there (not in mapped_bytes): each byte counts once in the segments' mapped_bytes.
  std::size_t aliased_bytes = 0;
  std::vector<block_snapshot> blocks;  // in address order, tiling [address, address+size_bytes)

  std::size_t bytes_in(snapshot_block_state state) const noexcept;
};

struct memory_snapshot {
  int device = 0;
  std::uint64_t time_us = 0;  // when it was taken (microseconds since the epoch), 0 if unknown
  statistics stats;
  std::vector<segment_snapshot> segments;  // in address order

  // Throws std::logic_error naming the first broken invariant (see the top of this file).
  void check_consistency() const;
  void to_json(std::ostream& os) const;
};

// The statistics as one JSON object with PyTorch's flat key names
// ("allocated_bytes.all.current": 0, ..., "num_alloc_retries": 0, ...).
void write_statistics_json(std::ostream& os, const statistics& stats);

// A readable text table in the spirit of torch.cuda.memory_summary(): rows for allocated,
// active, requested, reserved and inactive split memory and the block / segment counts, with
// columns current, peak, total allocated and total freed; then the counters (retries, OOMs,
// device allocs / frees, device-wide syncs, events recorded, stream waits, fence waits and
// their time, releases deferred, bytes released, segments moved). device < 0 omits the device.
std::string memory_summary(const statistics& stats, int device = -1);

}  // namespace streamsafe
