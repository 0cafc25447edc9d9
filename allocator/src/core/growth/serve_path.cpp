// streamsafe core: the serve path's last part (growth_policy.cpp's step 7 and the room a
// resume or a graph pool's growth makes): walks that take, without a host wait, every memory
// the ledger holds that could serve the request, and between them the waits, in the order of
// their cost, each followed by a new walk (memory may have moved meanwhile). Locks: mu_ held on
// entry and return; the stream lock of the request (when there is one) dropped around the
// steps that release or wait.
#include "core/allocator_impl.hpp"
#include "core/common/logging.hpp"
#include "core/growth/growth_hook.hpp"
#include "core/streams/stream_lock_drop.hpp"

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

namespace streamsafe {

// The analysis cannot follow the lock taken for every stream but `held` (whose lock the caller
// holds): each retire_pending_locked below runs under its stream's lock.
std::size_t caching_allocator::impl::retire_pending_behind_waits_locked(const stream_state* held)
    STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
  if (capturing()) return 0;  // a stream wait on an outside event breaks a capture
  std::size_t bytes = 0;
  std::vector<block*> blocks;
  for (auto& [s, other] : streams_.states) {
    if (other->graph != 0 && !other->graph_released) continue;  // a graph's private pool
    // held's lock is the caller's: its pending blocks of every pool (take_pending_locked took
    // only one of the request's pool) free whole segments for the steps that follow. The
    // pending list is read under its stream's lock only (a free on that stream writes it).
    std::unique_lock<stream_lock> olk(other->mu, std::defer_lock);
    if (other.get() != held) olk.lock();
    if (other->pending.empty()) continue;
    if (!other->alive.load(std::memory_order_acquire)) {
      // A destroyed stream can wait on nothing: its pending memory retires by its events alone,
      // those that completed now (after serve_wait_locked's wait on them, all of them).
      std::size_t before = 0;
      for (const block* b : other->pending) before += b->size;
      process_events_locked(*other);
      for (const block* b : other->pending) before -= b->size;
      bytes += before;  // retired
      continue;
    }
    blocks.clear();
    for (block* b : other->pending) {
      // A block with no events yet (releases_.unfenced) has nothing to wait on.
      if (b->mapped && !b->events.empty()) blocks.push_back(b);
    }
    for (block* b : blocks) {
      // The block's own stream waits on the device for the uses; its memory is then free in its
      // pool, ordered after them, for the steps that take other streams' free memory.
      pool& owner = *b->seg->owner;
      const auto* owner_state = static_cast<const stream_state*>(owner.state);
      if (owner_state != nullptr && !owner_state->alive.load(std::memory_order_acquire)) continue;
      for (auto& e : b->events) {
        stream_wait_on(owner.stream, e.event);
        ++other->stats.stream_waits;
      }
      bytes += b->size;
      retire_pending_locked(*other, b);
    }
  }
  if (bytes != 0) {
    detail::log().debug(
        "device {}: {} bytes pending other streams' work retired behind stream waits to serve a "
        "request",
        backend_.device(), bytes);
  }
  return bytes;
}

// Steps that need no host wait, in the serve path's order: p's free and pending memory and a
// growth within the limit; other streams' free memory (whole segments, or chunks by alias);
// pending memory (every stream's, every pool's) and exported blocks' frees held only by the
// consumers' release events, behind stream waits on those events; idle cache
// given back to make room (what is busy is queued behind its fence, never waited for).
block* caching_allocator::impl::serve_without_waiting_locked(device_lock& dlk,
                                                             detail::unique_lock<stream_lock>& slk,
                                                             stream_state& st, pool& p,
                                                             std::size_t rounded) {
  block* b = find_block_locked(st, p, rounded, true);
  if (!b) b = take_from_other_pools_locked(slk, st, p, rounded);
  if (!b &&
      retire_pending_behind_waits_locked(&st) + retire_ipc_held_behind_waits_locked(&st) != 0) {
    b = find_block_locked(st, p, rounded, true);
    if (!b) b = take_from_other_pools_locked(slk, st, p, rounded);
  }
  if (!b) {
    {
      detail::stream_lock_dropped dropped(slk, st);
      release_cached(dlk, empty_cache_mode::defer);
      if (sleep_.pauses_pending != 0) advance_pauses_locked(dlk);  // tags' fences done: unmapped
    }
    if (capturing()) return nullptr;  // the caller allocates for the capture instead
    b = find_block_locked(st, p, rounded, true);
  }
  return b;
}

