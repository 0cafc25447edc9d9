// streamsafe core: the allocation order.
//
// For a rounded request on stream s (pool = s's small or large pool):
//   1. (the fast path, s's stream lock alone) an exact-size block from the quick cache, else a
//      good fit among the pool's free blocks (segregated lists, free_lists.hpp; with the
//      cuda_malloc backend a whole free segment far larger than a large request is skipped,
//      segment_fit.hpp, for the best block that may be split). When that fit would be split
//      while a pending block might fit better, or when nothing fits, the pending blocks whose
//      events have completed are retired first (process_events_locked; as in PyTorch, a block
//      freed with record_stream uses comes back as soon as they are done) and the fit is taken
//      again; if still nothing fits, a block pending other streams' uses, behind a stream wait
//      on its events, unless the growth policy's hint says the pool can grow without raising
//      the peak (the slow path decides);
//   2. (allocate_slow: mu_, then s's lock) the host frees since the last reuse fence
//      (reuse_fence:all_streams: one wait of s per other known stream, free.cpp), the pool's
//      free blocks again, then the growth policy: growth_policy.cpp, expand_pool_locked, which
//      reclaims queued memory, grows, gives idle memory back before a growth past the peak and
//      runs the out-of-memory retry; nullptr from it is out_of_memory.
#include "core/allocator_impl.hpp"
#include "core/blocks/size_classes.hpp"
#include "core/common/format.hpp"
#include "core/common/logging.hpp"
#include "core/streams/stream_cache.hpp"

#include <stdexcept>
#include <string>

