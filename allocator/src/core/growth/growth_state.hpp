// streamsafe core: the growth policy's state (internal; growth_policy.cpp holds the policy,
// growth.cpp and release.cpp its mechanisms). Two parts, by lock rule:
//   growth_limits  the memory limit and the chunk sizes of expandable segments: written only by
//                  the constructor, read anywhere without a lock (impl::limits_).
//   growth_state   what the policy has seen: the high-water mark of reserved bytes it does not
//                  grow past without giving idle memory back first, and the labels of the idle
//                  fences (empty_cache.cpp: prove_idle_segments_locked). impl::growth_ is
//                  GUARDED_BY(mu_), the device lock.
#pragma once

#include <streamsafe/core/statistics.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace streamsafe::detail {

struct growth_limits {
  std::size_t limit_bytes = 0;         // reserved bytes never exceed this (options, device total)
  std::size_t device_total_bytes = 0;  // the device's memory, as the backend reports it
  std::size_t small_chunk_bytes = 0;   // expandable small pools: the driver's granularity
  std::size_t large_chunk_bytes = 0;   // expandable large pools: options::expandable_chunk_bytes
  std::size_t peak_chunk_bytes = 0;    // their growths past the high-water mark (growth.cpp)
  std::size_t tag_handle_bytes = 0;    // resume's largest handle (wake.cpp)
  std::size_t chunks_per_peak = 0;     // options::expandable_chunks_per_peak (growth.cpp)
};

// The serve path's waits made so far for one request (serve_path.cpp).
struct serve_waits {
  int worker_waits = 0;
  int pause_waits = 0;          // on tags still pausing: their fences, then (offload) their copies
  bool fencing_waited = false;  // for another thread's empty_cache:wait on its fence
  bool dead_pending_waited = false;  // on the uses of destroyed streams' pending memory
  bool fence_waited = false;
};

// How long the serve path waits on the host, in defer mode, for the fences of queued releases
// (and, apart, of tags still pausing) before it gives up (a bound, not a hang, K8): a step's tail
// of kernels.
inline constexpr std::uint64_t k_oom_fence_wait_us = 1000000;

struct growth_state {
  // The most bytes ever reserved at once: the growth policy's peak. statistics' reserved peak
  // restarts at reset_peak_stats(); this is kept across it, so that resetting the statistics
  // never changes how the allocator grows.
  std::size_t reserved_high_water = 0;
  std::uint32_t next_idle_fence_id = 2;  // the label of the next idle fence (1: proven idle)

  std::size_t high_water(const statistics& stats) const noexcept {
    return std::max(reserved_high_water, static_cast<std::size_t>(stats.reserved_bytes.peak));
  }
};

}  // namespace streamsafe::detail
