// streamsafe core: deallocate, record_stream and notify_stream_destroyed.
//
// A free on the block's own stream with no recorded uses parks the block in its pool's quick
// cache (or returns it to the free lists); any other free records one event per stream that
// may still use the block and leaves it pending_free (events.cpp). Invariant: every event is
// recorded before anything changes, so a failing backend call leaves the block active.
// The slow path (and any free inside a callback_scope) makes no backend call, since it may run
// in a stream callback (case K16): such a block goes pending with no events, onto
// releases_.unfenced, and fence_unfenced_locked records them from the next ordinary call that
// reaches the driver (an event recorded later on the same stream still comes after the last use).
// Locks: the fast path takes only the lock of the stream this thread allocated from last; the
// slow path takes the device lock (mu_), which finds the owner and sees destroyed streams'
// tombstones, then the owner's stream lock.
#include "core/allocator_impl.hpp"
#include "core/common/logging.hpp"
#include "core/streams/per_thread_stream.hpp"
#include "core/streams/stream_cache.hpp"

#include <algorithm>

namespace streamsafe {

using detail::stream_cache_entry;
using detail::t_cache;

namespace {
thread_local int t_callback_depth = 0;  // callback_scope nesting on this thread
}  // namespace

callback_scope::callback_scope() noexcept { ++t_callback_depth; }
callback_scope::~callback_scope() { --t_callback_depth; }
bool callback_scope::active() noexcept { return t_callback_depth != 0; }

// The host free's counters (st's lock held).
void caching_allocator::impl::count_free_locked(stream_state& st, const block* b) {
  const std::size_t k = detail::kind_of(b->seg->small);
  st.stats.on_free(k, static_cast<std::int64_t>(b->size), static_cast<std::int64_t>(b->requested));
  st.mirror.publish(st.stats, k);
}

// b in st.active (it stays there if parked).
void caching_allocator::impl::free_same_stream_locked(stream_state& st, block* b) {
  // No event: straight to the quick cache, staying in st.active (or out of it, to the free lists).
  if (trace_.load(std::memory_order_relaxed)) {
    trace(trace_action::free_requested, b->addr, b->requested, st.handle);
    trace(trace_action::free_completed, b->addr, b->requested, st.handle);
  }
  count_free_locked(st, b);
  b->requested = 0;
  b->state = block_state::quick_cached;
  if (!b->seg->owner->quick.push(b)) {
    st.active.erase(b->addr);
    free_block_locked(b);
  }
}

// reuse_fence:all_streams. A host free: b leaves st.active for st.unfenced, recording nothing.
void caching_allocator::impl::free_unfenced_locked(stream_state& st, block* b) {
  // reuse_fence:all_streams: no event now. One fence, recorded when st next reuses memory it
  // cannot find free (fence_host_frees_locked), covers every host free made before it: an event
  // recorded here would miss work enqueued on another stream between this free and the next.
  // Streams named by record_stream are known streams: the same fence covers them.
  st.active.erase(b->addr);
  trace(trace_action::free_requested, b->addr, b->requested, st.handle);
  count_free_locked(st, b);
  b->uses.clear();
  const std::size_t k = detail::kind_of(b->seg->small);
  st.stats.pending_added(k, static_cast<std::int64_t>(b->size));  // active: waiting for the fence
  st.mirror.publish_pending(st.stats, k);
  b->state = block_state::pending_free;
  st.unfenced.push_back(b);
}

// The reuse fence of st's unfenced host frees: st waits, on the device, for every other known
// stream (one event each) and the tombstones; then the blocks go back to st's pools.
void caching_allocator::impl::fence_host_frees_locked(stream_state& st) {
  if (st.unfenced.empty() || capturing())
    return;  // a stream wait on an outside event breaks a capture
  if (!st.alive.load(std::memory_order_acquire)) {
    fence_dead_stream_frees_locked(st);
    return;
  }
  // st waits, on the device, for the work enqueued so far on every other stream the allocator
  // knows on the device (one event each, whatever the number of frees) and for the last work
  // of the destroyed ones (their tombstones). st's own earlier work is before its next work by
  // stream order. A failing backend call leaves every block unfenced (pending, not reused).
  for (auto& [handle, other] : streams_.states) {
    if (other.get() == &st || other->graph != 0 || !other->alive.load(std::memory_order_acquire))
      continue;
    order_after_locked(st.handle, handle);
  }
  for (const auto& t : streams_.tombstones) {
    stream_wait_on(st.handle, t.event);
    ++stats_.stream_waits;
  }
  // Every later use on st comes after the fence; other streams get these blocks only through
  // a release or a segment move, whose fences cover st and so, transitively, this fence.
  while (!st.unfenced.empty()) {
    block* b = st.unfenced.front();
    st.unfenced.erase(b);
    trace(trace_action::free_completed, b->addr, b->requested, st.handle);
    st.stats.pending_done(detail::kind_of(b->seg->small), static_cast<std::int64_t>(b->size));
    free_block_locked(b);
  }
  for (std::size_t k : {detail::kind_of(true), detail::kind_of(false)})
    st.mirror.publish_pending(st.stats, k);
}

// The same for a destroyed stream st.
void caching_allocator::impl::fence_dead_stream_frees_locked(stream_state& st) {
  // st is destroyed: no stream can wait for the fence, so each block becomes an ordinary
  // pending block (events.cpp) with one event per live known stream and the tombstones, retired
  // by queries (a rare path: one event per stream per block). The events lie in the pending
  // list in recording order, as process_events_locked's proof needs. A failure leaves the
  // block, and those after it, unfenced.
  while (!st.unfenced.empty()) {
    block* b = st.unfenced.front();
    try {
      for (auto& [handle, other] : streams_.states) {
        if (other->graph != 0 || !other->alive.load(std::memory_order_acquire)) continue;
        const event_handle e = get_event(st);
        stream_handle on = handle;
        try {
          on = record_event_on(e, handle);
        } catch (...) {
          put_event(st, e);
          throw;
        }
        b->events.push_back({e, on});
      }
    } catch (...) {
      for (auto& e : b->events) put_event(st, e.event);
      b->events.clear();
      throw;
    }
    st.stats.events_recorded += b->events.size();
    for (const auto& t : streams_.tombstones)
      b->events.push_back({t.event, detail::k_tombstone_stream});
    st.unfenced.erase(b);
    st.pending.push_back(b);
  }
}

// The free dispatch of every path: true when b went back without events (a host free fenced
// at its reuse, reuse_fence:all_streams, or a same-stream free); false when it needs events,
// then recorded by free_with_events_locked (false: a stream this thread does not know and no
// device lock; b stays active) or deferred (defer_fence_locked).
bool caching_allocator::impl::free_without_events_locked(stream_state& st, block* b,
                                                         const stream_handle* stream) {
  // The one dispatch of a free, for the fast path, the device-locked path and held frees: a
  // host free under reuse_fence:all_streams is fenced at its reuse (no event now); a free with
  // no use on another stream goes straight back; anything else needs events.
  if (!stream && opts_.reuse_fence == reuse_fence_scope::all_streams && st.graph == 0) {
    free_unfenced_locked(st, b);
    return true;
  }
  if (b->uses.empty() && (!stream || *stream == b->seg->stream)) {
    free_same_stream_locked(st, b);
    return true;
  }
  return false;
}

bool caching_allocator::impl::free_with_events_locked(stream_state& st, block* b,
                                                      const stream_handle* stream,
                                                      bool device_locked) {
  st.active.erase(b->addr);
  bool recorded = false;
  try {
    recorded = record_use_events_locked(b, stream, device_locked);
  } catch (...) {
    st.active.insert(b);
    throw;
  }
  if (!recorded) {
    st.active.insert(b);  // a stream this thread does not know (never with the device lock)
    return false;
  }
  commit_free_locked(st, b, stream);
  return true;
}

void caching_allocator::impl::free_found_locked(stream_state& st, block* b,
                                                const stream_handle* stream) {
  if (!free_without_events_locked(st, b, stream)) free_with_events_locked(st, b, stream, true);
}

// b's owner stream lock held (and mu_ when device_locked); see caching_allocator.cpp.
// long: all or nothing: the two lambdas share the events being recorded and undo them together
bool caching_allocator::impl::record_use_events_locked(block* b, const stream_handle* stream,
                                                       bool device_locked) {
  // One event per stream that may still use b: its record_stream uses and, for a stream-ordered
  // free, the stream of last use. Every event is recorded before anything changes: a failure
  // leaves b->events empty and the block as it was. A stream announced as destroyed gets no
  // call: its tombstone event covers it (device lock needed to see them). Without the device
  // lock, only streams this thread knows to be alive are handled; otherwise nothing is
  // recorded and false is returned.
  const segment* seg = b->seg;
  stream_state& owner = state_of(*seg->owner);
  std::vector<detail::pending_event>& events = b->events;
  events.reserve(b->uses.size() + 1);
  // The lambdas run under b's owner lock (and mu_ when device_locked), which the analysis
  // cannot see inside a lambda.
  auto unwind = [&]() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
    for (auto& e : events) {
      if (e.stream != detail::k_tombstone_stream) put_event(owner, e.event);
      else tombstone_refs_.fetch_sub(1, std::memory_order_acq_rel);
    }
    events.clear();
  };
  auto record_on = [&](stream_handle s) STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
    if (device_locked) {
      auto it = streams_.states.find(s);
      if (it == streams_.states.end()) return true;  // a destroyed stream gone: its work is done
      if (!it->second->alive.load(std::memory_order_acquire)) {
        for (auto& t : streams_.tombstones) {  // proves s's last work (none: seen complete)
          events.push_back({t.event, detail::k_tombstone_stream});
          tombstone_refs_.fetch_add(1, std::memory_order_acq_rel);
        }
        return true;
      }
    } else if (cached_live_state(s) == nullptr) {
      return false;
    }
    event_handle e = get_event(owner);
    stream_handle on = s;
    try {
      on = record_event_on(e, s);  // s, or 0 for another thread's per-thread stream
    } catch (...) {
      put_event(owner, e);
      throw;
    }
    events.push_back({e, on});
    return true;
  };
  try {
    for (stream_handle s : b->uses) {
      if (!record_on(s)) {
        unwind();
        return false;
      }
    }
    if (stream && *stream != seg->stream &&
        std::find(b->uses.begin(), b->uses.end(), *stream) == b->uses.end() &&
        !record_on(*stream)) {
      unwind();
      return false;
    }
  } catch (...) {
    unwind();
    throw;
  }
  return true;
}

