// streamsafe core: the caching allocator's state (internal; shared by caching_allocator.cpp,
// which allocates and frees, and release.cpp, which gives memory back behind fences).
//
// Locks, in order:
//   mu_ (the device lock)  guards streams_, segments_, the deferred queue, tombstones_ and the
//                          device-level statistics (stats_). Taken only on slow paths.
//   stream_state::mu       (a stream_lock, stream_lock.hpp) guards that stream's pools, the blocks
//   of its segments, its active
//                          map, its pending list and its statistics. The same-stream fast path
//                          (allocate and free on one stream) takes only this lock.
//   events_mu_             guards the event pool; a leaf (nothing is taken while holding it).
// Whoever holds mu_ may take any number of stream locks (only one thread can hold mu_). A thread
// holding a stream lock never waits for mu_: the fast path drops its stream lock before taking
// mu_ and then the stream lock again. Holding mu_ does not keep a stream's pools still: what
// was seen under a stream lock holds only while that lock is held, since that stream's fast path
// may allocate from them as soon as it is dropped (steal_segment_locked re-checks its choice
// under the lock before it moves a segment). mu_ is dropped around host-blocking backend calls
// (synchronize_event, synchronize_device) and around the driver calls that return memory
// (free_segment, unmap), whose blocks are detached (state releasing) meanwhile.
// Graph capture (capture.cpp): captures_, graphs_, held_frees_ and the after-capture requests
// are guarded by mu_; captures_underway_ mirrors captures_.size() for lock-free reads.
// clang checks these rules (-Wthread-safety, thread_annotations.hpp): the members mu_ guards are
// GUARDED_BY(mu_), a _locked function that needs mu_ REQUIRES(mu_), and one that takes a
// stream_state REQUIRES(st.mu). Functions that take a pool or a block need the lock of its
// owner stream (state_of(pool).mu), which the analysis cannot match to the caller's stream
// state: that rule stays a convention, stated above their declarations.
#pragma once

#include "active_map.hpp"
#include "block.hpp"
#include "ipc_registry.hpp"
#include "pending_list.hpp"
#include "pool.hpp"
#include "stream_lock.hpp"
#include "thread_annotations.hpp"

#include <streamsafe/core/caching_allocator.hpp>
#include <streamsafe/core/sleep.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace streamsafe {

struct caching_allocator::impl {
  using block = detail::block;
  using segment = detail::segment;
  using pool = detail::pool;

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

  // Blocks freed with uses on other streams are checked for completion in batches of this many
  // (one event query per stream proves a whole batch, see process_events_locked).
  static constexpr std::size_t k_pending_batch = 32;
  static constexpr std::size_t k_event_cache = 16;

  // A stream the allocator has seen, with its two pools, under its own lock (stream_lock.hpp:
  // a spin lock, one atomic exchange per acquire).
  using stream_lock = detail::stream_lock;
  // Cache-line aligned: threads on different streams write only their own stream_state, and no
  // two of them share a line (no false sharing on the fast path).
  // The pools of one tag on one stream (tags.cpp); `refused` is its tag_state's flag.
  struct tag_pools {
    tag_id tag = 0;
    pool small_pool;
    pool large_pool;
    const std::atomic<bool>* refused = nullptr;
  };
  struct alignas(64) stream_state {
    stream_lock mu;
    stream_handle handle = 0;
    pool small_pool;
    pool large_pool;
    // Tagged pools of this stream, created by the slow path under mu_ and this lock; read under
    // this lock (the fast path scans it, a few entries).
    std::vector<std::unique_ptr<tag_pools>> tagged;
    detail::active_map active;     // active blocks of this stream's segments
    detail::pending_list pending;  // pending_free blocks of this stream's segments, in free order
    // reuse_fence:all_streams: pending_free blocks freed by the host since the last reuse fence,
    // with no event yet (free.cpp: fence_host_frees_locked orders this stream after every known
    // stream once, for all of them).
    detail::pending_list unfenced;
    stream_stats stats;      // this stream's counters (summed by caching_allocator::stats)
    block* spare = nullptr;  // recycled block objects (linked through next)
    // Pooled events of this stream's pending blocks, reused under this lock alone (no trip to
    // the shared pool and events_mu_); at most k_event_cache, capacity reserved at creation.
    std::vector<event_handle> event_cache;
    // The fast path runs process_events_locked once pending holds this many blocks (or when
    // nothing else fits); each run sets it k_pending_batch above what stays pending.
    std::size_t process_at = k_pending_batch;
    // The idle fence of the large pool (cuda_malloc, release.cpp: prove_idle_segments_locked):
    // events recorded at a growth over the whole free segments then not proven idle, which were
    // labelled idle_fence_id; under mu_ and this lock.
    std::vector<detail::pending_event> idle_fence;
    std::uint32_t idle_fence_id = 0;
    // Mirrors of stats' current values, read without the lock to sample device-wide peaks.
    std::atomic<std::int64_t> cur_allocated{0}, cur_pending{0}, cur_requested{0};
    std::atomic<bool> alive{true};
    // The handle this state serves, for the threads' stream caches (a per-thread stream's
    // handle, cudaStreamPerThread, for its key's state): a retired state (reused for another
    // stream later, never freed) holds k_tombstone_stream.
    std::atomic<stream_handle> cache_key{0};
    // Non-zero: this is not a stream but the private pool of CUDA graph `graph` (capture.cpp),
    // keyed in streams_ by graph_key(graph); handle is the capturing stream.
    std::uint64_t graph = 0;
    bool graph_released =
        false;            // every graph of the pool released: its free segments may be released
    int pool_graphs = 0;  // graphs captured into this pool (shared pools) not released yet
    std::size_t segments =
        0;  // segments its pools own (also while released or deferred); under mu_
  };

  // A capture underway on one stream of the device.
  struct capture_record {
    stream_handle stream = 0;
    std::uint64_t graph = 0;  // the id notify_capture_begin returned
    std::uint64_t pool =
        0;  // the graph whose private pool it allocates into (graph, or a shared one)
    bool detected = false;  // found by backend_.stream_is_capturing, not announced
  };
  // A graph the allocator has given an id: the private pool it allocates into (its own, keyed
  // graph_key(graph), or an earlier graph's that it shares) and whether it was released.
  struct graph_record {
    std::uint64_t pool = 0;
    bool released = false;
  };
  // A free made during a capture that could not complete then (see capture.cpp).
  struct held_free {
    block* b = nullptr;
    bool has_stream = false;
    stream_handle stream = 0;
    std::uint64_t graph =
        0;  // 0: completes when no capture is underway; else at that graph's release
  };
  static constexpr stream_handle graph_key(std::uint64_t graph) {
    return ~stream_handle{0} - graph;
  }

