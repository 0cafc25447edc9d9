// streamsafe core: the growth policy, in one place (as RMM keeps its pool's expand_pool).
//
// expand_pool_locked is its one entry point, called by allocate_slow once the fast path found
// nothing (no cached block of the pool fits). Every decision of when to grow, when to take back
// cached or queued memory, when a block may be split, and what goes back to the driver before a
// growth is made here; the mechanisms live elsewhere: growth.cpp (segments, ranges, chunks, the
// move of a whole segment), reclaim.cpp (taking queued memory back), release.cpp (fences,
// batches, driver calls), events.cpp (pending blocks). Where the two backend kinds differ, the
// step asks the growth hook (growth_hook.hpp), one per allocator, chosen at construction:
// cuda_malloc_growth.cpp or expandable_growth.cpp; its calls are named below in brackets. The
// order, the same for both kinds, for `rounded` bytes of pool p on stream s:
//   1. Queued memory first. Memory queued for release (empty_cache in defer mode, a pause, step
//      5 below) is still mapped and counted as reserved: the pool's own queued blocks go back
//      to it in place; another pool's are reclaimed by a wait of s on their release fence (a
//      whole cudaMalloc segment moves to p; expandable chunks are mapped again into p's range,
//      no new memory) [reclaim_queued_locked]. Never a host wait.
//   2. Free headroom: a growth that does not raise peak reserved (memory given back earlier)
//      and stays within the limit goes first, rather than a block still pending another
//      stream's work, whose reuse would order s behind that work [growth_bytes_locked,
//      grow_locked].
//   3. A pending block of p, behind a stream wait on its events (K9).
//   4. (release worker off) queued releases whose fences completed go back (never waiting).
//   5. A growth. One that would raise peak reserved first makes room from idle memory, never
//      waiting on the host: cuda_malloc gives back the whole free segments that the
//      whole-segment rule refuses to the request (proven idle ones at once, the rest behind a
//      fence, queued); expandable queues the idle chunks of every pool (large pools only for a
//      small request) up to the growth's excess and reclaims them by alias, as in step 1
//      [prepare_growth_locked, makes_room_first_locked, grow_after_room_locked]. A cudaMalloc
//      growth past the peak takes another stream's whole free segment that fits and that the
//      rule would not keep whole, before a new one [grow_locked]. No growth passes the limit.
//   6. At the limit: a whole free segment of another stream (the rule kept), or (expandable)
//      the free chunks of every pool, queued and reclaimed by alias [take_from_other_pools_locked].
//   7. The serve path's walk, again until it serves or nothing is left to wait for: each walk
//      takes, without a host wait, p's free and pending memory and a growth within the limit;
//      other streams' free memory (step 6); every stream's pending memory, retired behind a wait
//      of its owner stream on its events, and the frees of exported blocks that the consumers
//      released, behind a wait on their release events; the idle cache of every pool, given back to
//      make room (what is busy is queued behind its fence, in either empty_cache mode). Between
//      walks, the waits in the order of their cost: the release worker's pass, the driver calls
//      giving memory back (the ledger's "being released"), then once a host wait on the queued
//      fences (defer: bounded by k_oom_fence_wait_us, a stream held by a collective that waits for
//      this thread ends the wait, never the process: K8; wait: exactly the fences, as empty_cache()
//      waits). Then, with no wait left, queued memory [reclaim_queued_last_resort_locked] and
//      another stream's whole free segment against the whole-segment rule; then nullptr: the
//      caller throws out_of_memory.
//      resume() and a graph pool's growth make room with the same steps (make_room_locked);
//      these steps are serve_path.cpp's.
// Before any growth, memory being released by a driver call is waited for (a driver call,
// never a fence): the peak never counts it beside memory that took its place on the device.
// Steps 1-6 never wait on GPU work; step 1 may wait for the release worker's driver calls in
// flight when mapping anew beside them would raise the peak. Locks: mu_ and s's lock held on entry
// and on return; s's lock is dropped around the steps that take other streams' locks, release or
// wait.
#include "core/allocator_impl.hpp"
#include "core/blocks/segment_fit.hpp"
#include "core/blocks/size_classes.hpp"
#include "core/common/format.hpp"
#include "core/common/logging.hpp"
#include "core/growth/growth_hook.hpp"
#include "core/streams/stream_lock_drop.hpp"

#include <algorithm>
#include <chrono>