// The serve path's waits, in the order of their cost, one per call (mu_ held, no stream lock;
// mu_ is released inside): a pass of the release worker over what is queued and its release in
// flight (driver calls, never a fence), at most twice; another thread's driver calls giving
// memory back; then once a host wait on the queued fences and the release of what they cover:
// bounded by k_oom_fence_wait_us in defer mode (a stream held by a collective that waits for
// this thread ends the wait, never the process: K8), on exactly the fences in wait mode (the
// mode's contract). False when none is left to make.
bool caching_allocator::impl::serve_wait_locked(device_lock& dlk, detail::serve_waits& w) {
  constexpr int k_worker_waits = 2;
  const bool on_worker = worker_.thread && worker_.thread->get_id() == std::this_thread::get_id();
  const bool worker = worker_.thread && worker_usable_locked() && !on_worker;
  if (worker && w.worker_waits < k_worker_waits &&
      (!releases_.deferred.empty() || worker_release_in_flight_locked())) {
    ++w.worker_waits;
    wait_for_worker_locked(dlk, nullptr);
    return true;
  }
  if (ledger_.releasing_elsewhere_bytes() != 0) {  // driver calls: never a fence
    driver_calls_.done.wait(dlk, [&]() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
      return ledger_.releasing_elsewhere_bytes() == 0;
    });
    return true;
  }
  if (ledger_.fencing_elsewhere_bytes() != 0 && !w.fencing_waited) {
    w.fencing_waited = true;
    wait_fencing_elsewhere_locked(dlk);
    return true;
  }
  if (sleep_.pauses_pending != 0 && w.pause_waits < 2) {
    // Tags still pausing hold their memory behind the pause's fences (then, offload, behind its
    // copies): the same bound as the queued fences' in defer mode, exactly in wait mode.
    ++w.pause_waits;
    wait_pausing_tags_locked(
        dlk, opts_.empty_cache == empty_cache_mode::wait ? 0 : detail::k_oom_fence_wait_us);
    return true;
  }
  if (!w.dead_pending_waited) {
    w.dead_pending_waited = true;
    if (wait_dead_pending_locked(dlk)) return true;
  }
  if (w.fence_waited || releases_.deferred.empty()) return false;
  w.fence_waited = true;
  if (opts_.empty_cache == empty_cache_mode::wait) {
    // empty_cache:wait: the host waits on exactly the queued fences, as empty_cache() does
    // (K8: another thread keeps using the allocator meanwhile), and their memory goes back.
    finish_deferred(dlk, true);
    return true;
  }
  if (wait_queued_fences_locked(dlk)) {
    if (worker) {
      wait_for_worker_locked(dlk, nullptr);
    } else {
      finish_deferred(dlk, false);
    }
    // cuda_malloc: cudaFree waits for the whole device, so a segment whose fence completed stays
    // queued while any known stream is busy (another thread's work). The last wait: for the work
    // every known stream holds now, bounded, then the release on this thread.
    if (!releases_.deferred.empty() && !capturing() && free_segment_would_block_locked() &&
        wait_device_work_locked(dlk, detail::k_oom_fence_wait_us))
      finish_deferred(dlk, false, true);
  }
  return true;
}

// Another thread's empty_cache:wait holds memory out of every pool while it waits on its fence:
// that wait ends (bounded in defer mode, as the queued fences' wait; exactly in wait mode).
void caching_allocator::impl::wait_fencing_elsewhere_locked(device_lock& dlk) {
  auto ended = [&]() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
    return ledger_.fencing_elsewhere_bytes() == 0;
  };
  if (opts_.empty_cache == empty_cache_mode::wait) {
    driver_calls_.done.wait(dlk, ended);
  } else {
    driver_calls_.done.wait_for(dlk, std::chrono::microseconds(detail::k_oom_fence_wait_us), ended);
  }
}

// Memory pending other streams' work in a destroyed stream's pool: no stream wait can order it
// (its stream is gone), so the host waits on the events of its uses, bounded as the queued
// fences' wait in defer mode (in both modes: a use may be a collective's stream), and the next
// walk retires what completed. False when no destroyed stream holds pending memory. The events
// stay owned by their blocks; one reused meanwhile by another thread only lengthens the wait.
bool caching_allocator::impl::wait_dead_pending_locked(device_lock& dlk)
    STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
  if (capturing()) return false;  // no host wait on an event during a capture
  std::vector<event_handle> events;
  for (auto& [s, other] : streams_.states) {
    if (other->alive.load(std::memory_order_acquire) || other->graph != 0) continue;
    std::unique_lock<stream_lock> olk(other->mu);
    for (const block* b : other->pending) {
      for (const auto& e : b->events) {
        if (std::find(events.begin(), events.end(), e.event) == events.end())
          events.push_back(e.event);
      }
    }
  }
  if (events.empty()) return false;
  detail::tombstone_pin pin(tombstone_refs_, streams_.tombstones.size());
  const bool done = wait_events_bounded_locked(dlk, events, detail::k_oom_fence_wait_us);
  detail::log().debug(
      "device {}: out of memory: {} on {} event(s) of destroyed streams' pending "
      "memory",
      backend_.device(), done ? "waited" : "gave up waiting", events.size());
  return true;
}