  // Memory detached for release, and the fence that must complete first.
  struct release_batch {
    std::vector<block*> blocks;  // whole-segment blocks (cuda_malloc) or chunk runs (expandable)
    std::vector<stream_handle> streams;  // the streams the fence covers
    std::vector<detail::pending_event> fence;
    bool device_sync = false;
    std::size_t bytes = 0;
    std::uint64_t id = 0;  // identifies a queued batch across a wait without the lock
  };

  // Sleep/wake (sleep.cpp). One segment of a tag being paused: its mapped runs (chunk-aligned,
  // every mapped block but those being released), its fence, and in offload mode the copies of
  // its live blocks to pinned host memory.
  struct offload_copy {
    std::uintptr_t addr = 0;
    std::size_t bytes = 0;
    void* host = nullptr;  // from host_ (allocated on copy_stream_)
  };
  struct paused_segment {
    segment* seg = nullptr;
    std::vector<std::pair<std::uintptr_t, std::size_t>> runs;
    std::size_t bytes = 0;
    std::vector<detail::pending_event> fence;
    std::vector<stream_handle> fence_streams;
    std::vector<offload_copy> copies;
    bool copies_enqueued = false;
    event_handle copied = 0;        // recorded on copy_stream_ after the copies
    std::size_t runs_unmapped = 0;  // runs[0, runs_unmapped) are back with the driver
  };
  struct tag_state {
    tag_id id = 0;
    std::string name;
    std::atomic<bool> refused{false};  // allocation under the tag throws tag_paused
    tag_phase phase = tag_phase::active;
    pause_mode mode = pause_mode::discard;
    std::vector<paused_segment> segments;
    std::size_t offloaded_host_bytes = 0;
    int busy = 0;  // pause/resume driver calls in flight with mu_ dropped
    // resume_async: the phase before `resuming`, the caller's stream, the worker's last error.
    tag_phase phase_before_resume = tag_phase::paused;
    bool has_resume_stream = false;
    stream_handle resume_stream = 0;
    std::string resume_error;
  };

  impl(device_backend& backend, options opts);

  device_backend& backend_;
  options opts_;
  const std::uint64_t id_;               // distinguishes allocators in the threads' stream caches
  const std::uint64_t fork_generation_;  // fork.cpp: the process's fork count when it was made
  bool trace_log_ = false;  // the logger was at trace level when the allocator was made
  std::unique_ptr<trace_recorder> own_trace_;    // when options::trace_capacity is set
  std::atomic<trace_recorder*> trace_{nullptr};  // where trace events go (nullptr: off)
  void trace(trace_action action, std::uintptr_t address, std::size_t size,
             stream_handle stream) noexcept {
    if (trace_recorder* t = trace_.load(std::memory_order_acquire))
      t->record(action, address, size, stream, backend_.device());
  }
  std::size_t limit_bytes_ = 0;
  std::size_t device_total_bytes_ = 0;
  std::size_t small_chunk_bytes_ = 0;  // expandable small pools: the driver's granularity
  std::size_t large_chunk_bytes_ = 0;  // expandable large pools: options::expandable_chunk_bytes
  std::size_t peak_chunk_bytes_ = 0;   // their growths past the high-water mark (growth.cpp)

  mutable detail::mutex mu_;
  using device_lock = detail::unique_lock<detail::mutex>;  // mu_, dropped around driver calls
  std::unordered_map<stream_handle, std::unique_ptr<stream_state>> streams_
      STREAMSAFE_GUARDED_BY(mu_);
  std::map<std::uintptr_t, segment*> segments_ STREAMSAFE_GUARDED_BY(mu_);  // by base address
  // cudaMalloc segments out of segments_ while free_segment runs without mu_ (release.cpp):
  // their one block is detached (releasing) and their bytes still count as reserved.
  std::vector<segment*> releasing_segments_ STREAMSAFE_GUARDED_BY(mu_);
  std::deque<release_batch> deferred_ STREAMSAFE_GUARDED_BY(mu_);
  std::size_t deferred_bytes_ STREAMSAFE_GUARDED_BY(mu_) = 0;
  std::uint64_t next_batch_id_ STREAMSAFE_GUARDED_BY(mu_) = 1;
  // Blocks freed by a slow-path free with uses on other streams (pending_free, in their owner's
  // pending list with no events yet): the free made no backend call (it may run in a stream
  // callback, K16); fence_unfenced_locked records their events from an ordinary call.
  std::vector<block*> unfenced_ STREAMSAFE_GUARDED_BY(mu_);
  bool empty_cache_requested_ STREAMSAFE_GUARDED_BY(mu_) =
      false;  // empty_cache asked for in a stream callback
  // The newest tombstone, an event recorded on a stream just before it was destroyed, after
  // that stream waited on the previous tombstone: its completion proves every destroyed
  // stream's work done. At most one entry; part of every fence; cleared once seen complete.
  std::vector<detail::pending_event> tombstones_ STREAMSAFE_GUARDED_BY(mu_);
  // Superseded or completed tombstones still referenced (tombstone_refs_ > 0): back to the
  // event pool once no pending block and no unlocked wait refers to a tombstone.
  std::vector<event_handle> superseded_tombstones_ STREAMSAFE_GUARDED_BY(mu_);
  std::atomic<std::int64_t> tombstone_refs_{0};  // tombstone entries of pending blocks and waits
  // Destroyed streams whose states are still in streams_ (they own blocks, or their tombstone
  // has not been seen complete); retired states wait in spare_states_ for reuse (never freed:
  // other threads' stream caches may still point at them).
  std::vector<stream_state*> dead_states_ STREAMSAFE_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<stream_state>> spare_states_ STREAMSAFE_GUARDED_BY(mu_);
  statistics stats_ STREAMSAFE_GUARDED_BY(
      mu_);  // device-level parts; per-stream parts live in stream_state::stats
  // The most bytes ever reserved at once: the growth policy's peak (growth.cpp,
  // growth_release.cpp). stats_.reserved_bytes.peak restarts at reset_peak_stats(); this is
  // kept across it, so that resetting the statistics never changes how the allocator grows.
  std::size_t reserved_high_water_ STREAMSAFE_GUARDED_BY(mu_) = 0;
  std::size_t reserved_high_water_locked() const STREAMSAFE_REQUIRES(mu_) {
    return std::max(reserved_high_water_, static_cast<std::size_t>(stats_.reserved_bytes.peak));
  }
  // Reserved bytes on their way back: the deferred queue and the worker's release in flight.
  std::size_t queued_release_bytes_locked() const STREAMSAFE_REQUIRES(mu_) {
    return deferred_bytes_ + stats_.release_worker_bytes;
  }

