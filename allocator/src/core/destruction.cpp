// streamsafe core: destruction of the caching allocator (destroy_all, from
// ~caching_allocator): pending cross-stream frees are waited for with no lock held and retired,
// the cache is released behind its fences (wait mode), expandable address ranges and every
// event go back to the backend, and the host bookkeeping is deleted in every case, also after a
// failed driver call (logged). Runs with no other thread in the allocator; takes mu_, the stream
// locks and the event pool's lock (a leaf) in that order.
#include "core/allocator_impl.hpp"
#include "core/common/logging.hpp"

#include <algorithm>
#include <vector>

namespace streamsafe {

// Waits, mu_ dropped, for every pending free's events, then retires them.
void caching_allocator::impl::retire_all_pending_locked(device_lock& lk) {
  // The host waits on the pending frees' events with no lock held (as everywhere: no lock
  // across a host-blocking driver call), then retires them.
  fence_unfenced_locked();
  std::vector<event_handle> waits;
  for (auto& [s, st] : streams_.states) {
    detail::lock_guard<stream_lock> slk(st->mu);
    for (block* b : st->pending) {
      for (auto& e : b->events) waits.push_back(e.event);
    }
  }
  if (!waits.empty()) {
    driver_call_scope in_flight(driver_calls_, lk);
    for (event_handle e : waits) backend_.synchronize_event(e);
  }
  for (auto& [s, st] : streams_.states) {
    detail::lock_guard<stream_lock> slk(st->mu);
    while (!st->pending.empty()) retire_pending_locked(*st, st->pending.front());
  }
}

void caching_allocator::impl::destroy_events_locked() {
  std::vector<event_handle> cached_events;  // the streams' event caches (the pool's lock is a leaf)
  for (auto& [s, st] : streams_.states) {
    detail::lock_guard<stream_lock> slk(st->mu);
    cached_events.insert(cached_events.end(), st->event_cache.begin(), st->event_cache.end());
    st->event_cache.clear();
    for (const auto& e : st->idle_fence) cached_events.push_back(e.event);  // release.cpp
    st->idle_fence.clear();
  }
  for (event_handle e : cached_events) backend_.destroy_event(e);
  for (event_handle e : events_.drain()) backend_.destroy_event(e);
  for (auto& t : streams_.tombstones) backend_.destroy_event(t.event);
  streams_.tombstones.clear();
  for (event_handle e : streams_.superseded_tombstones) backend_.destroy_event(e);
  streams_.superseded_tombstones.clear();
}

void caching_allocator::impl::delete_host_bookkeeping() {
  for (auto& [base, seg] : streams_.segments) {
    for (block* b = seg->first; b;) {
      block* next = b->next;
      delete b;
      b = next;
    }
    delete seg;
  }
  streams_.segments.clear();
  const auto delete_spares = [](stream_state& st) {
    for (block* b = st.spare; b;) {
      block* next = b->next;
      delete b;
      b = next;
    }
    st.spare = nullptr;
  };
  for (auto& [s, st] : streams_.states) delete_spares(*st);
  for (auto& st : streams_.spare) delete_spares(*st);  // retired streams' states (streams.cpp)
}

void caching_allocator::impl::destroy_all() {
  stop_worker();  // joined before anything is torn down; its queue is finished below
  try {
    device_lock lk(mu_);
    // Destroyed during a capture, or with graphs not released: their memory goes back too.
    capture_.captures.clear();
    captures_underway_.store(0, std::memory_order_release);
    for (auto& [s, st] : streams_.states) st->graph_released = true;
    destroy_sleep_state_locked(lk);  // sleep.cpp: pauses underway finish, offload copies go
    for (auto& [s, st] :
         streams_.states) {  // reuse_fence:all_streams: unfenced host frees join the pending ones
      detail::lock_guard<stream_lock> slk(st->mu);
      if (!st->unfenced.empty()) fence_host_frees_locked(*st);
    }
    retire_all_pending_locked(lk);
    release_cached(lk, empty_cache_mode::wait);
    std::size_t live = 0;  // active blocks (the active maps also hold quick-cached ones)
    for (auto& [s, st] : streams_.states) {
      st->active.for_each([&](const block* b) { live += b->state == block_state::active ? 1 : 0; });
    }
    if (live != 0) {
      detail::log().warn(
          "device {}: allocator destroyed with {} live block(s); their device memory is kept",
          backend_.device(), live);
    }
    destroy_ipc_locked(lk);  // imports closed behind their events; export events destroyed
    for (auto& [base, seg] : streams_.segments) {
      if (seg->expandable && seg->mapped_bytes == 0) {
        backend_.release_address_range(reinterpret_cast<void*>(seg->base), seg->size);
      }
    }
    destroy_events_locked();
  } catch (const std::exception& e) {
    detail::log().error("device {}: error while destroying the allocator: {}", backend_.device(),
                        e.what());
  }
  delete_host_bookkeeping();  // in every case
}

}  // namespace streamsafe
