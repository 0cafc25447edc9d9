// streamsafe core: giving memory back to the driver behind a release fence: the batches, their
// fences and driver calls, the deferred queue (release_collect.cpp collects what goes back;
// empty_cache.cpp runs empty_cache's modes).
//
// empty_cache (and the out-of-memory retry) detach what can go back: whole free cuda_malloc
// segments, and the whole free chunks inside free blocks of expandable segments (state
// releasing). A fence then covers every stream that may still touch that memory, chosen by the
// fence scope: one event per stream, recorded now, not one per free. In wait mode the host
// waits on exactly those events (never a device-wide sync unless the scope is `device`), with
// the device lock dropped; in defer mode nothing blocks: the blocks whose own fence streams are
// idle now go back at once, the rest is queued and finished by later calls (reclaim,
// empty_cache, the allocation slow path), or, with the release worker on, everything is queued
// and a worker thread gives it back (release_worker.cpp), and when free_segment waits for the whole
// device (cudaFree) a segment goes back only while every known stream is idle. Only then are
// free_segment / unmap called, also without the lock. A failed driver call puts its memory back
// in the pool. Every function here runs with the device lock (mu_) held on entry.
// While a CUDA graph capture is underway on the device nothing here runs (capture.cpp): no
// fence is recorded, waited or queried and nothing is released; the private pool of a graph is
// released only after notify_graph_released.
#include "core/allocator_impl.hpp"
#include "core/blocks/size_classes.hpp"
#include "core/common/logging.hpp"

#include <algorithm>
#include <chrono>

namespace streamsafe {

using detail::pending_event;
using detail::tombstone_pin;

void caching_allocator::impl::restore_batch_locked(release_batch& batch) {
  for (auto& e : batch.fence) {
    if (e.stream != detail::k_tombstone_stream) put_event(e.event);
  }
  batch.fence.clear();
  for (block* b : batch.blocks) {
    if (b->aliased) {  // its memory is another pool's now: the address waits for its unmap
      requeue_aliased_locked(b);
      continue;
    }
    detail::lock_guard<stream_lock> slk(state_of(*b->seg->owner).mu);
    free_block_locked(b);
  }
  batch.blocks.clear();
}

void caching_allocator::impl::requeue_aliased_locked(block* b) {
  // Its fence completed or was waited on before (or its memory was reclaimed behind it): a
  // batch of its own with no events, released by the next pass over the queue.
  release_batch batch;
  batch.blocks.push_back(b);
  batch.id = releases_.next_batch_id++;
  releases_.deferred.push_back(std::move(batch));
}

void caching_allocator::impl::record_fence_locked(release_batch& batch) {
  if (opts_.release_fence == fence_scope::device) {
    batch.device_sync = true;
    return;
  }
  try {
    for (stream_handle s : batch.streams) {
      event_handle e = get_event();
      batch.fence.push_back({e, s});
      record_event_on(e, s);
      ++stats_.events_recorded;
    }
  } catch (...) {
    for (auto& e : batch.fence) put_event(e.event);
    batch.fence.clear();
    throw;
  }
}

bool caching_allocator::impl::fence_done_locked(const release_batch& batch) {
  if (batch.device_sync) return false;
  for (const auto& e : batch.fence) {
    if (!backend_.query_event(e.event)) return false;
  }
  for (const auto& t : streams_.tombstones) {
    if (!backend_.query_event(t.event)) return false;
  }
  return true;
}

void caching_allocator::impl::wait_fence_unlocked(release_batch& batch) {
  const auto start = std::chrono::steady_clock::now();
  if (batch.device_sync) {
    backend_.synchronize_device();
  } else {
    for (const auto& e : batch.fence) backend_.synchronize_event(e.event);
  }
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now() - start);
  detail::lock_guard<detail::mutex> lk(mu_);
  if (batch.device_sync) ++stats_.num_sync_all_streams;
  stats_.fence_waits += batch.device_sync ? 1 : batch.fence.size();
  stats_.fence_wait_ns += static_cast<std::uint64_t>(ns.count());
}

