// streamsafe core: the streams' state (internal): one stream_state per stream the allocator has
// seen (and per CUDA graph private pool), and the registry that finds them.
//
// Locks. A stream_state is guarded by its own `mu` (a stream_lock, stream_lock.hpp: a spin lock,
// one atomic exchange per acquire): its pools, the blocks of its segments, its active map, its
// pending lists, its event cache and its counters. The same-stream fast path (allocate and free
// on one stream) takes only this lock. The members noted "under mu_" are written under both the
// device lock and this one. The atomics (cur_*, alive, cache_key) are read without a lock.
// The stream_registry (impl::streams_) is GUARDED_BY(mu_), the device lock: the map of states,
// the segments by base address, the destroyed streams and their tombstones. Whoever holds mu_
// may take any number of stream locks; a thread holding a stream lock never waits for mu_.
// Functions that take a pool or a block need the lock of its owner stream (state_of(pool).mu),
// which clang cannot match to the caller's state: that rule stays a convention.
#pragma once

#include "core/blocks/active_map.hpp"
#include "core/blocks/block.hpp"
#include "core/blocks/pool.hpp"
#include "core/common/thread_annotations.hpp"
#include "core/events/pending_list.hpp"
#include "core/stats/statistics_state.hpp"
#include "core/streams/stream_lock.hpp"

#include <streamsafe/backends/device_backend.hpp>
#include <streamsafe/core/sleep.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

namespace streamsafe::detail {

// Blocks freed with uses on other streams are checked for completion in batches of this many
// (one event query per stream proves a whole batch, see process_events_locked).
inline constexpr std::size_t k_pending_batch = 32;
inline constexpr std::size_t k_event_cache = 16;  // events a stream keeps under its own lock

// The pools of one tag on one stream (tags.cpp); `refused` is its tag_state's flag.
struct tag_pools {
  tag_id tag = 0;
  pool small_pool;
  pool large_pool;
  const std::atomic<bool>* refused = nullptr;
};

// A stream the allocator has seen, with its two pools, under its own lock. Cache-line aligned:
// threads on different streams write only their own stream_state, and no two of them share a
// line (no false sharing on the fast path).
struct alignas(64) stream_state {
  stream_lock mu;
  stream_handle handle = 0;
  pool small_pool;
  pool large_pool;
  // Tagged pools of this stream, created by the slow path under mu_ and this lock; read under
  // this lock (the fast path scans it, a few entries).
  std::vector<std::unique_ptr<tag_pools>> tagged;
  active_map active;     // active blocks of this stream's segments
  pending_list pending;  // pending_free blocks of this stream's segments, in free order
  // reuse_fence:all_streams: pending_free blocks freed by the host since the last reuse fence,
  // with no event yet (free.cpp: fence_host_frees_locked orders this stream after every known
  // stream once, for all of them).
  pending_list unfenced;
  // Base addresses of segments where a block that an empty_cache(defer) found pending
  // (block::release_after) has retired since: the next reclaim() releases their free memory
  // (empty_cache.cpp, release_after_pending_locked), and nothing cached since that empty_cache.
  std::vector<std::uintptr_t> retired_after_empty_cache;
  stream_stats stats;      // this stream's counters (summed by caching_allocator::stats)
  block* spare = nullptr;  // recycled block objects (linked through next)
  // Pooled events of this stream's pending blocks, reused under this lock alone (no trip to
  // the shared event_pool); at most k_event_cache, capacity reserved at creation.
  std::vector<event_handle> event_cache;
  // The fast path runs process_events_locked once pending holds this many blocks (or when
  // nothing else fits); each run sets it k_pending_batch above what stays pending.
  std::size_t process_at = k_pending_batch;
  // The idle fence of the large pool (cuda_malloc, empty_cache.cpp: prove_idle_segments_locked):
  // events recorded at a growth over the whole free segments then not proven idle, which were
  // labelled idle_fence_id; under mu_ and this lock.
  std::vector<pending_event> idle_fence;
  std::uint32_t idle_fence_id = 0;
  // Mirrors of stats' current values, read without the lock to sample device-wide peaks.
  detail::stat_mirror mirror;
  std::atomic<bool> alive{true};
  // The handle this state serves, for the threads' stream caches (a per-thread stream's
  // handle, cudaStreamPerThread, for its key's state): a retired state (reused for another
  // stream later, never freed) holds k_tombstone_stream.
  std::atomic<stream_handle> cache_key{0};
  // Non-zero: this is not a stream but the private pool of CUDA graph `graph` (capture.cpp),
  // keyed in the registry by graph_key(graph); handle is the capturing stream.
  std::uint64_t graph = 0;
  bool graph_released = false;  // every graph of the pool released: its free segments may go
  int pool_graphs = 0;          // graphs captured into this pool (shared pools) not released yet
  std::size_t segments = 0;     // segments its pools own (also while released or deferred); mu_
};

inline stream_state& state_of(const pool& p) { return *static_cast<stream_state*>(p.state); }
inline pool& pool_of(stream_state& st, bool small) { return small ? st.small_pool : st.large_pool; }

// The tagged pool of st for `tag` (fast path: nullptr when missing or refused; st's lock held).
inline pool* tagged_pool(stream_state& st, bool small, tag_id tag) STREAMSAFE_REQUIRES(st.mu) {
  for (auto& tp : st.tagged) {
    if (tp->tag != tag) continue;
    if (tp->refused->load(std::memory_order_acquire)) return nullptr;
    return small ? &tp->small_pool : &tp->large_pool;
  }
  return nullptr;
}

// Every pool of st, untagged first (st's lock held).
template <class F>
void for_each_pool(stream_state& st, F&& f) {
  f(st.small_pool);
  f(st.large_pool);
  for (auto& tp : st.tagged) {
    f(tp->small_pool);
    f(tp->large_pool);
  }
}
template <class F>
void for_each_pool(const stream_state& st, F&& f) {
  f(st.small_pool);
  f(st.large_pool);
  for (const auto& tp : st.tagged) {
    f(static_cast<const pool&>(tp->small_pool));
    f(static_cast<const pool&>(tp->large_pool));
  }
}

// The streams and segments of one device, guarded by the device lock (impl::streams_).
// Destroyed streams whose states are still in `states` (they own blocks, or their tombstone has
// not been seen complete) are in `dead`; retired states wait in `spare` for reuse (never freed:
// other threads' stream caches may still point at them).
struct stream_registry {
  std::unordered_map<stream_handle, std::unique_ptr<stream_state>> states;  // by key
  std::map<std::uintptr_t, segment*> segments;                              // by base address
  // The newest tombstone, an event recorded on a stream just before it was destroyed, after
  // that stream waited on the previous tombstone: its completion proves every destroyed
  // stream's work done. At most one entry; part of every fence; cleared once seen complete.
  std::vector<pending_event> tombstones;
  // Superseded or completed tombstones still referenced (impl::tombstone_refs_ > 0, an atomic
  // beside the registry): back to the event pool once nothing refers to a tombstone.
  std::vector<event_handle> superseded_tombstones;
  std::vector<stream_state*> dead;
  std::vector<std::unique_ptr<stream_state>> spare;
};

}  // namespace streamsafe::detail
