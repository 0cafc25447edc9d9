// streamsafe core: empty_cache in its modes (wait: the host waits on exactly the fences; defer:
// what is idle now goes back, the rest is queued), the release of the whole cache on the
// out-of-memory path, trims, proofs that segments are idle, and the public calls empty_cache,
// reclaim, finish_releases and pending_release_bytes. release.cpp has the rules of a release
// and its driver calls; release_collect.cpp what is collected. Every function of impl here
// runs with the device lock (mu_) held on entry.
#include "core/allocator_impl.hpp"
#include "core/common/logging.hpp"

#include <algorithm>
#include <chrono>

namespace streamsafe {

using detail::pending_event;
using detail::tombstone_pin;

std::size_t caching_allocator::impl::release_cached(device_lock& lk, empty_cache_mode mode) {
  detect_captures_locked(lk);
  if (capturing()) {  // runs, in defer mode, when the last capture ends (capture.cpp)
    capture_.empty_cache_after = true;
    ++capture_.deferrals;
    detail::log().debug(
        "device {}: release of cached memory deferred until the CUDA graph capture ends",
        backend_.device());
    return 0;
  }
  // Wait mode also waits on the consumer events of freed exported blocks (ipc.cpp).
  if (mode == empty_cache_mode::wait) wait_ipc_locked(lk);
  // Blocks pending other streams' work (record_stream, a free on another stream): wait mode
  // waits on their events so that they go back now; defer mode leaves them to a later reclaim().
  if (mode == empty_cache_mode::wait) wait_pending_uses_locked(lk);
  prepare_release_locked();
  if (mode == empty_cache_mode::defer) mark_pending_uses_locked();
  release_batch batch = collect_releasable_locked();
  std::size_t released = release_collected(lk, batch, mode);
  if (worker_releases_locked(mode)) return released;  // the worker finishes the queue
  released += finish_deferred(lk, mode == empty_cache_mode::wait);
  // Wait mode gives everything back before returning: also what the worker has in flight.
  if (mode == empty_cache_mode::wait && worker_release_in_flight_locked())
    wait_for_worker_locked(lk, nullptr);
  retire_dead_streams_locked();  // destroyed streams whose memory went back
  return released;
}

void caching_allocator::impl::prepare_release_locked() {
  releases_.empty_cache_requested = false;
  poll_ipc_locked();  // exported blocks whose exports ended become free (ipc.cpp)
  fence_unfenced_locked();
  for (auto& [s, st] : streams_.states) {
    detail::lock_guard<stream_lock> slk(st->mu);
    if (!st->unfenced.empty()) fence_host_frees_locked(*st);  // reuse_fence:all_streams (free.cpp)
    if (!st->pending.empty()) process_events_locked(*st);
    for_each_pool(*st, [&](pool& p) { flush_quick_locked(p); });
  }
}

// empty_cache:wait: the host waits, with no lock held, on the events of the blocks pending other
// streams' work now; prepare_release_locked then retires them and they go back with the rest. An
// event retired and recorded again meanwhile only makes the wait longer (pooled events are never
// destroyed before the allocator); the tombstones among them are pinned while waited on.
void caching_allocator::impl::wait_pending_uses_locked(device_lock& lk) {
  if (capturing()) return;
  fence_unfenced_locked();  // blocks freed on a slow path get their events first
  std::vector<event_handle> waits;
  std::size_t tombstones = 0;
  for (auto& [s, st] : streams_.states) {
    detail::lock_guard<stream_lock> slk(st->mu);
    for (block* b : st->pending) {
      for (const auto& e : b->events) {
        waits.push_back(e.event);
        if (e.stream == detail::k_tombstone_stream) ++tombstones;
      }
    }
  }
  if (waits.empty()) return;
  tombstone_pin pin(tombstone_refs_, tombstones);
  const auto start = std::chrono::steady_clock::now();
  driver_call_scope in_flight(driver_calls_, lk);
  for (event_handle e : waits) backend_.synchronize_event(e);
  in_flight.relock();
  stats_.fence_waits += waits.size();
  stats_.fence_wait_ns += static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
}

// empty_cache:defer never waits: the blocks still pending other streams' events are marked, and
// each later reclaim() releases the memory of those that retired meanwhile (their events
// completed), behind the usual fence.
void caching_allocator::impl::mark_pending_uses_locked() {
  for (auto& [s, st] : streams_.states) {
    detail::lock_guard<stream_lock> slk(st->mu);
    for (block* b : st->pending) {
      b->release_after = true;
      releases_.release_after_pending = true;
    }
  }
}

// reclaim(): after its events were processed, what the marked blocks that retired left free goes
// back as empty_cache:defer would: the free memory of the segments they were in (not memory
// cached elsewhere since the empty_cache); the mark ends once none of them is pending any more.
std::size_t caching_allocator::impl::release_after_pending_locked(device_lock& lk) {
  bool still = false;
  std::vector<std::uintptr_t> bases;
  for (auto& [s, st] : streams_.states) {
    detail::lock_guard<stream_lock> slk(st->mu);
    for (block* b : st->pending) still = still || b->release_after;
    bases.insert(bases.end(), st->retired_after_empty_cache.begin(),
                 st->retired_after_empty_cache.end());
    st->retired_after_empty_cache.clear();
  }
  releases_.release_after_pending = still;
  if (bases.empty()) return 0;
  prepare_release_locked();
  // Only the segments those blocks were in: memory cached after the empty_cache stays cached,
  // as after PyTorch's synchronous empty_cache.
  std::sort(bases.begin(), bases.end());
  bases.erase(std::unique(bases.begin(), bases.end()), bases.end());
  release_batch batch;
  for (std::uintptr_t base : bases) {
    auto it = streams_.segments.find(base);
    if (it != streams_.segments.end()) collect_segment_locked(batch, it->second, false, nullptr);
  }
  return release_collected(lk, batch, empty_cache_mode::defer);
}

// The opportunistic release (max_cached_bytes, garbage_collection_threshold, an empty_cache
// asked for from a stream callback): releases what is safe now, never waits, queues nothing.
std::size_t caching_allocator::impl::trim_cached(device_lock& lk) {
  detect_captures_locked(lk);
  if (capturing()) return 0;  // an opportunistic release just waits for the next chance
  prepare_release_locked();
  release_batch batch = collect_releasable_locked();
  std::size_t released = release_safe_now(lk, batch);
  // The queue of earlier releases: the worker's job when it runs, else this call's (never waiting).
  if (!worker_releases_locked(empty_cache_mode::defer)) released += finish_deferred(lk, false);
  retire_dead_streams_locked();  // destroyed streams whose memory went back
  return released;
}

// Fences `batch`, releases what is idle now; the rest back to the pools (no queue, no wait).
std::size_t caching_allocator::impl::release_safe_now(device_lock& lk, release_batch& batch) {
  if (batch.blocks.empty()) return 0;
  release_batch now;
  try {
    record_fence_locked(batch);  // polled below, never waited on
    now = take_safe_locked(batch);
  } catch (...) {
    restore_batch_locked(now);
    restore_batch_locked(batch);
    throw;
  }
  now.fence = std::move(batch.fence);  // its events go back to the pool after the release
  batch.fence.clear();
  restore_batch_locked(batch);  // busy streams' memory stays cached: no queue, no later wait
  if (now.blocks.empty()) {
    restore_batch_locked(now);
    return 0;
  }
  return release_batch_memory(lk, now);
}

void caching_allocator::impl::drop_idle_fence_locked(stream_state& st) {
  for (const auto& e : st.idle_fence) put_event(e.event);
  st.idle_fence.clear();
}

// Before a cuda_malloc growth (K12): the whole free segments of st's completed idle fence are
// proven idle; those not labelled yet get a new fence (polled later, never waited on). A failed
// backend call leaves the labels as they were.
void caching_allocator::impl::prove_idle_segments_locked(stream_state& st, pool& p) {
  // A fence recorded when a segment is refused comes after the stream's newest work, which a
  // loop whose requests grow a little each step (K12) has always just launched: it is still
  // pending then, and the segment would wait in the queue while the pool grows. A fence
  // recorded one growth earlier, over the segments idle then, has completed by the next one.
  if (capturing() || opts_.release_fence == fence_scope::device) return;
  try {
    if (!st.idle_fence.empty()) {
      for (const auto& e : st.idle_fence) {
        if (!backend_.query_event(e.event)) return;  // one fence at a time
      }
      for (const auto& t : streams_.tombstones) {  // destroyed streams' last work
        if (!backend_.query_event(t.event)) return;
      }
      p.mapped.for_each([&](block* b) {
        if (b->idle_fence == st.idle_fence_id) b->idle_fence = detail::k_idle_proven;
      });
      drop_idle_fence_locked(st);
    }
    std::vector<stream_handle> streams;
    bool any = false;
    p.mapped.for_each([&](block* b) STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
      if (b->prev || b->next || b->idle_fence != 0) return;
      any = true;
      for (stream_handle s : fence_streams_locked(b->seg)) {
        if (std::find(streams.begin(), streams.end(), s) == streams.end()) streams.push_back(s);
      }
    });
    if (!any) return;
    for (stream_handle s : streams) {
      const event_handle e = get_event();
      st.idle_fence.push_back({e, s});
      record_event_on(e, s);
      ++stats_.events_recorded;
    }
  } catch (const std::exception& e) {
    drop_idle_fence_locked(st);
    detail::log().debug("device {}: an idle fence failed: {}", backend_.device(), e.what());
    return;
  }
  if (++growth_.next_idle_fence_id < 2) growth_.next_idle_fence_id = 2;
  st.idle_fence_id = growth_.next_idle_fence_id;
  p.mapped.for_each([&](block* b) {
    if (!b->prev && !b->next && b->idle_fence == 0) b->idle_fence = st.idle_fence_id;
  });
}