std::size_t caching_allocator::impl::release_batch_memory(device_lock& lk, release_batch& batch) {
  std::vector<char> done(batch.blocks.size(), 0);
  std::exception_ptr error;
  // A cudaFree'd segment leaves streams_.segments before the call: once cudaFree returns,
  // cudaMalloc (another thread's growth, while mu_ is dropped) may hand out the same base address,
  // whose new segment must find its key free. Until the lock is back it waits in
  // releases_.releasing_segments.
  releases_.releasing_segments.reserve(releases_.releasing_segments.size() +
                                       batch.blocks.size());  // throws before anything moves
  for (block* b : batch.blocks) {
    if (b->seg->expandable) continue;
    streams_.segments.erase(b->seg->base);
    releases_.releasing_segments.push_back(b->seg);
  }
  // The ledger's state "being released" until the calls return: a growth that would raise the
  // peak waits for them (growth_policy.cpp), so these bytes are never counted beside memory
  // that took their place on the device.
  std::size_t releasing = 0;
  for (const block* b : batch.blocks) releasing += b->size;
  ledger_.begin_release(releasing);
  driver_call_scope in_flight(driver_calls_, lk);
  for (std::size_t i = 0; i < batch.blocks.size(); ++i) {
    block* b = batch.blocks[i];  // detached: nobody else touches it or its size
    try {
      if (b->seg->expandable) {
        backend_.unmap(reinterpret_cast<void*>(b->addr), b->size);
      } else {
        backend_.free_segment(reinterpret_cast<void*>(b->addr), b->size);
      }
      done[i] = 1;
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  in_flight.relock();
  for (auto& e : batch.fence) {
    if (e.stream != detail::k_tombstone_stream) put_event(e.event);
  }
  batch.fence.clear();
  std::size_t released = 0;
  for (std::size_t i = 0; i < batch.blocks.size(); ++i)
    released += account_release_locked(batch.blocks[i], done[i] != 0);
  batch.blocks.clear();
  ledger_.end_release(releasing);
  driver_calls_.done.notify_all();  // waits for releases (growth_policy.cpp, serve_path.cpp)
  if (error) std::rethrow_exception(error);
  return released;
}

// After the driver call for b (released or not): its bookkeeping, under b's owner lock.
std::size_t caching_allocator::impl::account_release_locked(block* b, bool released) {
  segment* seg = b->seg;
  if (!seg->expandable) {
    releases_.releasing_segments.erase(
        std::find(releases_.releasing_segments.begin(), releases_.releasing_segments.end(), seg));
    if (!released) streams_.segments.emplace(seg->base, seg);  // still ours: nobody got its address
  }
  stream_state& owner = state_of(*seg->owner);
  detail::lock_guard<stream_lock> slk(owner.mu);
  if (b->aliased) {  // an address of memory another pool reclaimed (reclaim.cpp)
    if (!released) {
      requeue_aliased_locked(b);
      return 0;
    }
    // Only what the other address gave back meanwhile (ghost_owned), less what an older ghost
    // still maps (drop_ghost_locked), is memory back now.
    const std::size_t owned = drop_ghost_locked(b);
    forget_chunks(seg, b->addr, b->size);
    seg->mapped_bytes -= b->size;
    b->mapped = false;
    b->aliased = false;
    b->ghost_owned = 0;
    if (owned != 0) {
      detail::sub_reserved(stats_, seg->small, static_cast<std::int64_t>(owned));
      stats_.bytes_released += owned;
      note_headroom_locked();
    }
    free_block_locked(b);
    return owned;
  }
  if (!released) {
    free_block_locked(b);  // still mapped: back to the pool
    return 0;
  }
  // Memory still mapped at an address queued for release (reclaim.cpp) is not back yet.
  const std::size_t bytes = b->size -
                            (seg->expandable ? unghost_locked(b->addr, b->size, seg->small) : 0);
  detail::sub_reserved(stats_, seg->small, static_cast<std::int64_t>(bytes));
  note_headroom_locked();
  stats_.bytes_released += bytes;
  if (seg->expandable) {
    stats_.num_device_free += forget_chunks(seg, b->addr, b->size);
    seg->mapped_bytes -= b->size;
    b->mapped = false;
    trace(trace_action::segment_unmap, b->addr, b->size, seg->stream);
    detail::log().debug("device {}: segment_unmap {} bytes at {:#x}", backend_.device(), bytes,
                        b->addr);
    free_block_locked(b);
  } else {
    ++stats_.num_device_free;
    trace(trace_action::segment_free, b->addr, bytes, seg->stream);
    detail::log().debug("device {}: segment_free {} bytes at {:#x}", backend_.device(), bytes,
                        b->addr);
    detail::sub_segment(stats_, seg->small);
    recycle_block(owner, b);
    --owner.segments;
    delete seg;
  }
  return bytes;
}

// device_waited: the serve path waited for the work of every known stream (serve_path.cpp), so
// a cudaFree'd segment goes back even if a stream was given work since (cudaFree waits for it).
std::size_t caching_allocator::impl::finish_deferred(device_lock& lk, bool wait,
                                                     bool device_waited) {
  // A failing backend call (query, synchronize) leaves the batch queued: nothing is lost.
  std::size_t released = 0;
  while (!releases_.deferred.empty() && !capturing()) {
    const bool done = fence_done_locked(releases_.deferred.front());
    if (!done && !wait) break;
    if (!wait) {
      // Never blocks: a cudaFree'd segment goes back only while every known stream is idle now.
      const auto& blocks = releases_.deferred.front().blocks;
      const bool frees_segment = std::any_of(blocks.begin(), blocks.end(),
                                             [](const block* b) { return !b->seg->expandable; });
      if (frees_segment && !device_waited && free_segment_would_block_locked()) break;
    }
    if (!done) {
      release_batch& front = releases_.deferred.front();
      const std::uint64_t waited_id = front.id;
      release_batch waiting;  // a copy of the fence (plus tombstones) to wait on without the lock
      waiting.fence = front.fence;
      waiting.device_sync = front.device_sync;
      for (auto& t : streams_.tombstones)
        waiting.fence.push_back({t.event, detail::k_tombstone_stream});
      tombstone_pin pin(tombstone_refs_,
                        streams_.tombstones.size());  // not pooled while waited on unlocked
      driver_call_scope in_flight(driver_calls_, lk);
      wait_fence_unlocked(waiting);
      in_flight.relock();
      if (releases_.deferred.empty() || releases_.deferred.front().id != waited_id)
        continue;  // finished by another thread
    }
    release_batch batch = std::move(releases_.deferred.front());
    releases_.deferred.pop_front();
    releases_.deferred_bytes -= batch.bytes;
    released += release_batch_memory(lk, batch);
  }
  return released;
}

// free_segment waits for the whole device (cudaFree) and a known stream is busy (polled).
bool caching_allocator::impl::free_segment_would_block_locked() {
  if (!backend_.free_segment_synchronizes()) return false;
  for (auto& t : streams_.tombstones) {
    if (!backend_.query_event(t.event)) return true;  // a dead stream's last work
  }
  for (auto& [s, st] : streams_.states) {
    // Graph pools (st->graph != 0) are keyed by a graph id, not a stream: their streams are known
    // too.
    if (st->graph == 0 && st->alive.load(std::memory_order_acquire) && !query_stream_of(s))
      return true;
  }
  return false;
}

// The blocks of `batch` whose fence streams are idle now (polled) and release would not block.
caching_allocator::impl::release_batch caching_allocator::impl::take_safe_locked(
    release_batch& batch) {
  // Polls every event first (a failing query throws before anything moves), then moves out the
  // blocks whose own fence streams (fence_streams_locked of their segment) are all idle.
  release_batch safe;
  if (batch.device_sync) return safe;
  for (const auto& t : streams_.tombstones) {
    if (!backend_.query_event(t.event)) return safe;
  }
  std::vector<stream_handle> busy;
  for (const auto& e : batch.fence) {
    if (!backend_.query_event(e.event)) busy.push_back(e.stream);
  }
  std::vector<char> idle(batch.blocks.size(), 1);
  bool frees_segment = false;
  for (std::size_t i = 0; i < batch.blocks.size(); ++i) {
    const block* b = batch.blocks[i];
    if (!busy.empty()) {
      for (stream_handle s : fence_streams_locked(b->seg)) {
        if (std::find(busy.begin(), busy.end(), s) != busy.end()) {
          idle[i] = 0;
          break;
        }
      }
    }
    frees_segment = frees_segment || (idle[i] && !b->seg->expandable);
  }
  // free_segment would wait for the whole device (cudaFree): only while every stream is idle.
  const bool free_would_block = frees_segment && free_segment_would_block_locked();
  std::vector<block*> keep;
  for (std::size_t i = 0; i < batch.blocks.size(); ++i) {
    block* b = batch.blocks[i];
    if (idle[i] && !(free_would_block && !b->seg->expandable)) {
      safe.blocks.push_back(b);
      safe.bytes += b->aliased ? 0 : b->size;
    } else {
      keep.push_back(b);
    }
  }
  batch.blocks.swap(keep);
  batch.bytes -= safe.bytes;
  return safe;
}

bool caching_allocator::impl::ghosted_locked(const block* b) const {
  const auto& ghosts = releases_.ghosts;
  if (ghosts.empty() || !b->seg->expandable) return false;
  auto it = ghosts.upper_bound(b->addr);
  if (it != ghosts.begin() && std::prev(it)->first + std::prev(it)->second.bytes > b->addr)
    return true;
  return it != ghosts.end() && it->first < b->addr + b->size;
}

// Those blocks, moved out of the queue into one batch (with the events of emptied batches).
caching_allocator::impl::release_batch caching_allocator::impl::take_completed_locked(
    bool skip_ghosted) {
  release_batch now;
  for (auto it = releases_.deferred.begin(); it != releases_.deferred.end();) {
    release_batch part = take_safe_locked(*it);  // a failing query throws before anything moves
    if (skip_ghosted) {  // memory still mapped at a ghost stays queued (reclaimed, not released)
      auto keep = std::stable_partition(
          part.blocks.begin(), part.blocks.end(),
          [&](const block* b) STREAMSAFE_REQUIRES(mu_) { return !ghosted_locked(b); });
      for (auto k = keep; k != part.blocks.end(); ++k) {
        it->blocks.push_back(*k);
        const std::size_t bytes = (*k)->aliased ? 0 : (*k)->size;  // as take_safe_locked counts
        it->bytes += bytes;
        part.bytes -= bytes;
      }
      part.blocks.erase(keep, part.blocks.end());
    }
    releases_.deferred_bytes -= part.bytes;
    now.bytes += part.bytes;
    now.blocks.insert(now.blocks.end(), part.blocks.begin(), part.blocks.end());
    if (it->blocks.empty()) {
      now.fence.insert(now.fence.end(), it->fence.begin(),
                       it->fence.end());  // back to the pool after the release
      it = releases_.deferred.erase(it);
    } else {
      ++it;
    }
  }
  return now;
}

// The queued blocks of every batch whose fence streams are idle now go back; never waits.
// skip_ghosted: not memory still mapped at a ghost (reclaim.cpp), which would not go back.
std::size_t caching_allocator::impl::release_completed_locked(device_lock& lk, bool skip_ghosted) {
  if (releases_.deferred.empty() || capturing()) return 0;
  release_batch now = take_completed_locked(skip_ghosted);
  if (now.blocks.empty()) {
    for (auto& e : now.fence) put_event(e.event);
    return 0;
  }
  return release_batch_memory(lk, now);
}

}  // namespace streamsafe
