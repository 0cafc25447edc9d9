// streamsafe core: the statistics' state (internal). Three parts, each with its own rule:
//   stream_stats  a stream's counters, in its stream_state, guarded by that stream's lock; the
//                 fast path updates only allocated, requested and count. stats() sums them.
//   statistics    the device-level counters (public type, statistics.hpp): impl::stats_,
//                 GUARDED_BY(mu_), taken only on slow paths.
//   peak_sampler  device-wide peaks of allocated, active and requested bytes, sampled without a
//                 lock from the first k_sampled streams' atomic mirrors (stream_state::cur_*):
//                 all atomics, no lock. impl::sampling_; sample() is in streams.cpp.
#pragma once

#include <streamsafe/core/statistics.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace streamsafe::detail {

struct stream_state;

// A counter of the fast path: current, total ever added, peak (freed = total - current).
struct fast_stat {
  std::int64_t current = 0, total = 0, peak = 0;
  void add(std::int64_t n) noexcept {
    current += n;
    total += n;
    if (current > peak) peak = current;
  }
  void sub(std::int64_t n) noexcept { current -= n; }
  stat to_stat() const noexcept { return stat{current, peak, total, total - current}; }
};

// Statistics kept per stream (under its lock) and summed by stats(). Active = allocated +
// pending (freed by the host, waiting for other streams), so the fast path updates only the
// allocated, requested and count counters.
struct stream_stats {
  fast_stat allocated_bytes, requested_bytes, allocation;
  fast_stat pending_bytes, pending;
  std::int64_t active_bytes_peak = 0, active_peak = 0;
  std::uint64_t events_recorded = 0;
  std::uint64_t stream_waits = 0;
};

// Streams in creation order, readable without a lock, for sampling device-wide peaks.
struct peak_sampler {
  static constexpr std::size_t k_sampled_streams = 1024;
  std::array<std::atomic<stream_state*>, k_sampled_streams> table{};
  std::atomic<std::size_t> count{0};
  std::atomic<std::int64_t> peak_allocated{0}, peak_active{0}, peak_requested{0};

  // A new stream state (the device lock held: one writer at a time); past the table, unsampled.
  void add(stream_state* st) noexcept {
    const std::size_t n = count.load(std::memory_order_relaxed);
    if (n < k_sampled_streams) {
      table[n].store(st, std::memory_order_release);
      count.store(n + 1, std::memory_order_release);
    }
  }
  void sample() noexcept;  // after an allocation that may set a device-wide peak
};

}  // namespace streamsafe::detail