void caching_allocator::impl::commit_free_locked(stream_state& st, block* b,
                                                 const stream_handle* stream) {
  // b is out of the active map and b->events holds its recorded events (possibly none).
  segment* seg = b->seg;
  if (stream) note_use_locked(seg, *stream);
  const auto bytes = static_cast<std::int64_t>(b->size);
  trace(trace_action::free_requested, b->addr, b->requested, seg->stream);
  if (b->events.empty()) trace(trace_action::free_completed, b->addr, b->requested, seg->stream);
  count_free_locked(st, b);
  st.stats.events_recorded += b->events.size();
  b->uses.clear();
  if (b->events.empty()) {
    free_block_locked(b);
    return;
  }
  const std::size_t k = detail::kind_of(seg->small);
  st.stats.pending_added(k, bytes);  // still active: waiting for other streams
  st.mirror.publish_pending(st.stats, k);
  b->state = block_state::pending_free;
  st.pending.push_back(b);
}

// A host free with uses on other streams, with no backend call: b goes pending with no events
// and onto releases_.unfenced (mu_ and st's lock held).
void caching_allocator::impl::defer_fence_locked(stream_state& st, block* b,
                                                 const stream_handle* stream) {
  // As commit_free_locked, without the events: the stream of a stream-ordered free becomes one
  // more use, and fence_unfenced_locked records one event per use later. Until then b is
  // pending with no events, which process_events_locked and take_pending_locked never retire.
  segment* seg = b->seg;
  releases_.unfenced.reserve(releases_.unfenced.size() + 1);  // throws before anything changes
  if (stream && *stream != seg->stream) add_use_locked(b, *stream);
  st.active.erase(b->addr);
  trace(trace_action::free_requested, b->addr, b->requested, seg->stream);
  count_free_locked(st, b);
  const std::size_t k = detail::kind_of(seg->small);
  st.stats.pending_added(k, static_cast<std::int64_t>(b->size));
  st.mirror.publish_pending(st.stats, k);
  b->state = block_state::pending_free;
  st.pending.push_back(b);
  releases_.unfenced.push_back(b);
}