namespace streamsafe {

namespace {
struct pending_event_copy {
  event_handle event;
};

}  // namespace

// ---- headroom ---------------------------------------------------------------------------------

// True when p can grow for `rounded` bytes without raising peak reserved, within the limit.
bool caching_allocator::impl::growth_within_peak_locked(const pool& p, std::size_t rounded) const {
  return growth_room_locked().within_peak(growth_hook_->growth_bytes_locked(*this, p, rounded));
}

// headroom_hint_ after reserved bytes changed: the fast path reads it without mu_.
void caching_allocator::impl::note_headroom_locked() {
  headroom_hint_.store(growth_room_locked().headroom(), std::memory_order_relaxed);
}

// ---- growth -----------------------------------------------------------------------------------

block* caching_allocator::impl::grow_locked(pool& p, std::size_t rounded) {
  block* b = growth_hook_->grow_locked(*this, p, rounded);
  note_headroom_locked();
  return b;
}

bool caching_allocator::impl::wants_collection_locked(std::size_t rounded) const {
  const double gc = runtime_.garbage_collection_threshold.load(std::memory_order_relaxed);
  if (gc <= 0 && opts_.max_cached_bytes == 0) return false;
  const auto reserved = static_cast<std::size_t>(stats_.reserved_bytes.current);
  if (gc > 0 && static_cast<double>(reserved + detail::segment_bytes_for(rounded)) >
                    gc * static_cast<double>(limits_.limit_bytes)) {
    return true;
  }
  if (opts_.max_cached_bytes != 0) {
    std::int64_t allocated = 0;
    for (auto& [s, state] : streams_.states) allocated += state->mirror.allocated_total();
    const auto cached = static_cast<std::int64_t>(reserved) - allocated;
    if (cached > static_cast<std::int64_t>(opts_.max_cached_bytes)) return true;
  }
  return false;
}

// ---- idle memory before a growth --------------------------------------------------------------

// mu_ held, no stream lock: free chunks of every expandable pool but `keep`, up to `bytes`,
// smallest first, detached, fenced and queued; returns the bytes.
std::size_t caching_allocator::impl::queue_idle_chunks_locked(const block* keep, bool large_only,
                                                              std::size_t bytes) {
  if (capturing() || bytes == 0 || opts_.release_fence == fence_scope::device) return 0;
  // A small-pool growth (2 MiB chunks) takes only large pools' free chunks, as they are: walking
  // and flushing the small pools for 2 MiB made random_allocations (10,000 live small blocks)
  // several times slower.
  if (!large_only) prepare_release_locked();
  // Every whole free chunk run is detached; the smallest are kept, chunk by chunk, up to
  // `bytes` (the least likely to serve a later request, and no more than the growth needs), and
  // the rest is merged back into its pool.
  release_batch all;
  for (auto& [base, seg] : streams_.segments) {
    stream_state& owner = state_of(*seg->owner);
    if (!seg->expandable || seg->paused || (large_only && seg->small) ||
        (owner.graph != 0 && !owner.graph_released))
      continue;  // sleep.cpp owns a paused segment's mapping
    detail::lock_guard<stream_lock> slk(owner.mu);
    detach_free_chunks_locked(all, seg, keep);
  }
  std::stable_sort(all.blocks.begin(), all.blocks.end(),
                   [](const block* a, const block* b) { return a->size < b->size; });
  release_batch chosen;
  release_batch rest;
  for (block* b : all.blocks) {
    if (chosen.bytes >= bytes) {
      rest.blocks.push_back(b);
      continue;
    }
    // Of the last run taken, only the chunks that cover what is lacking.
    const std::size_t lacking = bytes - chosen.bytes;
    if (b->size > lacking) {
      detail::lock_guard<stream_lock> slk(state_of(*b->seg->owner).mu);  // guards seg->chunks
      if (block* after = cut_chunks_locked(b, lacking)) rest.blocks.push_back(after);
    }
    chosen.blocks.push_back(b);
    chosen.bytes += b->size;
    add_fence_streams_locked(chosen, b->seg);
  }
  restore_batch_locked(rest);
  if (chosen.blocks.empty()) return 0;
  try {
    record_fence_locked(chosen);  // waited on by the device only (reclaim.cpp), never the host
  } catch (const std::exception& e) {
    restore_batch_locked(chosen);
    detail::log().debug("device {}: fencing idle chunks before a growth failed: {}",
                        backend_.device(), e.what());
    return 0;
  }
  const std::size_t queued = chosen.bytes;
  detail::log().debug("device {}: {} bytes of idle chunks queued to be reclaimed by a growth",
                      backend_.device(), queued);
  queue_batch_locked(chosen);
  if (worker_usable_locked() && ensure_worker_locked()) {
    worker_.kick_now();
  }
  return queued;
}

// mu_ held, st's lock not: gives back st's whole free large segments that the whole-segment
// rule refuses to a request of `rounded` bytes (before a growth that would raise the peak).
std::size_t caching_allocator::impl::release_refused_segments(device_lock& lk, stream_state& st,
                                                              std::size_t rounded) {
  release_batch batch;   // behind a fence recorded now
  release_batch proven;  // proven idle (prove_idle_segments_locked): no fence needed
  {
    detail::lock_guard<stream_lock> slk(st.mu);
    pool& p = st.large_pool;
    flush_quick_locked(p);
    // Proofs come from allocate_slow's prove_idle_segments_locked, one growth earlier.
    // cudaFree waits for the whole device: proven or not, only while every stream is idle. The
    // release worker, when on, makes every release (release_collected hands it over).
    const bool direct = !worker_releases_locked(empty_cache_mode::defer) &&
                        !free_segment_would_block_locked();
    std::vector<segment*> refused;
    p.mapped.for_each([&](block* b) {
      if (idle_at_growth(b, rounded)) refused.push_back(b->seg);
    });
    for (segment* seg : refused) {
      const bool is_proven = direct && seg->first->idle_fence == detail::k_idle_proven;
      detach_whole_segment_locked(is_proven ? proven : batch, seg);
    }
  }
  if (batch.blocks.empty() && proven.blocks.empty()) return 0;
  detail::log().debug(
      "device {}: releasing {} bytes of whole free segments refused to a {}-byte request before "
      "growing ({} bytes proven idle)",
      backend_.device(), batch.bytes + proven.bytes, rounded, proven.bytes);
  std::size_t released = 0;
  if (!proven.blocks.empty()) released += release_batch_memory(lk, proven);
  // Opportunistic: never waits, in either mode; what is busy is queued behind its fence.
  if (!batch.blocks.empty()) released += release_collected(lk, batch, empty_cache_mode::defer);
  return released;
}

// ---- the out-of-memory path's last wait -------------------------------------------------------

// Defer mode, last resort of the out-of-memory path: a host wait (mu_ dropped), bounded, on
// every queued release fence; true when they all completed.
bool caching_allocator::impl::wait_queued_fences_locked(device_lock& dlk) {
  if (releases_.deferred.empty() || capturing() || opts_.release_fence == fence_scope::device)
    return false;
  // A copy of the events to wait on without mu_ (their batches stay queued; a batch finished
  // meanwhile only makes the wait shorter), and the tombstones pinned meanwhile.
  std::vector<pending_event_copy> waits;
  for (const release_batch& batch : releases_.deferred) {
    if (batch.device_sync) return false;
    for (const auto& e : batch.fence) waits.push_back({e.event});
  }
  for (const auto& t : streams_.tombstones) waits.push_back({t.event});
  const std::size_t queued = releases_.deferred_bytes;
  std::vector<event_handle> events;
  events.reserve(waits.size());
  for (const auto& w : waits) events.push_back(w.event);
  const bool done = wait_events_bounded_locked(dlk, events, detail::k_oom_fence_wait_us);
  detail::log().debug("device {}: out of memory: {} on the release fences of {} queued bytes",
                      backend_.device(), done ? "waited" : "gave up waiting", queued);
  return done;
}

// ---- a retry of the search (the pool may have changed while its lock was dropped) ----------

block* caching_allocator::impl::find_block_locked(stream_state& st, pool& p, std::size_t rounded,
                                                  bool grow) {
  if (!st.pending.empty()) process_events_locked(st);
  if (block* b = take_cached_fit_locked(p, rounded)) return b;
  // Free headroom under the peak goes before a block pending another stream's work
  // (growth_policy.cpp).
  const bool headroom = growth_within_peak_locked(p, rounded);
  if (headroom && grow) {
    if (block* b = grow_locked(p, rounded)) return b;
  }
  if (block* b = take_pending_locked(st, p, rounded)) return b;
  return grow && !headroom ? grow_locked(p, rounded) : nullptr;
}

// ---- the entry point --------------------------------------------------------------------------

// 1. Queued memory first: p's own in place, another pool's behind a wait on its fence. *stop:
// a capture began while it waited for the release worker (the caller allocates for it instead).
block* caching_allocator::impl::reclaim_queued_first_locked(device_lock& dlk,
                                                            detail::unique_lock<stream_lock>& slk,
                                                            stream_state& st, pool& p,
                                                            std::size_t rounded, bool* stop) {
  if (releases_.deferred.empty()) return nullptr;
  block* b = reclaim_in_place_locked(p, rounded);
  bool in_flight = false;  // the release worker is giving memory back right now
  if (!b) b = growth_hook_->reclaim_queued_locked(*this, p, rounded, &in_flight);
  if (in_flight) {  // that release ends (driver calls, never a fence wait), then once more
    {
      detail::stream_lock_dropped dropped(slk, st);
      wait_for_worker_locked(dlk, nullptr);
    }
    if (capturing()) {
      *stop = true;
      return nullptr;
    }
    b = growth_hook_->reclaim_queued_locked(*this, p, rounded, nullptr);
  }
  return b;
}

// 2-4. Free headroom under the peak, then a pending block of p behind a stream wait, then (no
// release worker) queued releases whose fences completed go back (never waiting).
block* caching_allocator::impl::grow_within_peak_or_pending_locked(
    device_lock& dlk, detail::unique_lock<stream_lock>& slk, stream_state& st, pool& p,
    std::size_t rounded) {
  block* b = nullptr;
  if (growth_within_peak_locked(p, rounded)) b = grow_locked(p, rounded);
  if (!b) b = take_pending_locked(st, p, rounded);
  // A refused segment queued at one growth would otherwise stay reserved through the next.
  if (!b && !releases_.deferred.empty() && !worker_releases_locked(opts_.empty_cache)) {
    {
      detail::stream_lock_dropped dropped(slk, st);
      finish_deferred(dlk, false);
    }
    b = find_block_locked(st, p, rounded, false);
  }
  return b;
}

// 5. A growth; past the peak, idle memory makes room first (never a host wait). Then (no
// release worker) queued releases whose fences completed go back and the search runs again.
block* caching_allocator::impl::grow_making_room_locked(device_lock& dlk,
                                                        detail::unique_lock<stream_lock>& slk,
                                                        stream_state& st, pool& p,
                                                        std::size_t rounded) {
  growth_hook_->prepare_growth_locked(*this, st, p);
  block* b = growth_hook_->makes_room_first_locked(*this, p, rounded)
                 ? growth_hook_->grow_after_room_locked(*this, dlk, slk, st, p, rounded)
                 : grow_locked(p, rounded);
  if (!b && !releases_.deferred.empty() && !worker_releases_locked(opts_.empty_cache)) {
    {
      detail::stream_lock_dropped dropped(slk, st);
      finish_deferred(dlk, false);
    }
    b = find_block_locked(st, p, rounded, true);
  }
  return b;
}

// 6. At the limit: another stream's whole free segment, or every pool's free chunks.
block* caching_allocator::impl::take_from_other_pools_locked(detail::unique_lock<stream_lock>& slk,
                                                             stream_state& st, pool& p,
                                                             std::size_t rounded) {
  return growth_hook_->take_from_other_pools_locked(*this, slk, st, p, rounded);
}

// Every way to serve `rounded` bytes from p once the fast path found nothing, in the order at
// the top of this file; nullptr: out of memory (or a capture began while it waited: the caller
// checks). mu_ and st's lock held on entry and return; slk is dropped around releases and waits.
block* caching_allocator::impl::expand_pool_locked(device_lock& dlk,
                                                   detail::unique_lock<stream_lock>& slk,
                                                   stream_state& st, pool& p, std::size_t rounded) {
  bool stop = false;
  block* b = reclaim_queued_first_locked(dlk, slk, st, p, rounded, &stop);
  if (stop) return nullptr;
  const bool own_limit = opts_.memory_limit_bytes != 0 || opts_.memory_fraction > 0;
  if (!b && ledger_.releasing_elsewhere_bytes() != 0 && !own_limit &&
      static_cast<std::size_t>(stats_.reserved_bytes.current) + rounded >
          static_cast<std::size_t>(stats_.reserved_bytes.peak)) {
    // Memory being released, and no limit of the allocator's own (a cap the backend enforces,
    // as the PyTorch extension's memory fraction): its driver calls end before a growth past
    // the peak, so that the peak never counts those bytes beside new memory that took their
    // place on the device (the ledger). Under the allocator's limit the growth counts them and
    // goes on beside them: no wait.
    {
      detail::stream_lock_dropped dropped(slk, st);
      driver_calls_.done.wait(dlk, [&]() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
        return ledger_.releasing_elsewhere_bytes() == 0;
      });
    }
    if (capturing()) return nullptr;
    b = find_block_locked(st, p, rounded, false);
  }
  if (!b) b = grow_within_peak_or_pending_locked(dlk, slk, st, p, rounded);
  if (!b) b = grow_making_room_locked(dlk, slk, st, p, rounded);
  if (!b) b = take_from_other_pools_locked(slk, st, p, rounded);
  return b ? b : out_of_memory_path_locked(dlk, slk, st, p, rounded);
}

}  // namespace streamsafe