// empty_cache:wait: the host waits on a collected batch's fence (mu_ dropped), its bytes the
// ledger's "queued" meanwhile, so that another thread's serve path sees them and may wait for
// this wait to end (serve_path.cpp).
void caching_allocator::impl::wait_collected_fence_locked(device_lock& lk, release_batch& batch) {
  for (auto& t : streams_.tombstones) batch.fence.push_back({t.event, detail::k_tombstone_stream});
  tombstone_pin pin(tombstone_refs_,
                    streams_.tombstones.size());  // not pooled while waited on unlocked
  const std::size_t fencing = batch.bytes;
  ledger_.begin_fence_wait(fencing);
  try {
    driver_call_scope in_flight(driver_calls_, lk);
    wait_fence_unlocked(batch);
  } catch (...) {
    ledger_.end_fence_wait(fencing);
    driver_calls_.done.notify_all();
    throw;
  }
  ledger_.end_fence_wait(fencing);
  driver_calls_.done.notify_all();
  // Waited on: the tombstone entries go (a queued batch must not keep them).
  batch.fence.erase(
      std::remove_if(batch.fence.begin(), batch.fence.end(),
                     [](const pending_event& e) { return e.stream == detail::k_tombstone_stream; }),
      batch.fence.end());
  detail::log().debug("device {}: waited on {} fence event(s) to release {} bytes",
                      backend_.device(), batch.fence.size(), batch.bytes);
  if (capturing()) queue_batch_locked(batch);  // a capture began meanwhile: release after it
}