// Records the events of releases_.unfenced's blocks (nothing while a capture is underway).
void caching_allocator::impl::fence_unfenced_locked() {
  if (releases_.unfenced.empty() || capturing()) return;  // no event is recorded during a capture
  std::size_t done = 0;
  try {
    for (; done < releases_.unfenced.size(); ++done) {
      block* b = releases_.unfenced[done];
      stream_state& st = state_of(*b->seg->owner);
      detail::lock_guard<stream_lock> slk(st.mu);
      record_use_events_locked(b, nullptr, true);  // a failure leaves b as it was
      st.stats.events_recorded += b->events.size();
      b->uses.clear();
      // To the back of the list: process_events_locked relies on list order = record order.
      st.pending.erase(b);
      st.pending.push_back(b);
      if (b->events.empty()) retire_pending_locked(st, b);  // its use streams are gone and done
    }
  } catch (...) {
    releases_.unfenced.erase(releases_.unfenced.begin(),
                             releases_.unfenced.begin() + static_cast<std::ptrdiff_t>(done));
    throw;
  }
  releases_.unfenced.clear();
}

bool caching_allocator::impl::thread_allocated_here() const noexcept {
  // last_used is written by allocations only (a stream lookup fills t_cache.streams, which a
  // stream-ordered free from a callback does too).
  return t_cache.last_used.owner == id_;
}

