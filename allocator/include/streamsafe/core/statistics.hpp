// streamsafe: allocator statistics, named as PyTorch users know them.
//
// Units: *_bytes are bytes; counts are plain numbers; *_ns are nanoseconds of host time.
//   allocated  bytes in blocks handed out and not yet freed by the host
//   active     allocated plus blocks freed by the host whose cross-stream uses are pending
//   reserved   bytes held from the driver (segments; mapped chunks of expandable segments)
//   inactive_split  free bytes in segments that also hold active blocks (fragmentation)
//   requested  bytes asked for (before rounding)
// Each counter is kept for every pool ("all", the statistics object itself) and for each pool
// kind, PyTorch's split: small_pool (blocks of requests up to 1 MiB, in segments of small pools)
// and large_pool (the rest); a block or segment counts in the kind of the pool that holds it,
// tagged and graph (capture) pools included, so small_pool + large_pool == all for current,
// allocated and freed. Peaks are device-wide high-water marks of the sum over every stream (sampled
// after each allocation, streams.cpp), never below the current value; inactive_split_bytes' peak is
// the largest value any stats() or snapshot() call has seen.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

namespace streamsafe {

struct stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;  // total ever added
  std::int64_t freed = 0;      // total ever removed

  void increase(std::int64_t amount) noexcept {
    current += amount;
    allocated += amount;
    if (current > peak) peak = current;
  }
  void decrease(std::int64_t amount) noexcept {
    current -= amount;
    freed += amount;
  }
  void reset_peak() noexcept { peak = current; }
};

// The counters of one pool kind, or of all pools (statistics derives from it).
struct pool_statistics {
  stat allocated_bytes, reserved_bytes, active_bytes, inactive_split_bytes, requested_bytes;
  stat allocation, segment, active;  // counts of blocks / segments
};

struct statistics : pool_statistics {      // the inherited counters: every pool ("all")
  pool_statistics small_pool;              // PyTorch's "small_pool": requests up to 1 MiB
  pool_statistics large_pool;              // PyTorch's "large_pool": larger requests
  std::uint64_t num_alloc_retries = 0;     // allocations that released cache and retried
  std::uint64_t num_ooms = 0;              // out_of_memory thrown
  std::uint64_t num_device_alloc = 0;      // segment allocations / chunk maps from the driver
  std::uint64_t num_device_free = 0;       // segment frees / chunk unmaps to the driver
  std::uint64_t num_sync_all_streams = 0;  // device-wide synchronisations
  std::uint64_t events_recorded = 0;       // every event record (uses at free, fences, moves)
  std::uint64_t stream_waits = 0;          // cudaStreamWaitEvent issued to reuse a block
  std::uint64_t fence_waits = 0;           // host waits on a release fence event
  std::uint64_t fence_wait_ns = 0;         // host time spent in those waits
  std::uint64_t releases_deferred =
      0;                             // release batches queued (a fence pending, or for the worker)
  std::uint64_t bytes_released = 0;  // bytes given back to the driver
  std::uint64_t segments_moved = 0;  // free segments moved to another stream's pool
  // Bytes a request took back from the release queue instead of mapping or
  // allocating as much again while they waited for their fence (reclaim.cpp): in place, or from
  // another stream's pool behind a wait on their release fence.
  std::uint64_t release_reclaimed_bytes = 0;
  // Release worker (options::release_worker): bytes queued behind fences (pending_release_bytes()
  // less what is in flight), bytes the worker is giving back to the driver right now, and the
  // release batches it has finished (each one or more unmap / free_segment calls).
  std::uint64_t release_queued_bytes = 0;
  std::uint64_t release_worker_bytes = 0;
  std::uint64_t release_worker_releases = 0;

  std::string to_string() const;  // "key: value" lines, PyTorch's key names
};

// Calls f(key, value) for every counter of s under PyTorch's key, in PyTorch's order:
// "<counter>.<all|small_pool|large_pool>.<current|peak|allocated|freed>".
template <class F>
void for_each_counter(const statistics& s, F&& f) {
  const pool_statistics* kinds[] = {&s, &s.small_pool, &s.large_pool};
  const char* kind_names[] = {"all", "small_pool", "large_pool"};
  using member = stat pool_statistics::*;
  const std::pair<const char*, member> counters[] = {
      {"allocated_bytes", &pool_statistics::allocated_bytes},
      {"reserved_bytes", &pool_statistics::reserved_bytes},
      {"active_bytes", &pool_statistics::active_bytes},
      {"inactive_split_bytes", &pool_statistics::inactive_split_bytes},
      {"requested_bytes", &pool_statistics::requested_bytes},
      {"allocation", &pool_statistics::allocation},
      {"segment", &pool_statistics::segment},
      {"active", &pool_statistics::active}};
  for (const auto& [name, field] : counters) {
    for (std::size_t k = 0; k < 3; ++k) {
      const stat& x = kinds[k]->*field;
      const std::string base = std::string(name) + '.' + kind_names[k] + '.';
      f(base + "current", x.current);
      f(base + "peak", x.peak);
      f(base + "allocated", x.allocated);
      f(base + "freed", x.freed);
    }
  }
}

}  // namespace streamsafe