// A host wait (mu_ dropped) on `events` in turn, bounded by bound_us in all; counted in the
// statistics' fence waits. True when every one completed.
bool caching_allocator::impl::wait_events_bounded_locked(device_lock& dlk,
                                                         const std::vector<event_handle>& events,
                                                         std::uint64_t bound_us) {
  const auto start = std::chrono::steady_clock::now();
  bool done = true;
  {
    driver_call_scope in_flight(driver_calls_, dlk);
    for (event_handle e : events) {
      const auto spent = static_cast<std::uint64_t>(
          std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                                start)
              .count());
      if (spent >= bound_us || !backend_.synchronize_event_for(e, bound_us - spent)) {
        done = false;
        break;
      }
    }
  }
  stats_.fence_waits += events.size();
  stats_.fence_wait_ns += static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
  return done;
}

// A host wait (mu_ dropped), bounded by bound_us in all, on the work that every known stream
// (and every destroyed stream's last work) holds now: one event recorded on each. True when all
// of it completed. Work given to a stream meanwhile is not waited for.
bool caching_allocator::impl::wait_device_work_locked(device_lock& dlk, std::uint64_t bound_us) {
  std::vector<event_handle> recorded;
  std::vector<event_handle> waits;
  for (auto& [s, st] : streams_.states) {
    if (st->graph != 0 || !st->alive.load(std::memory_order_acquire)) continue;
    const event_handle e = get_event();
    recorded.push_back(e);
    record_event_on(e, s);
    waits.push_back(e);
  }
  stats_.events_recorded += recorded.size();
  for (const auto& t : streams_.tombstones) waits.push_back(t.event);
  bool done = false;
  {
    detail::tombstone_pin pin(tombstone_refs_, streams_.tombstones.size());
    done = wait_events_bounded_locked(dlk, waits, bound_us);
  }
  for (event_handle e : recorded) put_event(e);
  detail::log().debug("device {}: out of memory: {} on the work of {} stream(s) before cudaFree",
                      backend_.device(), done ? "waited" : "gave up waiting", recorded.size());
  return done;
}

// 7. Out of memory unless a walk serves it: walks without a host wait (serve_without_waiting_
// locked), each wait followed by a new walk, since memory may have moved meanwhile. Then
// nullptr: the caller throws out_of_memory.
block* caching_allocator::impl::out_of_memory_path_locked(device_lock& dlk,
                                                          detail::unique_lock<stream_lock>& slk,
                                                          stream_state& st, pool& p,
                                                          std::size_t rounded) {
  ++stats_.num_alloc_retries;
  detail::serve_waits w;
  for (;;) {
    block* b = serve_without_waiting_locked(dlk, slk, st, p, rounded);
    if (b || capturing()) return b;
    bool waited = false;
    {
      detail::stream_lock_dropped dropped(slk, st);
      waited = serve_wait_locked(dlk, w);
    }
    if (capturing()) return nullptr;
    if (waited) continue;
    // No wait left: what could not go back serves the request after all, the whole-segment
    // rule giving way: queued memory, then another stream's whole free segment.
    block* q = nullptr;
    if (!releases_.deferred.empty()) {
      q = reclaim_in_place_locked(p, rounded, false);
      if (!q) q = growth_hook_->reclaim_queued_last_resort_locked(*this, p, rounded);
    }
    return q ? q : steal_segment_locked(p, rounded, false);
  }
}

// Room for `bytes` more within the limit (a resume, a graph pool's growth): idle cache given
// back without a host wait, then the serve path's waits, each followed by a new look. mu_ held,
// no stream lock.
bool caching_allocator::impl::make_room_locked(device_lock& dlk, std::size_t bytes) {
  auto fits = [&]() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
    return detail::ledger::may_hold(static_cast<std::size_t>(stats_.reserved_bytes.current), bytes,
                                    limits_.limit_bytes);
  };
  detail::serve_waits w;
  while (!fits() && !capturing()) {
    retire_pending_behind_waits_locked(nullptr);
    release_cached(dlk, empty_cache_mode::defer);
    if (sleep_.pauses_pending != 0) advance_pauses_locked(dlk);
    if (fits() || capturing() || !serve_wait_locked(dlk, w)) break;
  }
  return fits();
}

}  // namespace streamsafe