void caching_allocator::impl::deallocate_impl(void* ptr, const stream_handle* stream) {
  if (inherited()) return;  // a forked child: the parent's block is not the child's (fork.cpp)
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  stream_handle key = 0;  // the stream-ordered free's stream, as a key (per-thread handles)
  if (stream) {
    key = key_of(*stream);
    stream = &key;
    state_for(key);  // a stream-ordered free makes the stream known (for fences)
  }
  // Fast path: a free of a block of the stream this thread allocated from last, under that
  // stream's lock alone. A same-stream free records nothing; a free with uses on other streams
  // records their events here too when this thread knows each of those streams to be alive
  // (its stream cache); otherwise (a stream that may be gone, a free held by a graph capture,
  // a capture underway) the device lock is taken below, which lets the free see the tombstones
  // of destroyed streams and the capture's rules (capture.cpp).
  if (const stream_cache_entry& last = t_cache.last_used; last.owner == id_ && !capturing()) {
    auto& st = *static_cast<stream_state*>(last.state);
    detail::lock_guard<stream_lock> slk(st.mu);
    // A free held by a capture goes to the slow path (which rejects it), and so does an
    // exported block's (held until its exports end, ipc.cpp); in a stream callback no backend
    // call: the slow path below defers the events; so does a stream this thread does not know.
    if (block* b = st.active.find_active(addr);
        b && !b->free_held && b->ipc_exports == 0 && !b->ipc_held) {
      if (free_without_events_locked(st, b, stream)) return;
      if (!callback_scope::active() && free_with_events_locked(st, b, stream, false)) return;
    }
  }
  detail::lock_guard<detail::mutex> dlk(mu_);
  const char* what = stream ? "deallocate(stream)" : "deallocate";
  stream_state* owner = owner_locked(ptr);
  if (!owner) throw_invalid_pointer_locked(ptr, what);
  detail::lock_guard<stream_lock> slk(owner->mu);
  block* b = owner->active.find_active(addr);
  if (!b || b->free_held || b->ipc_held) throw_invalid_pointer_locked(ptr, what);
  if (b->ipc_exports != 0) {  // exported to another process: held until its exports end (ipc.cpp)
    hold_exported_free_locked(*owner, b, stream);
    return;
  }
  if (capturing() && free_during_capture_locked(*owner, b, stream)) return;
  // On a thread that never allocated here (it may be a stream callback, K16) or inside a
  // callback_scope, no backend call: uses on other streams get their events from the next
  // ordinary call that reaches the driver. A use on this thread's own per-thread stream
  // (cudaStreamPerThread) is recorded now, on this thread, the one thread that can name that
  // stream: later, from another thread, only the legacy stream could stand in for it
  // (record_event_on), which orders every blocking stream.
  const auto own_per_thread = [](stream_handle s) {
    return detail::is_per_thread_key(s) && detail::own_per_thread_key(s);
  };
  if (free_without_events_locked(*owner, b, stream)) return;  // as on the fast path
  if (!callback_scope::active() &&
      (thread_allocated_here() || (stream && own_per_thread(*stream)) ||
       std::any_of(b->uses.begin(), b->uses.end(), own_per_thread))) {
    // A thread that has allocated from this allocator is an ordinary thread (a CUDA host
    // function thread that never allocated here is the case deferred below): its events are
    // recorded now, as on the fast path, so the block is retired by the next event query.
    free_with_events_locked(*owner, b, stream, true);
  } else {
    defer_fence_locked(*owner, b, stream);
  }
}