namespace streamsafe {

using detail::hex;
using detail::stream_cache_entry;
using detail::t_cache;

void* caching_allocator::impl::finish_allocation(stream_state& st, block* b, std::size_t rounded,
                                                 std::size_t size) {
  if (b->state == block_state::quick_cached) {
    b->state = block_state::active;  // from the quick cache: exactly the right size, and
                                     // still in st.active (active_map.hpp)
  } else {
    b->seg->owner->mapped.erase(b);
    b->idle_fence = 0;               // its idle proof ends with this use (release.cpp)
    b->state = block_state::active;  // before the split, so the remainder does not merge back
    split_locked(b, rounded);
    st.active.insert(b);
  }
  b->requested = size;
  count_allocation_locked(st, b);
  t_cache.last_used = {id_, st.handle, &st};
  trace(trace_action::alloc, b->addr, size, st.handle);
  if (trace_log_)
    detail::log().trace("alloc {} bytes at {} stream {}", size, hex(b->addr), hex(st.handle));
  return reinterpret_cast<void*>(b->addr);
}

// The counters of an allocation of b (b->requested set), by pool kind, and the device-wide peaks.
void caching_allocator::impl::count_allocation_locked(stream_state& st, const block* b) {
  const std::size_t size = b->requested;
  const std::size_t k = detail::kind_of(b->seg->small);
  const bool rose = st.stats.on_allocate(k, static_cast<std::int64_t>(b->size),
                                         static_cast<std::int64_t>(size));
  st.mirror.publish(st.stats, k);
  // The device-wide peaks: with one stream its own peaks are the device's; with more, any
  // allocation may set a device-wide peak while no stream passes its own.
  if (rose || sampling_.count.load(std::memory_order_relaxed) > 1) sampling_.sample();
}

void* caching_allocator::impl::allocate_slow(stream_state& st, std::size_t size,
                                             std::size_t rounded, bool small, tag_id tag) {
  if (callback_scope::active()) {  // growth, release and event calls are all backend calls
    throw std::logic_error(
        "streamsafe: allocate(" + std::to_string(size) + " bytes) on device " +
        std::to_string(backend_.device()) + ", stream " + hex(st.handle) +
        " inside a stream callback: no cached free block fits, and a stream callback may make "
        "no CUDA call (growth, release, event); allocate before launching the callback");
  }
  device_lock dlk(mu_);
  detect_captures_locked(dlk);
  if (capturing()) return allocate_during_capture_locked(dlk, size, rounded, small, st.handle, tag);
  fence_unfenced_locked();  // frees made without a backend call (free.cpp)
  if (releases_.empty_cache_requested || wants_collection_locked(rounded)) {
    // garbage_collection_threshold / max_cached_bytes, or an empty_cache asked for in a stream
    // callback: give back what is safe now, never waiting, in either empty_cache mode (the
    // host waits only in the out-of-memory retry below).
    trim_cached(dlk);
  }
  detail::unique_lock<stream_lock> slk(st.mu);
  pool& p = pool_for_locked(st, small, tag, size);  // throws tag_paused (locks released)
  // reuse_fence:all_streams: nothing free fits; the host frees since the last fence become
  // reusable behind one fence (free.cpp) rather than the pool growing.
  if (!st.unfenced.empty()) fence_host_frees_locked(st);
  if (!st.pending.empty()) process_events_locked(st);
  block* b = take_cached_fit_locked(p, rounded);
  if (!b) b = expand_pool_locked(dlk, slk, st, p, rounded);  // growth_policy.cpp
  if (!b && capturing()) {  // a capture began while the policy waited with the locks dropped
    slk.unlock();
    return allocate_during_capture_locked(dlk, size, rounded, small, st.handle, tag);
  }
  if (!b) throw_out_of_memory_locked(dlk, &slk, size, rounded, p.stream, &st, "");
  return finish_allocation(st, b, rounded, size);
}

void* caching_allocator::allocate(std::size_t size_bytes, stream_handle stream) {
  impl& m = *impl_;
  if (m.inherited()) m.throw_inherited("allocate");  // a forked child (fork.cpp)
  if (size_bytes == 0) {
    throw invalid_size("streamsafe: allocate(0 bytes) on device " +
                       std::to_string(m.backend_.device()) + ", stream " + hex(stream) +
                       ": the size must be positive");
  }
  if (size_bytes > detail::k_max_request_bytes || size_bytes > m.limits_.limit_bytes) {
    device_lock dlk(m.mu_);
    m.throw_out_of_memory_locked(dlk, nullptr, size_bytes, size_bytes, stream, nullptr,
                                 "; the request exceeds the device's memory limit");
  }
  const std::size_t rounded = m.runtime_.round(size_bytes);  // runtime_settings.hpp
  const bool small = detail::is_small(rounded);
  const tag_id tag = tag_scope::current();  // tags.cpp: 0 unless a tag_scope is open
  if (m.routes_open_.load(std::memory_order_acquire) != 0) {  // graph_pool_route.cpp
    if (void* p = m.allocate_routed(size_bytes, rounded, small, stream, tag)) return p;
  }
  if (m.capturing()) {  // a CUDA graph capture is underway on the device (capture.cpp)
    device_lock dlk(m.mu_);
    m.detect_captures_locked(dlk);
    if (m.capturing())
      return m.allocate_during_capture_locked(dlk, size_bytes, rounded, small, m.key_of(stream),
                                              tag);
  }
  impl::stream_state& st = m.state_for(stream);
  {
    detail::lock_guard<stream_lock> slk(st.mu);
    // Blocks waiting for other streams are retired in batches (process_events_locked): when
    // k_pending_batch more have queued up, or when nothing else fits.
    if (st.pending.size() >= st.process_at && !callback_scope::active())
      m.process_events_locked(st);
    pool* p = tag == 0 ? &pool_of(st, small) : tagged_pool(st, small, tag);
    block* b = p ? m.take_cached_fit_locked(*p, rounded) : nullptr;
    if (b && b->size != rounded && st.pending.may_hold_size(rounded, b->size) &&
        !callback_scope::active()) {
      // A split, while a pending block might fit better: the blocks whose uses have completed
      // come back first, so that a block freed with record_stream uses is reused as soon as
      // they are done (as PyTorch's allocator does); an exact fit (the quick cache) asks nothing.
      m.process_events_locked(st);
      b = m.best_fit(*p, rounded);
    }
    if (p && !b && !st.pending.empty() && !callback_scope::active()) {
      m.process_events_locked(st);
      b = m.best_fit(*p, rounded);
      // With free headroom under the peak the slow path grows instead (growth_policy.cpp).
      if (!b && m.headroom_hint_.load(std::memory_order_relaxed) < rounded)
        b = m.take_pending_locked(st, *p, rounded);
    }
    if (b) return m.finish_allocation(st, b, rounded, size_bytes);
  }
  return m.allocate_slow(st, size_bytes, rounded, small, tag);
}

void* caching_allocator::allocate_cached(std::size_t size_bytes, stream_handle stream) {
  impl& m = *impl_;
  if (m.inherited()) m.throw_inherited("allocate_cached");  // a forked child (fork.cpp)
  if (size_bytes == 0 || size_bytes > detail::k_max_request_bytes || m.capturing()) return nullptr;
  const std::size_t rounded = m.runtime_.round(size_bytes);
  impl::stream_state& st = m.state_for(stream);
  detail::lock_guard<stream_lock> slk(st.mu);
  if (!st.pending.empty() && !callback_scope::active()) m.process_events_locked(st);
  block* b = m.take_cached_fit_locked(pool_of(st, detail::is_small(rounded)), rounded);
  return b ? m.finish_allocation(st, b, rounded, size_bytes) : nullptr;
}

}  // namespace streamsafe
