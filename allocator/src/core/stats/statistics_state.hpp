// streamsafe core: the statistics' state (internal). Three parts, each with its own rule:
//   stream_stats  a stream's counters, for every pool and by pool kind, in its stream_state,
//                 guarded by that stream's lock; the fast path updates only allocated,
//                 requested and count. stats() sums them.
//   statistics    the device-level counters (public type, statistics.hpp): impl::stats_,
//                 GUARDED_BY(mu_), taken only on slow paths (reserved bytes and segments by
//                 kind through add_reserved / add_segment and their inverses).
//   peak_sampler  device-wide peaks of allocated, requested and active bytes and of the
//                 allocation and active counts, by kind, sampled without a lock from the first
//                 k_sampled streams' atomic mirrors (stream_state::mirror): all atomics, no
//                 lock. impl::sampling_; sample() is in streams.cpp.
#pragma once

#include <streamsafe/core/statistics.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace streamsafe::detail {

struct stream_state;

// Counter kinds, in PyTorch's StatType order: every pool, small pools, large pools.
inline constexpr std::size_t k_all = 0;
inline constexpr std::size_t k_kinds = 3;
inline constexpr std::size_t kind_of(bool small) noexcept { return small ? 1 : 2; }

// The public counters of kind k (k_all: the statistics object itself).
inline pool_statistics& kind_stats(statistics& s, std::size_t k) noexcept {
  return k == k_all ? static_cast<pool_statistics&>(s) : k == 1 ? s.small_pool : s.large_pool;
}
inline const pool_statistics& kind_stats(const statistics& s, std::size_t k) noexcept {
  return k == k_all ? static_cast<const pool_statistics&>(s) : k == 1 ? s.small_pool : s.large_pool;
}

// Device-level counters of segments of a small (or large) pool: every pool and the pool's kind.
// The caller holds the device lock (they live in impl::stats_).
inline void add_reserved(statistics& s, bool small, std::int64_t bytes) noexcept {
  s.reserved_bytes.increase(bytes);
  kind_stats(s, kind_of(small)).reserved_bytes.increase(bytes);
}
inline void sub_reserved(statistics& s, bool small, std::int64_t bytes) noexcept {
  s.reserved_bytes.decrease(bytes);
  kind_stats(s, kind_of(small)).reserved_bytes.decrease(bytes);
}
// Reserved bytes that stay mapped but now count in the other kind: memory of a queued block that
// a pool of the other kind reclaimed by mapping it again (reclaim.cpp), or back from there to
// the queued block when the new address goes (unghost_locked). Every pool's counter and the
// kinds' allocated and freed totals stay (no driver call; small + large == all for them); the
// receiving kind's peak follows its current value.
inline void move_reserved(statistics& s, bool from_small, bool to_small,
                          std::int64_t bytes) noexcept {
  if (from_small == to_small) return;
  stat& from = kind_stats(s, kind_of(from_small)).reserved_bytes;
  stat& to = kind_stats(s, kind_of(to_small)).reserved_bytes;
  from.current -= bytes;
  to.current += bytes;
  if (to.current > to.peak) to.peak = to.current;
}
inline void add_segment(statistics& s, bool small) noexcept {
  s.segment.increase(1);
  kind_stats(s, kind_of(small)).segment.increase(1);
}
inline void sub_segment(statistics& s, bool small) noexcept {
  s.segment.decrease(1);
  kind_stats(s, kind_of(small)).segment.decrease(1);
}

// A counter of the fast path: current, total ever added, peak (freed = total - current).
struct fast_stat {
  std::int64_t current = 0, total = 0, peak = 0;
  bool add(std::int64_t n) noexcept {  // true when the peak rose
    current += n;
    total += n;
    if (current <= peak) return false;
    peak = current;
    return true;
  }
  void sub(std::int64_t n) noexcept { current -= n; }
  stat to_stat() const noexcept { return stat{current, peak, total, total - current}; }
};

// One kind's counters of one stream. Active = allocated + pending (freed by the host, waiting
// for other streams), so the fast path updates only the allocated, requested and count counters.
struct stream_kind_stats {
  fast_stat allocated_bytes, requested_bytes, allocation;
  fast_stat pending_bytes, pending;
  std::int64_t active_bytes_peak = 0, active_peak = 0;
};

// Statistics kept per stream (under its lock) and summed by stats(): by[k_all] and by the kind
// of the block's pool (kind_of(seg->small)). The stream's own peaks only say when a device-wide
// peak may have risen while it is the only stream (allocate.cpp).
struct stream_stats {
  std::array<stream_kind_stats, k_kinds> by{};
  std::uint64_t events_recorded = 0;
  std::uint64_t stream_waits = 0;