void caching_allocator::deallocate(void* ptr) { impl_->deallocate_impl(ptr, nullptr); }

void caching_allocator::deallocate(void* ptr, stream_handle stream) {
  impl_->deallocate_impl(ptr, &stream);
}

void caching_allocator::record_stream(void* ptr, stream_handle stream) {
  impl& m = *impl_;
  if (m.inherited()) return;  // a forked child (fork.cpp)
  stream = m.key_of(stream);  // cudaStreamPerThread: this thread's per-thread stream
  m.state_for(stream);        // the stream becomes known (for fences)
  // Fast path: a block of the stream this thread allocated from last, under that stream's lock
  // (which guards the block and its segment's used streams).
  if (const stream_cache_entry& last = t_cache.last_used; last.owner == m.id_) {
    auto& st = *static_cast<impl::stream_state*>(last.state);
    detail::lock_guard<stream_lock> slk(st.mu);
    if (block* b = st.active.find_active(reinterpret_cast<std::uintptr_t>(ptr));
        b && !b->free_held && !b->ipc_held) {
      m.add_use_locked(b, stream);
      return;
    }
  }
  detail::lock_guard<detail::mutex> dlk(m.mu_);
  impl::stream_state* owner = m.owner_locked(ptr);
  if (!owner) m.throw_invalid_pointer_locked(ptr, "record_stream");
  detail::lock_guard<stream_lock> slk(owner->mu);
  block* b = owner->active.find_active(reinterpret_cast<std::uintptr_t>(ptr));
  if (!b || b->free_held || b->ipc_held) m.throw_invalid_pointer_locked(ptr, "record_stream");
  m.add_use_locked(b, stream);
}

void caching_allocator::notify_stream_destroyed(stream_handle stream) {
  impl& m = *impl_;
  if (m.inherited()) return;  // a forked child (fork.cpp)
  stream = m.key_of(stream);  // cudaStreamPerThread: this thread's per-thread stream
  detail::lock_guard<detail::mutex> lk(m.mu_);
  auto it = m.streams_.states.find(stream);
  if (it == m.streams_.states.end() || !it->second->alive.load()) return;
  m.fence_unfenced_locked();  // blocks freed with uses on this stream get their events while it
                              // lives
  m.retire_dead_streams_locked();  // one query: the previous tombstone may be done
  // One tombstone for every destroyed stream: the stream waits on the previous tombstone, then
  // records the new one, whose completion proves both (the previous one is superseded).
  event_handle e = m.get_event();
  try {
    if (!m.streams_.tombstones.empty()) {
      m.stream_wait_on(stream, m.streams_.tombstones.front().event);
      ++m.stats_.stream_waits;
    }
    m.record_event_on(e, stream);
  } catch (...) {
    m.put_event(e);
    throw;
  }
  ++m.stats_.events_recorded;
  if (!m.streams_.tombstones.empty()) m.drop_tombstone_locked(m.streams_.tombstones.front().event);
  m.streams_.tombstones.assign(1, {e, stream});
  it->second->alive.store(false, std::memory_order_release);
  m.streams_.dead.push_back(it->second.get());
}

}  // namespace streamsafe