// Fences and releases a collected batch (queued in defer mode when its fence is pending).
std::size_t caching_allocator::impl::release_collected(device_lock& lk, release_batch& batch,
                                                       empty_cache_mode mode) {
  std::size_t released = 0;
  if (worker_releases_locked(mode)) {
    hand_to_worker_locked(batch);  // fenced and queued: no unmap on this thread
    return 0;
  }
  if (!batch.blocks.empty()) {
    // Until the memory is given back or queued, any failure puts the blocks back in their pools.
    release_batch now;  // what goes back to the driver in this call
    try {
      record_fence_locked(batch);
      if (mode == empty_cache_mode::defer) {
        // Never blocks: what is safe now goes back, the rest waits in the queue behind its fence.
        now = take_safe_locked(batch);
        if (batch.blocks.empty()) {
          now.fence = std::move(batch.fence);  // its events go back to the pool after the release
          batch = release_batch{};
        } else {
          queue_batch_locked(batch);
        }
      } else {
        if (!fence_done_locked(batch)) wait_collected_fence_locked(lk, batch);
        now = std::move(batch);
        batch = release_batch{};
      }
    } catch (...) {
      if (!lk.owns_lock()) lk.lock();
      restore_batch_locked(now);
      restore_batch_locked(batch);
      throw;
    }
    if (!now.blocks.empty()) released += release_batch_memory(lk, now);
  }
  return released;
}