  // An allocation of `bytes` (asked: `requested`) from a pool of kind k; true when a peak of this
  // stream rose.
  bool on_allocate(std::size_t k, std::int64_t bytes, std::int64_t requested) noexcept {
    bool rose = false;
    for (stream_kind_stats* x : {&by[k_all], &by[k]}) {
      rose |= x->allocated_bytes.add(bytes);
      rose |= x->requested_bytes.add(requested);
      rose |= x->allocation.add(1);
      const std::int64_t active_bytes = x->allocated_bytes.current + x->pending_bytes.current;
      const std::int64_t active = x->allocation.current + x->pending.current;
      if (active_bytes > x->active_bytes_peak) x->active_bytes_peak = active_bytes, rose = true;
      if (active > x->active_peak) x->active_peak = active, rose = true;
    }
    return rose;
  }
  void on_free(std::size_t k, std::int64_t bytes, std::int64_t requested) noexcept {
    for (stream_kind_stats* x : {&by[k_all], &by[k]}) {
      x->allocated_bytes.sub(bytes);
      x->requested_bytes.sub(requested);
      x->allocation.sub(1);
    }
  }
  void pending_added(std::size_t k, std::int64_t bytes) noexcept {
    for (stream_kind_stats* x : {&by[k_all], &by[k]}) {
      x->pending_bytes.add(bytes);
      x->pending.add(1);
    }
  }
  void pending_done(std::size_t k, std::int64_t bytes) noexcept {
    for (stream_kind_stats* x : {&by[k_all], &by[k]}) {
      x->pending_bytes.sub(bytes);
      x->pending.sub(1);
    }
  }
  void reset_peaks() noexcept {
    for (stream_kind_stats& x : by) {
      for (fast_stat* f :
           {&x.allocated_bytes, &x.requested_bytes, &x.allocation, &x.pending_bytes, &x.pending})
        f->peak = f->current;
      x.active_bytes_peak = x.allocated_bytes.current + x.pending_bytes.current;
      x.active_peak = x.allocation.current + x.pending.current;
    }
  }
};

// The sampled quantities, each by kind: peaks of their device-wide sums.
enum sampled : std::size_t {
  s_allocated_bytes,
  s_requested_bytes,
  s_allocation,
  s_active_bytes,
  s_active,
  k_sampled
};

// A stream's current values by pool kind (small, large), mirrored for lock-free reads by the
// sampler; written under the stream's lock after each change.
struct stat_mirror {
  std::array<std::atomic<std::int64_t>, 2> allocated_bytes{}, requested_bytes{}, allocation{},
      pending_bytes{}, pending{};
  void publish(const stream_stats& s, std::size_t k) noexcept {
    const std::size_t i = k - 1;  // a kind, never k_all
    allocated_bytes[i].store(s.by[k].allocated_bytes.current, std::memory_order_relaxed);
    requested_bytes[i].store(s.by[k].requested_bytes.current, std::memory_order_relaxed);
    allocation[i].store(s.by[k].allocation.current, std::memory_order_relaxed);
  }
  std::int64_t allocated_total() const noexcept {
    return allocated_bytes[0].load(std::memory_order_relaxed) +
           allocated_bytes[1].load(std::memory_order_relaxed);
  }
  std::int64_t pending_total() const noexcept {
    return pending_bytes[0].load(std::memory_order_relaxed) +
           pending_bytes[1].load(std::memory_order_relaxed);
  }
  void publish_pending(const stream_stats& s, std::size_t k) noexcept {
    const std::size_t i = k - 1;
    pending_bytes[i].store(s.by[k].pending_bytes.current, std::memory_order_relaxed);
    pending[i].store(s.by[k].pending.current, std::memory_order_relaxed);
  }
};

// Streams in creation order, readable without a lock, for sampling device-wide peaks.
struct peak_sampler {
  static constexpr std::size_t k_sampled_streams = 1024;
  std::array<std::atomic<stream_state*>, k_sampled_streams> table{};
  std::atomic<std::size_t> count{0};
  // peak[q][k]: the device-wide peak of quantity q (sampled) of kind k.
  std::array<std::array<std::atomic<std::int64_t>, k_kinds>, k_sampled> peak{};
  // The largest inactive split bytes of each kind a stats() or snapshot() walk has seen (they
  // are counted by walking the segments, never on the fast path).
  mutable std::array<std::atomic<std::int64_t>, k_kinds> inactive_split_peak{};

  // A new stream state (the device lock held: one writer at a time); past the table, unsampled.
  void add(stream_state* st) noexcept {
    const std::size_t n = count.load(std::memory_order_relaxed);
    if (n < k_sampled_streams) {
      table[n].store(st, std::memory_order_release);
      count.store(n + 1, std::memory_order_release);
    }
  }
  void sample() noexcept;  // after an allocation that may set a device-wide peak
  static void raise(std::atomic<std::int64_t>& peak, std::int64_t v) noexcept {
    std::int64_t cur = peak.load(std::memory_order_relaxed);
    while (v > cur && !peak.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
    }
  }
};

}  // namespace streamsafe::detail