  // CUDA graph capture (capture.cpp), guarded by mu_.
  std::vector<capture_record> captures_ STREAMSAFE_GUARDED_BY(mu_);
  std::atomic<int> captures_underway_{0};
  std::vector<held_free> held_frees_ STREAMSAFE_GUARDED_BY(mu_);
  std::unordered_map<std::uint64_t, graph_record> graphs_ STREAMSAFE_GUARDED_BY(mu_);
  std::vector<std::uint64_t> releases_after_capture_
      STREAMSAFE_GUARDED_BY(mu_);  // notify_graph_released during a capture
  bool empty_cache_after_capture_ STREAMSAFE_GUARDED_BY(mu_) =
      false;  // empty_cache asked for during a capture
  std::uint64_t next_graph_id_ STREAMSAFE_GUARDED_BY(mu_) = 1;
  std::uint64_t capture_deferrals_ STREAMSAFE_GUARDED_BY(mu_) =
      0;  // releases/queries skipped because of a capture
  // Fence waits and releases running with mu_ dropped; notify_capture_begin waits for none.
  int driver_calls_in_flight_ STREAMSAFE_GUARDED_BY(mu_) = 0;
  std::condition_variable_any driver_calls_done_;  // waits on a device_lock
  // Drops mu_ around a host-blocking or releasing driver call and counts it in flight; relock()
  // (or the destructor, on an exception) takes mu_ back.
  class driver_call_scope {
   public:
    driver_call_scope(impl& m, device_lock& lk) STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS : m_(m),
                                                                                       lk_(lk) {
      ++m_.driver_calls_in_flight_;
      lk_.unlock();
    }
    void relock() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
      if (done_) return;
      lk_.lock();
      done_ = true;
      if (--m_.driver_calls_in_flight_ == 0) m_.driver_calls_done_.notify_all();
    }
    ~driver_call_scope() { relock(); }
    driver_call_scope(const driver_call_scope&) = delete;
    driver_call_scope& operator=(const driver_call_scope&) = delete;

