// streamsafe core: events and the pending list.
//
// The event pool (event_pool.hpp, under its own leaf lock) and each stream's event
// cache (guarded by that stream's lock) hold recorded-and-done events for reuse. A block freed
// with uses on other streams is pending_free: in its stream's pending list, in free order, with
// one event per stream that may still use it; it returns to its pool once they have completed
// (process_events_locked proves a prefix of the list with one query per stream). A block freed
// on the slow path has no events until fence_unfenced_locked (free.cpp) records them and moves
// it to the back of the list; until then it is never retired or reused.
// Locks: the _locked functions here need the lock of the stream whose list or block they touch;
// order_after_locked needs the device lock (mu_); get_event/put_event(e) take the pool's lock.
#include "core/common/logging.hpp"
#include "core/streams/stream_layer.hpp"

#include <algorithm>

namespace streamsafe {

event_handle detail::stream_layer::get_event() {
  event_handle e = 0;
  if (events_.take(e)) return e;
  return backend_.create_event();
}

void detail::stream_layer::put_event(event_handle e) { events_.put(e); }

event_handle detail::stream_layer::get_event(stream_state& st) {
  if (st.event_cache.empty()) return get_event();
  const event_handle e = st.event_cache.back();
  st.event_cache.pop_back();
  return e;
}

void detail::stream_layer::put_event(stream_state& st, event_handle e) {
  if (st.event_cache.size() < detail::k_event_cache)
    st.event_cache.push_back(e);  // never reallocates
  else put_event(e);
}

void detail::stream_layer::order_after_locked(stream_handle waiter, stream_handle on) {
  // waiter waits, on the device, for the work enqueued on `on` so far (one pooled event).
  event_handle e = get_event();
  try {
    record_event_on(e, on);
    stream_wait_on(waiter, e);
  } catch (...) {
    put_event(e);
    throw;
  }
  put_event(e);
  ++stats_.events_recorded;
  ++stats_.stream_waits;
}

void detail::stream_layer::add_use_locked(block* b, stream_handle stream) {
  if (stream != b->seg->stream &&
      std::find(b->uses.begin(), b->uses.end(), stream) == b->uses.end()) {
    b->uses.push_back(stream);
  }
  note_use_locked(b->seg, stream);
}

void detail::stream_layer::note_use_locked(segment* seg, stream_handle stream) {
  if (stream != seg->stream && std::find(seg->used_streams.begin(), seg->used_streams.end(),
                                         stream) == seg->used_streams.end()) {
    seg->used_streams.push_back(stream);
  }
}

void detail::stream_layer::retire_pending_locked(stream_state& st, block* b) {
  st.pending.erase(b);
  if (b->release_after) st.retired_after_empty_cache.push_back(b->seg->base);
  b->release_after = false;
  trace(trace_action::free_completed, b->addr, b->size, b->seg->stream);
  for (auto& e : b->events) {
    if (e.stream != detail::k_tombstone_stream)
      put_event(st, e.event);  // tombstones are not pooled here
    else tombstone_refs_.fetch_sub(1, std::memory_order_acq_rel);
  }
  b->events.clear();
  const std::size_t k = detail::kind_of(b->seg->small);
  st.stats.pending_done(k, static_cast<std::int64_t>(b->size));
  st.mirror.publish_pending(st.stats, k);
  free_block_locked(b);
}

void detail::stream_layer::process_events_locked(stream_state& st) {
  if (capturing()) return;  // no event query during a graph capture (capture.cpp)
  st.process_at = st.pending.size() + detail::k_pending_batch;
  if (st.pending.empty()) return;
  // Stream order proves a prefix with one query per stream. Every event of st.pending was
  // recorded under st's lock in the same critical section that appended its block, so the
  // events on one stream s lie in the list in the order they were recorded, and they complete
  // in that order: when the newest of them has completed, all of them have. Tombstones (shared
  // by every pool) prove nothing and are queried one by one. A per-thread stream handle never
  // appears here: each thread's per-thread stream has a key of its own (key_of), and an event
  // recorded for it from another thread lies under stream 0, where it was recorded.
  constexpr int k_streams = 8;
  stream_handle asked[k_streams];
  event_handle newest[k_streams];  // the event queried for each stream
  bool done[k_streams];
  int n = 0;
  auto slot = [&](stream_handle s) {
    for (int i = 0; i < n; ++i) {
      if (asked[i] == s) return i;
    }
    return -1;
  };
  // The newest events only: a bounded walk from the back (a stream whose newest event lies
  // further back just gets no proof, and its events are queried one by one below).
  std::size_t walked = 0;
  for (const block* x = st.pending.back();
       x && n < k_streams && walked < 2 * detail::k_pending_batch; x = x->pending_prev, ++walked) {
    for (const auto& e : x->events) {
      if (n == k_streams) break;
      if (e.stream == detail::k_tombstone_stream || slot(e.stream) >= 0) continue;
      asked[n] = e.stream;
      newest[n] = e.event;
      done[n++] = backend_.query_event(e.event);
    }
  }
  // Then from the oldest, as PyTorch does: stop at the first block still in use.
  while (!st.pending.empty()) {
    block* b = st.pending.front();
    if (b->events.empty())
      return;  // freed from a slow path, its events not yet recorded (releases_.unfenced)
    for (const auto& e : b->events) {
      const int i = e.stream == detail::k_tombstone_stream ? -1 : slot(e.stream);
      if (i >= 0 && done[i]) continue;
      if ((i >= 0 && newest[i] == e.event) || !backend_.query_event(e.event))
        return;  // (the newest event, already found busy, is not asked again)
    }
    retire_pending_locked(st, b);
  }
}

block* detail::stream_layer::take_pending_locked(stream_state& st, pool& p, std::size_t rounded) {
  if (capturing()) return nullptr;  // a stream wait on an outside event breaks a capture
  block* best = nullptr;
  for (block* b : st.pending) {
    // A block with no events yet (releases_.unfenced) has nothing to wait on: not a candidate.
    if (b->seg->owner == &p && b->mapped && !b->events.empty() && b->size >= rounded &&
        (!best || b->size < best->size))
      best = b;
  }
  if (!best) return nullptr;
  for (auto& e : best->events) {
    stream_wait_on(p.stream, e.event);
    ++st.stats.stream_waits;
  }
  retire_pending_locked(st, best);
  return best_fit(p, rounded);
}

}  // namespace streamsafe