void caching_allocator::impl::queue_batch_locked(release_batch& batch) {
  ++stats_.releases_deferred;
  releases_.deferred_bytes += batch.bytes;
  batch.id = releases_.next_batch_id++;
  trace(trace_action::release_deferred, batch.blocks.front()->addr, batch.bytes,
        batch.blocks.front()->seg->stream);
  detail::log().debug("device {}: release of {} bytes deferred behind {} fence event(s)",
                      backend_.device(), batch.bytes, batch.fence.size());
  releases_.deferred.push_back(std::move(batch));
  batch = release_batch{};
}

// ---- public interface -------------------------------------------------------------------------

std::size_t caching_allocator::empty_cache() { return empty_cache(impl_->opts_.empty_cache); }

std::size_t caching_allocator::empty_cache(empty_cache_mode mode) {
  if (impl_->inherited())
    return 0;  // a forked child: nothing of the parent's is released (fork.cpp)
  device_lock lk(impl_->mu_);
  if (callback_scope::active()) {  // no backend call in a stream callback: later, never waiting
    impl_->releases_.empty_cache_requested = true;
    return 0;
  }
  return impl_->release_cached(lk, mode);
}

std::size_t caching_allocator::reclaim() {
  if (impl_->inherited()) return 0;        // a forked child (fork.cpp)
  if (callback_scope::active()) return 0;  // no backend call in a stream callback
  device_lock lk(impl_->mu_);
  impl_->detect_captures_locked(lk);
  if (impl_->capturing()) return 0;  // no query while a graph is captured: after the capture
  if (impl_->releases_.empty_cache_requested)
    return impl_->trim_cached(lk);  // asked for from a callback
  impl_->fence_unfenced_locked();
  impl_->poll_ipc_locked();  // ended exports: their held frees complete (ipc.cpp)
  for (auto& [s, st] : impl_->streams_.states) {
    detail::lock_guard<stream_lock> slk(st->mu);
    if (!st->pending.empty()) impl_->process_events_locked(*st);
  }
  std::size_t released = 0;
  if (impl_->releases_.release_after_pending) released += impl_->release_after_pending_locked(lk);
  released += impl_->finish_deferred(lk, false);
  if (impl_->sleep_.pauses_pending != 0 && !impl_->worker_usable_locked())
    released += impl_->advance_pauses_locked(lk);  // sleep.cpp: deferred pauses, never waiting
  // The worker's release in flight (driver calls on memory whose fence completed) ends too, so
  // that what reclaim returns to has every completed release done; never a fence wait.
  if (impl_->worker_release_in_flight_locked()) impl_->wait_for_worker_locked(lk, nullptr);
  return released;
}

std::size_t caching_allocator::finish_releases() {
  if (impl_->inherited()) return 0;        // a forked child (fork.cpp)
  if (callback_scope::active()) return 0;  // no backend call, no wait in a stream callback
  std::size_t released = reclaim();        // what is done already, never waiting
  device_lock lk(impl_->mu_);
  impl_->detect_captures_locked(lk);
  if (impl_->capturing()) return released;
  released += impl_->finish_deferred(lk, true);  // waits on each queued fence, mu_ dropped
  if (impl_->worker_release_in_flight_locked()) impl_->wait_for_worker_locked(lk, nullptr);
  return released;
}

std::size_t caching_allocator::pending_release_bytes() const {
  detail::lock_guard<detail::mutex> lk(impl_->mu_);
  return impl_->queued_release_bytes_locked();
}

}  // namespace streamsafe