   private:
    impl& m_;
    device_lock& lk_;
    bool done_ = false;
  };

  // Streams in creation order, readable without mu_, for sampling peaks (first 1024 streams).
  static constexpr std::size_t k_sampled_streams = 1024;
  std::array<std::atomic<stream_state*>, k_sampled_streams> stream_table_{};
  std::atomic<std::size_t> stream_count_{0};
  std::atomic<std::int64_t> peak_allocated_{0}, peak_active_{0}, peak_requested_{0};

  mutable detail::mutex events_mu_;
  std::vector<event_handle> free_events_ STREAMSAFE_GUARDED_BY(events_mu_);

  static stream_state& state_of(const pool& p) { return *static_cast<stream_state*>(p.state); }
  static pool& pool_of(stream_state& st, bool small) {
    return small ? st.small_pool : st.large_pool;
  }

  // ---- streams, events, blocks, growth, allocate, free, diagnostics (*.cpp) -----------------
  // A function that takes a pool or a block (and no stream_state) runs under the lock of the
  // stream owning that pool or block's segment; clang cannot check that one (see the top).
  stream_state& state_for(stream_handle stream);  // no lock held; may take mu_
  // `stream` is a key (key_of): a handle, or a per-thread stream's key.
  stream_state& get_or_create_stream_locked(stream_handle stream)
      STREAMSAFE_REQUIRES(mu_);  // mu_ held
  // cache_key: the handle the threads' stream caches look the state up by (0: `key`).
  stream_state& new_state_locked(stream_handle key, stream_handle handle,
                                 stream_handle cache_key = 0) STREAMSAFE_REQUIRES(mu_);  // mu_ held

  // ---- per-thread stream handles (cudaStreamPerThread; per_thread_stream.hpp, streams.cpp) ---
  // Every stream the core keeps state for, uses, fences and events is named by a key: the
  // handle itself, or for a handle the backend marks as per-thread (a different stream in every
  // host thread) the calling thread's per-thread key. The public calls translate their stream
  // argument with key_of; st.handle, pool::stream, segment::stream and block uses hold keys.
  // Throws std::invalid_argument for a per-thread handle above k_per_thread_max_handle.
  stream_handle key_of(stream_handle stream) const;
  // The backend calls on a key. A per-thread key is named to the backend by its handle on its
  // own thread only; from another thread (which cannot name that stream) the legacy default
  // stream (0) stands in: the legacy stream is ordered both ways with every blocking stream, and
  // every per-thread default stream is one (CUDA Driver API, "Stream synchronization behavior":
  // an action in the legacy stream first waits on all blocking streams, then they wait on it).
  // So an event recorded on 0 completes after all the work enqueued so far on every per-thread
  // stream, and a wait of 0 orders their later work behind it.
  // record_event_on returns the stream the event was recorded on (the key, or 0): the stream
  // under which process_events_locked may use stream order to prove it.
  stream_handle record_event_on(event_handle e, stream_handle key);
  void stream_wait_on(stream_handle key, event_handle e);
  bool query_stream_of(stream_handle key);  // another thread's per-thread stream: event on 0
  bool stream_capturing(stream_handle key) noexcept;  // another thread's per-thread: false
  stream_state* owner_locked(const void* ptr)
      STREAMSAFE_REQUIRES(mu_);  // mu_ held: owner of the segment, or null
  block* new_block(stream_state& st);
  void recycle_block(stream_state& st, block* b);
  block* best_fit(pool& p, std::size_t rounded) const;
  bool split_limit_refuses(const pool& p, const block* b,
                           std::size_t rounded) const noexcept;          // max_split_size
  bool keeps_whole(const block* b, std::size_t rounded) const noexcept;  // segment_fit.hpp's rule
  bool idle_at_growth(const block* b, std::size_t rounded)
      const noexcept;  // given back before growth past the peak
  block* fit_ignoring_whole_rule(pool& p, std::size_t rounded) const;  // at the memory limit
  block* take_pending_locked(stream_state& st, pool& p, std::size_t rounded)
      STREAMSAFE_REQUIRES(st.mu);
  block* new_segment_locked(pool& p, std::size_t rounded) STREAMSAFE_REQUIRES(mu_);
  // A new segment of p at `base` as one free block: mapped (cuda_malloc) or not (expandable).
  block* add_segment_locked(pool& p, std::uintptr_t base, std::size_t size, bool mapped)
      STREAMSAFE_REQUIRES(mu_);
  // The unmapped block of p to grow into for `rounded` bytes and how many bytes to map there.
  // within_limit false: also when mapping map_bytes would pass the limit (reclaim by alias).
  block* choose_unmapped_locked(const pool& p, std::size_t rounded, std::size_t& map_bytes,
                                bool within_limit = true) const STREAMSAFE_REQUIRES(mu_);
  // A new reserved range of p, large enough for `rounded` (growth.cpp).
  void reserve_range_locked(pool& p, std::size_t rounded) STREAMSAFE_REQUIRES(mu_);
  // Bytes mapped: chunks of `chunk` up to `fine_from` bytes into the range, of `fine` after it.
  std::size_t map_chunks_locked(segment* seg, std::uintptr_t addr, std::size_t bytes,
                                std::size_t chunk, std::size_t fine_from = SIZE_MAX,
                                std::size_t fine = 0) STREAMSAFE_REQUIRES(mu_);
  block* expandable_fit_locked(pool& p, std::size_t rounded) STREAMSAFE_REQUIRES(mu_);
  // whole_rule: not a segment the whole-segment rule keeps whole for the request.
  block* steal_segment_locked(pool& p, std::size_t rounded, bool whole_rule)
      STREAMSAFE_REQUIRES(mu_);
  // A destroyed stream's whole free segment for p, behind the tombstone (before growing).
  block* adopt_dead_segment_locked(pool& p, std::size_t rounded) STREAMSAFE_REQUIRES(mu_);
  // Moves a whole free segment to p; p's stream waits for every stream that may still touch it.
  block* move_segment_locked(segment* seg, pool& p) STREAMSAFE_REQUIRES(mu_);
  // Queries the tombstone; once complete, retires it and every destroyed stream owning nothing.
  void retire_dead_streams_locked() STREAMSAFE_REQUIRES(mu_);
  void drop_tombstone_locked(event_handle e) STREAMSAFE_REQUIRES(mu_);  // pooled unless referenced
  block* find_block_locked(stream_state& st, pool& p, std::size_t rounded, bool grow = true)
      STREAMSAFE_REQUIRES(mu_, st.mu);
  block* grow_locked(pool& p, std::size_t rounded)
      STREAMSAFE_REQUIRES(mu_);  // step 3 of the allocation order
  bool growth_raises_peak_with_refused_locked(const pool& p, std::size_t rounded) const
      STREAMSAFE_REQUIRES(mu_);
  bool expandable_growth_raises_peak_locked(const pool& p, std::size_t rounded) const
      STREAMSAFE_REQUIRES(mu_);
  // Bytes a growth of p for `rounded` bytes maps beyond peak reserved (0: none), and the free
  // mapped block it extends (null: none).
  std::size_t expandable_growth_excess_locked(const pool& p, std::size_t rounded,
                                              const block** extended) const
      STREAMSAFE_REQUIRES(mu_);

  void* finish_allocation(stream_state& st, block* b, std::size_t rounded, std::size_t size)
      STREAMSAFE_REQUIRES(st.mu);
  void* allocate_slow(stream_state& st, std::size_t size, std::size_t rounded, bool small,
                      tag_id tag) STREAMSAFE_EXCLUDES(mu_, st.mu);
  bool wants_collection_locked(std::size_t rounded) const STREAMSAFE_REQUIRES(mu_);  // mu_ held
  void split_locked(block* b,
                    std::size_t rounded);  // b's remainder beyond `rounded`, if worth a block
  // Cuts b at `offset`: the part beyond becomes a new block after b, of b's state and mapping.
  block* split_off_locked(block* b, std::size_t offset);
  block* take_cached_fit_locked(pool& p,
                                std::size_t rounded);  // quick cache, else flush and best fit
  block* free_block_locked(block* b);                  // to its pool, merging free neighbours
  block* merge_locked(block* lo, block* hi);           // address-adjacent; returns the survivor
  void process_events_locked(stream_state& st) STREAMSAFE_REQUIRES(st.mu);
  void flush_quick_locked(pool& p);
  void retire_pending_locked(stream_state& st, block* b) STREAMSAFE_REQUIRES(st.mu);
  void free_found_locked(stream_state& st, block* b, const stream_handle* stream)
      STREAMSAFE_REQUIRES(mu_, st.mu);  // mu_ held
  // The free dispatch of every path (free.cpp): true when b went back without events (a host
  // free fenced at its reuse, reuse_fence:all_streams, or a same-stream free); false when it
  // needs events, then recorded by free_with_events_locked (false: a stream this thread does
  // not know and no device lock; b stays active) or deferred (defer_fence_locked).
  bool free_without_events_locked(stream_state& st, block* b, const stream_handle* stream)
      STREAMSAFE_REQUIRES(st.mu);
  bool free_with_events_locked(stream_state& st, block* b, const stream_handle* stream,
                               bool device_locked) STREAMSAFE_REQUIRES(st.mu);
  // b's owner stream lock held (and mu_ when device_locked); see caching_allocator.cpp.
  bool record_use_events_locked(block* b, const stream_handle* stream, bool device_locked);
  void commit_free_locked(stream_state& st, block* b, const stream_handle* stream)
      STREAMSAFE_REQUIRES(st.mu);
  // A host free with uses on other streams, with no backend call: b goes pending with no events
  // and onto unfenced_ (mu_ and st's lock held).
  void defer_fence_locked(stream_state& st, block* b, const stream_handle* stream)
      STREAMSAFE_REQUIRES(mu_, st.mu);
  void fence_unfenced_locked()
      STREAMSAFE_REQUIRES(mu_);  // records unfenced_'s events (no capture underway)
  stream_state* cached_live_state(stream_handle stream) const;  // this thread's stream cache
  void count_free_locked(stream_state& st, const block* b)
      STREAMSAFE_REQUIRES(st.mu);  // the host free's counters (st's lock held)
  void free_same_stream_locked(stream_state& st, block* b)
      STREAMSAFE_REQUIRES(st.mu);  // b in st.active (it stays there if parked)
  // reuse_fence:all_streams. A host free: b leaves st.active for st.unfenced, recording nothing.
  void free_unfenced_locked(stream_state& st, block* b) STREAMSAFE_REQUIRES(st.mu);
  // The reuse fence of st's unfenced host frees: st waits, on the device, for every other known
  // stream (one event each) and the tombstones; then the blocks go back to st's pools.
  void fence_host_frees_locked(stream_state& st) STREAMSAFE_REQUIRES(mu_, st.mu);
  void fence_dead_stream_frees_locked(stream_state& st)
      STREAMSAFE_REQUIRES(mu_, st.mu);  // st destroyed
  event_handle get_event() STREAMSAFE_EXCLUDES(events_mu_);
  void put_event(event_handle e) STREAMSAFE_EXCLUDES(events_mu_);
  event_handle get_event(stream_state& st)
      STREAMSAFE_REQUIRES(st.mu);  // st's lock held: st's event cache first
  void put_event(stream_state& st, event_handle e) STREAMSAFE_REQUIRES(st.mu);
  void note_use_locked(segment* seg, stream_handle stream);
  void add_use_locked(block* b, stream_handle stream);  // record_stream: b's owner lock held
  void order_after_locked(stream_handle waiter, stream_handle on)
      STREAMSAFE_REQUIRES(mu_);  // mu_ held
  void sample_peaks();
  std::string oom_message_locked(std::size_t size, std::size_t rounded, stream_handle stream,
                                 const stream_state* held) STREAMSAFE_REQUIRES(mu_);
  std::size_t largest_free_locked(const stream_state* held) const STREAMSAFE_REQUIRES(mu_);
  // Counts the out-of-memory, drops both locks (slk may be null), logs and throws; `note` ends
  // the message. `held`: the stream state whose lock the caller holds, as for oom_message_locked.
  [[noreturn]] void throw_out_of_memory_locked(device_lock& dlk,
                                               detail::unique_lock<stream_lock>* slk,
                                               std::size_t size, std::size_t rounded,
                                               stream_handle stream, const stream_state* held,
                                               const std::string& note) STREAMSAFE_REQUIRES(mu_);
  [[noreturn]] void throw_invalid_pointer_locked(const void* ptr, const char* what) const
      STREAMSAFE_REQUIRES(mu_);
  // True when this thread's last allocation was from this allocator (t_cache.last_used).
  bool thread_allocated_here() const noexcept;
  void deallocate_impl(void* ptr, const stream_handle* stream);

  // ---- invariants.cpp (mu_ and every stream lock held) -------------------------------------
  // What the walk of the segments found, against what the other structures hold.
  struct census {
    std::int64_t reserved_bytes = 0, allocated_bytes = 0, active_bytes = 0;  // from the blocks
    std::int64_t stat_allocated_bytes = 0, stat_active_bytes = 0;            // from the statistics
    std::size_t free_blocks = 0, active_blocks = 0, pending_blocks = 0, quick_cached_blocks = 0,
                held_blocks = 0;
    std::size_t free_list_blocks = 0, quick_cache_blocks = 0, pending_list_blocks = 0,
                active_map_blocks = 0;
  };
  void check_block_locked(const block* b, census& c) const
      STREAMSAFE_REQUIRES(mu_);  // its state against where it is
  void check_segment_locked(std::uintptr_t key, const segment* seg, census& c) const
      STREAMSAFE_REQUIRES(mu_);  // tiling, mapping
  void check_pool_locked(const pool& p, census& c) const
      STREAMSAFE_REQUIRES(mu_);  // free lists, unmapped set, quick cache
  void check_stream_locked(const stream_state& st, census& c) const
      STREAMSAFE_REQUIRES(mu_, st.mu);  // pools, active map, counters
  void check_releasing_segments_locked(census& c) const STREAMSAFE_REQUIRES(mu_);
  void check_held_frees_locked(const census& c) const STREAMSAFE_REQUIRES(mu_);
  void check_census_locked(const census& c) const
      STREAMSAFE_REQUIRES(mu_);  // the counts and statistics agree
  void check_dead_streams_locked() const
      STREAMSAFE_REQUIRES(mu_);  // destroyed and retired stream states

  // ---- capture.cpp -------------------------------------------------------------------------
  bool capturing() const noexcept {
    return captures_underway_.load(std::memory_order_acquire) != 0;
  }
  const capture_record* capture_of_locked(stream_handle stream) const
      STREAMSAFE_REQUIRES(mu_);                                                    // mu_ held
  stream_state* graph_state_locked(std::uint64_t graph) STREAMSAFE_REQUIRES(mu_);  // mu_ held
  // share_pool_of: 0, or a graph whose private pool the capture allocates into (shared pools).
  std::uint64_t begin_capture_locked(stream_handle stream, bool detected,
                                     std::uint64_t share_pool_of = 0) STREAMSAFE_REQUIRES(mu_);
  // Before a capture begins: the free memory of released graphs' pools goes back behind its fence.
  void release_released_pools_locked(device_lock& lk, stream_handle stream)
      STREAMSAFE_REQUIRES(mu_);
  // Fork (fork.cpp): true in a child forked after this allocator was made (it inherited it).
  bool inherited() const noexcept;
  static std::uint64_t current_fork_generation();  // registers the fork handler once
  [[noreturn]] void throw_inherited(const char* what) const;
  std::uint64_t end_capture_locked(device_lock& lk, stream_handle stream) STREAMSAFE_REQUIRES(mu_);
  void detect_captures_locked(device_lock& lk)
      STREAMSAFE_REQUIRES(mu_);  // asks the backend about each known stream
  void after_captures_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);  // the last capture ended
  void release_graph_locked(std::uint64_t graph) STREAMSAFE_REQUIRES(mu_);
  std::exception_ptr complete_held_frees_locked(std::uint64_t graph,
                                                const std::vector<stream_handle>& uses)
      STREAMSAFE_REQUIRES(mu_);
  // A free while a capture is underway; true when it was handled (held or done).
  bool free_during_capture_locked(stream_state& owner, block* b, const stream_handle* stream)
      STREAMSAFE_REQUIRES(mu_, owner.mu);
  void* allocate_during_capture_locked(device_lock& dlk, std::size_t size, std::size_t rounded,
                                       bool small, stream_handle stream) STREAMSAFE_REQUIRES(mu_);
  std::string capture_note_locked() const STREAMSAFE_REQUIRES(mu_);  // for out-of-memory messages

  // ---- ipc.cpp (interprocess export and import, core/ipc.hpp) --------------------------------
  detail::ipc_registry ipc_ STREAMSAFE_GUARDED_BY(mu_);
  // A producer free of an exported block (b->ipc_exports != 0): held, b stays active and
  // allocated, until its last export ends (owner's lock held).
  void hold_exported_free_locked(stream_state& owner, block* b, const stream_handle* stream)
      STREAMSAFE_REQUIRES(mu_, owner.mu);
  // Polls (never waits on) the released exports' and closing imports' events; ends the exports
  // whose consumer event completed and completes the held frees whose last export ended; closes
  // consumer mappings whose event completed. Nothing while a capture is underway.
  void poll_ipc_locked() STREAMSAFE_REQUIRES(mu_);
  // empty_cache wait mode: waits (mu_ dropped) on the consumer events of released exports of
  // held blocks, then polls.
  void wait_ipc_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);
  void end_export_locked(std::map<std::uint64_t, detail::ipc_export_record>::iterator it)
      STREAMSAFE_REQUIRES(mu_);
  void destroy_ipc_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);  // destruction.cpp
  void check_ipc_locked() const STREAMSAFE_REQUIRES(mu_);             // invariants.cpp

  // ==== growth policy and reclaim (growth_policy.cpp, reclaim.cpp) ===========================
  // mu_ and the lock of p's stream held unless said otherwise.
  // The one entry point of the growth policy: after the fast path found nothing, every way to
  // serve `rounded` bytes from p in its order (growth_policy.cpp); nullptr: out of memory.
  // Drops and retakes slk (st's lock) around releases and waits.
  block* expand_pool_locked(device_lock& dlk, detail::unique_lock<stream_lock>& slk,
                            stream_state& st, pool& p, std::size_t rounded)
      STREAMSAFE_REQUIRES(mu_, st.mu);
  // True when p can grow for `rounded` bytes without raising peak reserved (within the limit).
  bool growth_within_peak_locked(const pool& p, std::size_t rounded) const STREAMSAFE_REQUIRES(mu_);
  // The fast path's hint of that headroom (any pool): updated under mu_ where reserved changes.
  std::atomic<std::size_t> headroom_hint_{0};
  void note_headroom_locked() STREAMSAFE_REQUIRES(mu_);
  // Defer mode, last resort of the out-of-memory path: a host wait (mu_ dropped), bounded, on
  // every queued release fence; true when they all completed.
  bool wait_queued_fences_locked(device_lock& dlk) STREAMSAFE_REQUIRES(mu_);
  // Free chunks of every expandable pool but `keep`, up to `bytes`, smallest first, detached,
  // fenced and queued (so that reclaim_by_alias_locked can take them); returns the bytes.
  std::size_t queue_idle_chunks_locked(const block* keep, bool large_only, std::size_t bytes)
      STREAMSAFE_REQUIRES(mu_);
  // reclaim.cpp: reclaim = taking queued memory back (no host wait, no new memory).
  void wait_on_fence_locked(stream_handle stream, const release_batch& batch)
      STREAMSAFE_REQUIRES(mu_);
  void take_from_batch_locked(std::deque<release_batch>::iterator batch, block* b)
      STREAMSAFE_REQUIRES(mu_);
  // The smallest queued block of p that serves the request, back to p's free lists
  // (whole_rule: not a segment the whole-segment rule keeps whole for the request).
  block* reclaim_in_place_locked(pool& p, std::size_t rounded, bool whole_rule = true)
      STREAMSAFE_REQUIRES(mu_);
  // cuda_malloc: the smallest queued whole segment of another pool that serves the request
  // (whole_rule: not one the whole-segment rule keeps whole), moved to p behind its fence.
  block* reclaim_segment_locked(pool& p, std::size_t rounded, bool whole_rule)
      STREAMSAFE_REQUIRES(mu_);
  // expandable: queued chunks of any pool mapped again into p's range behind their fences.
  block* reclaim_by_alias_locked(pool& p, std::size_t rounded) STREAMSAFE_REQUIRES(mu_);
  // The old addresses of reclaimed memory, still mapped until their queued unmap ("ghosts"):
  // new address range start -> (bytes, the queued aliased block at the old address).
  std::map<std::uintptr_t, std::pair<std::size_t, block*>> ghosts_ STREAMSAFE_GUARDED_BY(mu_);
  // [addr, addr + bytes) of a new address goes back to the driver: the bytes of it still mapped
  // at a ghost become that ghost's to give back (ghost_owned); returns them.
  std::size_t unghost_locked(std::uintptr_t addr, std::size_t bytes) STREAMSAFE_REQUIRES(mu_);
  // The ghost b's unmap: forgets its entries; returns its ghost_owned bytes.
  std::size_t drop_ghost_locked(block* b) STREAMSAFE_REQUIRES(mu_);
  // ==== end of growth policy and reclaim ======================================================

  // ---- release.cpp -------------------------------------------------------------------------
  // mu_ and the segment owner's stream lock held.
  std::vector<stream_handle> fence_streams_locked(const segment* seg) const
      STREAMSAFE_REQUIRES(mu_);
  void add_fence_streams_locked(release_batch& batch, const segment* seg) const
      STREAMSAFE_REQUIRES(mu_);
  void detach_whole_segment_locked(release_batch& batch, segment* seg)
      STREAMSAFE_REQUIRES(mu_);  // a free cuda_malloc segment
  // Forgets seg's chunks inside [addr, addr + bytes) after their unmap; returns how many.
  static std::size_t forget_chunks(segment* seg, std::uintptr_t addr, std::size_t bytes);
  // True when [addr, addr + bytes) is a union of whole mapped chunks of seg.
  static bool whole_chunk_run(const segment* seg, std::uintptr_t addr, std::size_t bytes);
  // The chunks wholly inside mapped block b of expandable seg: [lo, hi); false if none.
  static bool whole_chunks_of(const segment* seg, const block* b, std::uintptr_t& lo,
                              std::uintptr_t& hi);
  // The whole chunks of seg's free mapped blocks but `keep`, detached into batch; true if any.
  bool detach_free_chunks_locked(release_batch& batch, segment* seg, const block* keep)
      STREAMSAFE_REQUIRES(mu_);
  // Free memory that can go back: everything, only released graphs' pools, or only one tag's.
  release_batch collect_releasable_locked(bool released_graphs_only = false,
                                          const tag_id* only_tag = nullptr)
      STREAMSAFE_REQUIRES(mu_);
  void record_fence_locked(release_batch& batch) STREAMSAFE_REQUIRES(mu_);
  bool fence_done_locked(const release_batch& batch) STREAMSAFE_REQUIRES(mu_);
  // Moves out of `batch` the blocks whose fence streams are idle now (polled, never waited on),
  // and whose release would not block (free_segment_would_block_locked).
  release_batch take_safe_locked(release_batch& batch) STREAMSAFE_REQUIRES(mu_);
  // True when free_segment waits for the whole device (cudaFree) and some known stream is busy
  // now (query_stream on each live stream, and the tombstones); never blocks.
  bool free_segment_would_block_locked() STREAMSAFE_REQUIRES(mu_);
  void wait_fence_unlocked(release_batch& batch);
  void restore_batch_locked(release_batch& batch) STREAMSAFE_REQUIRES(mu_);
  void requeue_aliased_locked(block* b) STREAMSAFE_REQUIRES(mu_);  // reclaim.cpp's aliased blocks
  std::size_t release_batch_memory(device_lock& lk, release_batch& batch) STREAMSAFE_REQUIRES(mu_);
  std::size_t finish_deferred(device_lock& lk, bool wait) STREAMSAFE_REQUIRES(mu_);
  // The queued blocks of every batch whose fence streams are idle now go back; never waits.
  std::size_t release_completed_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);
  // Those blocks, moved out of the queue into one batch (with the events of emptied batches).
  release_batch take_completed_locked() STREAMSAFE_REQUIRES(mu_);
  std::size_t release_cached(device_lock& lk, empty_cache_mode mode) STREAMSAFE_REQUIRES(mu_);
  // The opportunistic release (max_cached_bytes, garbage_collection_threshold, an empty_cache
  // asked for from a stream callback): releases what is safe now, never waits, queues nothing.
  std::size_t trim_cached(device_lock& lk) STREAMSAFE_REQUIRES(mu_);
  // Before a release: unfenced_'s events recorded, completed pending frees retired, quick caches
  // flushed.
  void prepare_release_locked() STREAMSAFE_REQUIRES(mu_);
  // Fences `batch` and releases the blocks whose fence streams are idle now; the rest goes back
  // to the pools (nothing queued, nothing waited on).
  std::size_t release_safe_now(device_lock& lk, release_batch& batch) STREAMSAFE_REQUIRES(mu_);
  void queue_batch_locked(release_batch& batch)
      STREAMSAFE_REQUIRES(mu_);  // to the deferred queue (fence recorded)
  // Fences and releases a collected batch (queued in defer mode when its fence is pending).
  std::size_t release_collected(device_lock& lk, release_batch& batch, empty_cache_mode mode)
      STREAMSAFE_REQUIRES(mu_);
  // mu_ held, st's lock not: gives back st's whole free large segments that the whole-segment
  // rule refuses to a request of `rounded` bytes (before a growth that would raise the peak).
  std::size_t release_refused_segments(device_lock& lk, stream_state& st, std::size_t rounded)
      STREAMSAFE_REQUIRES(mu_);
  // Before a cuda_malloc growth (K12): once st's idle fence has completed, the whole free
  // segments it labelled are proven idle; the whole free segments not labelled yet get a new
  // fence (one event per fence stream, polled at a later growth, never waited on). A segment
  // refused at a later growth past the peak then goes back without a fence recorded behind the
  // stream's newest work. Opportunistic: a failed backend call leaves the labels as they were.
  void prove_idle_segments_locked(stream_state& st, pool& p) STREAMSAFE_REQUIRES(mu_, st.mu);
  void drop_idle_fence_locked(stream_state& st)
      STREAMSAFE_REQUIRES(mu_);  // its events back to the pool
  std::uint32_t next_idle_fence_id_ STREAMSAFE_GUARDED_BY(mu_) = 2;
  // After the driver call for b (released or not): its bookkeeping, under b's owner lock.
  std::size_t account_release_locked(block* b, bool released) STREAMSAFE_REQUIRES(mu_);
  void retire_all_pending_locked(device_lock& lk)
      STREAMSAFE_REQUIRES(mu_);  // waits with mu_ dropped
  void destroy_events_locked() STREAMSAFE_REQUIRES(mu_);

  // ---- tags.cpp, sleep.cpp -----------------------------------------------------------------
  std::unordered_map<tag_id, std::unique_ptr<tag_state>> tags_ STREAMSAFE_GUARDED_BY(mu_);
  std::size_t pauses_pending_ STREAMSAFE_GUARDED_BY(mu_) = 0;   // tags in phase pausing
  std::size_t resumes_pending_ STREAMSAFE_GUARDED_BY(mu_) = 0;  // tags in phase resuming
  sleep_hook hook_ STREAMSAFE_GUARDED_BY(mu_);
  stream_handle copy_stream_ STREAMSAFE_GUARDED_BY(mu_) = 0;
  bool has_copy_stream_ STREAMSAFE_GUARDED_BY(mu_) = false;
  std::unique_ptr<caching_allocator> host_ STREAMSAFE_GUARDED_BY(mu_);  // offload's pinned memory
  // The tagged pool of st for `tag` (fast path: nullptr when missing or refused; st's lock held).
  static pool* tagged_pool(stream_state& st, bool small, tag_id tag) STREAMSAFE_REQUIRES(st.mu) {
    for (auto& tp : st.tagged) {
      if (tp->tag != tag) continue;
      if (tp->refused->load(std::memory_order_acquire)) return nullptr;
      return small ? &tp->small_pool : &tp->large_pool;
    }
    return nullptr;
  }
  // Every pool of st, untagged first (st's lock held).
  template <class F>
  static void for_each_pool(stream_state& st, F&& f) {
    f(st.small_pool);
    f(st.large_pool);
    for (auto& tp : st.tagged) {
      f(tp->small_pool);
      f(tp->large_pool);
    }
  }
  template <class F>
  static void for_each_pool(const stream_state& st, F&& f) {
    f(st.small_pool);
    f(st.large_pool);
    for (const auto& tp : st.tagged) {
      f(static_cast<const pool&>(tp->small_pool));
      f(static_cast<const pool&>(tp->large_pool));
    }
  }
  tag_state& tag_state_locked(tag_id tag) STREAMSAFE_REQUIRES(mu_);  // created on first use
  // The pool of st for (small, tag), created if missing; throws tag_paused while refused.
  pool& pool_for_locked(stream_state& st, bool small, tag_id tag, std::size_t size)
      STREAMSAFE_REQUIRES(mu_, st.mu);
  // Offload: host memory for t's segments still to copy (host_, mu_ dropped), then their copies
  // on copy_stream_ behind their fences.
  void enqueue_offload_locked(device_lock& lk, tag_state& t) STREAMSAFE_REQUIRES(mu_);
  bool pause_ready_locked(const paused_segment& ps) STREAMSAFE_REQUIRES(mu_);  // polls only
  // Unmaps (hooks first, mu_ dropped) the segments of t that are ready; wait: waits for them.
  std::size_t advance_pause_locked(device_lock& lk, tag_state& t, bool wait)
      STREAMSAFE_REQUIRES(mu_);
  // Waits (mu_ dropped) for the fences or copies of t's segments still mapped; returns them.
  std::vector<paused_segment*> wait_pause_locked(device_lock& lk, tag_state& t)
      STREAMSAFE_REQUIRES(mu_);
  // The hooks, then the unmaps of `ready` (mu_ dropped), then their bookkeeping.
  std::size_t unmap_paused_locked(device_lock& lk, tag_state& t,
                                  const std::vector<paused_segment*>& ready)
      STREAMSAFE_REQUIRES(mu_);
  void release_pause_events_locked(paused_segment& ps) STREAMSAFE_REQUIRES(mu_);
  // Runs f with mu_ dropped and t.busy counted (resume and pause of t wait for it); rethrows.
  template <class F>
  void unlocked_for_tag(device_lock& lk, tag_state& t, F&& f) STREAMSAFE_REQUIRES(mu_) {
    std::exception_ptr failed;
    ++t.busy;
    {
      driver_call_scope in_flight(*this, lk);
      try {
        f();
      } catch (...) {
        failed = std::current_exception();
      }
    }
    --t.busy;
    driver_calls_done_.notify_all();
    if (failed) std::rethrow_exception(failed);
  }
  // pause: the tag's segments marked paused, their runs and fence streams; the fences recorded.
  std::vector<paused_segment> collect_pause_locked(tag_id tag, pause_mode mode,
                                                   const std::string& where)
      STREAMSAFE_REQUIRES(mu_);
  void record_pause_fences_locked(std::vector<paused_segment>& segs) STREAMSAFE_REQUIRES(mu_);
  // resume: maps ps's given-back runs and restores its copies; false (nothing changed) when
  // the memory is not there.
  struct resume_work {
    stream_handle copy_stream = 0;
    std::vector<sleep_hook_event> hooks;
    std::vector<stream_handle> owners;
    bool restored = false;
  };
  bool resume_segment_locked(tag_state& t, paused_segment& ps, resume_work& w)
      STREAMSAFE_REQUIRES(mu_);
  void order_after_restore_locked(resume_work& w, const stream_handle* also)
      STREAMSAFE_REQUIRES(mu_);
  void set_phase_after_resume_locked(tag_state& t, std::vector<paused_segment> kept)
      STREAMSAFE_REQUIRES(mu_);
  // The resume of t on this thread (also of one handed to the worker); throws out_of_memory.
  void resume_tag_locked(device_lock& lk, tag_state& t, const stream_handle* also,
                         const std::string& where) STREAMSAFE_REQUIRES(mu_);
  std::size_t advance_resumes_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);  // the worker
  std::size_t advance_pauses_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);   // every tag
  void cancel_paused_segment_locked(tag_state& t, paused_segment& ps) STREAMSAFE_REQUIRES(mu_);
  pause_status tag_status_locked(const tag_state& t) STREAMSAFE_REQUIRES(mu_);
  // The status of a tag this allocator holds nothing of: active, no bytes.
  static pause_status unknown_tag_status(std::string_view tag) {
    pause_status s;
    s.tag = std::string(tag);
    return s;
  }
  void wait_tag_idle_locked(device_lock& lk, const tag_state& t) STREAMSAFE_REQUIRES(mu_);
  void call_hooks_unlocked(const std::vector<sleep_hook_event>& events, const sleep_hook& hook);
  stream_handle copy_stream_locked() STREAMSAFE_REQUIRES(mu_);
  caching_allocator& host_allocator_locked() STREAMSAFE_REQUIRES(mu_);
  void destroy_sleep_state_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);  // destruction
  // Starts the release worker if it is not running; false when it cannot run.
  bool ensure_worker_locked() STREAMSAFE_REQUIRES(mu_);

  // ---- release_worker.cpp ------------------------------------------------------------------
  // The release worker (options::release_worker on): one thread per allocator, started by the
  // first release handed to it and stopped and joined first thing in destroy_all. It polls the
  // deferred queue's fences (query, never a wait; nothing while a capture is underway) and
  // releases the parts whose fence streams are idle with mu_ dropped around the driver calls
  // (release_batch_memory). A forked child has no worker: worker_usable_locked() is false there
  // and the parent's thread object is neither joined nor destroyed.
  static std::int64_t current_pid() noexcept;
  const std::int64_t creator_pid_ = current_pid();
  std::unique_ptr<std::thread> worker_ STREAMSAFE_GUARDED_BY(mu_);
  std::int64_t worker_pid_ STREAMSAFE_GUARDED_BY(mu_) = 0;
  bool worker_stop_ STREAMSAFE_GUARDED_BY(mu_) = false;
  bool worker_kick_ STREAMSAFE_GUARDED_BY(mu_) =
      false;  // a pass is wanted now (new work, a waiter)
  bool worker_failed_ STREAMSAFE_GUARDED_BY(mu_) =
      false;  // could not start: releases stay synchronous
  std::uint64_t worker_passes_begun_ STREAMSAFE_GUARDED_BY(mu_) = 0;
  std::uint64_t worker_passes_done_ STREAMSAFE_GUARDED_BY(mu_) = 0;
  // On the heap: a forked child must not destroy them (the parent's worker may have been
  // waiting on one at the fork, and destroying a condition variable waits for its waiters).
  std::unique_ptr<std::condition_variable_any> worker_wake_ =
      std::make_unique<std::condition_variable_any>();
  std::unique_ptr<std::condition_variable_any> worker_settled_ =
      std::make_unique<std::condition_variable_any>();  // callers waiting for a pass
  // The option is on, the thread could start, and this is the process that made the allocator.
  bool worker_usable_locked() const STREAMSAFE_REQUIRES(mu_);
  bool worker_releases_locked(empty_cache_mode mode) const STREAMSAFE_REQUIRES(mu_) {
    return mode == empty_cache_mode::defer && worker_usable_locked();
  }
  // Fences the whole batch and queues it for the worker; nothing is released on this thread.
  void hand_to_worker_locked(release_batch& batch) STREAMSAFE_REQUIRES(mu_);
  // One pass: every queued block whose own fence streams are idle now goes back (one batch).
  std::size_t worker_pass_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);
  void worker_main() STREAMSAFE_EXCLUDES(mu_);
  // Wakes the worker and waits (mu_ dropped meanwhile) until a pass begun after the call has
  // ended; deadline null: no limit. True at once without a worker; false on timeout.
  bool wait_for_worker_locked(device_lock& lk,
                              const std::chrono::steady_clock::time_point* deadline)
      STREAMSAFE_REQUIRES(mu_);
  void stop_worker() STREAMSAFE_EXCLUDES(mu_);
  // pthread_atfork handlers: the forking thread takes (try_lock, bounded) the device lock of
  // every allocator with a running worker, so that no worker holds it in the child.
  static void fork_prepare() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS;
  static void fork_parent() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS;
  static void fork_child() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS;
  static void at_exit()
      STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS;  // stops every worker, bounded, no join
  // The allocator is being destroyed (no other thread may use it): no lock.
  void delete_host_bookkeeping() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS;
  void destroy_all() STREAMSAFE_EXCLUDES(mu_);
};

// Short names for the core's source files, the only ones that include this header.
using detail::block;
using detail::block_state;
using detail::pool;
using detail::segment;
using detail::stream_lock;
using device_lock = detail::unique_lock<detail::mutex>;

}  // namespace streamsafe
