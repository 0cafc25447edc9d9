// streamsafe core: giving memory back to the driver behind a release fence.
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

namespace {

constexpr stream_handle k_tombstone =
    detail::k_tombstone_stream;  // marks tombstone entries of a fence

// Counts n tombstone references for its lifetime (a wait with the device lock dropped).
class tombstone_pin {
 public:
  tombstone_pin(std::atomic<std::int64_t>& refs, std::size_t n)
      : refs_(refs), n_(static_cast<std::int64_t>(n)) {
    refs_.fetch_add(n_, std::memory_order_acq_rel);
  }
  ~tombstone_pin() { refs_.fetch_sub(n_, std::memory_order_acq_rel); }
  tombstone_pin(const tombstone_pin&) = delete;
  tombstone_pin& operator=(const tombstone_pin&) = delete;

 private:
  std::atomic<std::int64_t>& refs_;
  std::int64_t n_;
};

}  // namespace

std::vector<stream_handle> caching_allocator::impl::fence_streams_locked(const segment* seg) const {
  std::vector<stream_handle> out;
  auto alive =
      [&](stream_handle s) STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {  // under mu_, as its caller
        auto it = streams_.states.find(s);
        return it != streams_.states.end() && it->second->alive.load(std::memory_order_acquire);
      };
  switch (opts_.release_fence) {
    case fence_scope::allocation_stream:
      if (alive(seg->stream)) out.push_back(seg->stream);
      break;
    case fence_scope::used_streams:
      if (alive(seg->stream)) out.push_back(seg->stream);
      for (stream_handle s : seg->used_streams) {
        if (alive(s)) out.push_back(s);
      }
      break;
    case fence_scope::all_streams:
      for (auto& [s, state] : streams_.states) {
        if (state->graph == 0 && state->alive.load(std::memory_order_acquire)) out.push_back(s);
      }
      break;
    case fence_scope::device: break;
  }
  // A resume's restore copies (wake.cpp) run on the internal copy stream; the segment's stream is
  // ordered after them only while it is alive, so the fence covers the copy stream itself.
  if (sleep_.has_copy_stream && opts_.release_fence != fence_scope::device)
    out.push_back(sleep_.copy_stream);
  return out;
}

void caching_allocator::impl::add_fence_streams_locked(release_batch& batch,
                                                       const segment* seg) const {
  for (stream_handle s : fence_streams_locked(seg)) {
    if (std::find(batch.streams.begin(), batch.streams.end(), s) == batch.streams.end())
      batch.streams.push_back(s);
  }
}

void caching_allocator::impl::detach_whole_segment_locked(release_batch& batch, segment* seg) {
  block* f = seg->first;
  seg->owner->mapped.erase(f);
  f->state = block_state::releasing;
  batch.blocks.push_back(f);
  batch.bytes += f->size;
  add_fence_streams_locked(batch, seg);
}

// The whole chunks of seg's free mapped blocks but `keep`, detached into batch; true if any.
bool caching_allocator::impl::detach_free_chunks_locked(release_batch& batch, segment* seg,
                                                        const block* keep) {
  // The whole chunks inside each free mapped block of an expandable segment (but `keep`) become
  // blocks of state releasing in `batch`; the pieces around them stay free.
  bool took = false;
  for (block* b = seg->first; b; b = b->next) {
    if (b->state != block_state::free || !b->mapped || b == keep) continue;
    std::uintptr_t lo = 0;
    std::uintptr_t hi = 0;
    if (!whole_chunks_of(seg, b, lo, hi)) continue;
    seg->owner->mapped.erase(b);
    block* mid = b;
    if (lo > b->addr) {
      mid = split_off_locked(b, lo - b->addr);
      seg->owner->mapped.insert(b);
    }
    if (hi < mid->addr + mid->size)
      seg->owner->mapped.insert(split_off_locked(mid, hi - mid->addr));
    mid->state = block_state::releasing;
    batch.blocks.push_back(mid);
    batch.bytes += mid->size;
    took = true;
    b = mid;
  }
  return took;
}

// The chunks wholly inside mapped block b of expandable seg: [lo, hi); false if none.
bool caching_allocator::impl::whole_chunks_of(const segment* seg, const block* b,
                                              std::uintptr_t& lo, std::uintptr_t& hi) {
  // The chunks of a mapped block lie back to back; those wholly inside it form [lo, hi).
  const auto& chunks = seg->chunks;
  const std::uintptr_t end = b->addr + b->size;
  auto first = chunks.lower_bound(b->addr);
  if (first == chunks.end() || first->first >= end) return false;
  auto last = std::prev(chunks.lower_bound(end));  // the chunk holding the block's last byte
  lo = first->first;
  hi = last->first + last->second <= end ? last->first + last->second : last->first;
  return hi > lo;
}

// Forgets seg's chunks in [addr, addr + bytes) after their unmap; returns how many.
std::size_t caching_allocator::impl::forget_chunks(segment* seg, std::uintptr_t addr,
                                                   std::size_t bytes) {
  const auto from = seg->chunks.lower_bound(addr);
  const auto to = seg->chunks.lower_bound(addr + bytes);
  const auto n = static_cast<std::size_t>(std::distance(from, to));
  seg->chunks.erase(from, to);
  return n;
}

// True when [addr, addr + bytes) is a union of whole mapped chunks of seg.
bool caching_allocator::impl::whole_chunk_run(const segment* seg, std::uintptr_t addr,
                                              std::size_t bytes) {
  const auto first = seg->chunks.find(addr);
  const auto end = seg->chunks.lower_bound(addr + bytes);
  if (first == seg->chunks.end() || end == first) return false;
  const auto last = std::prev(end);
  return last->first + last->second == addr + bytes;
}

// Free memory that can go back: everything, only released graphs' pools, or only one tag's.
caching_allocator::impl::release_batch caching_allocator::impl::collect_releasable_locked(
    bool released_graphs_only, const tag_id* only_tag) {
  release_batch batch;
  for (auto& [base, seg] : streams_.segments)
    collect_segment_locked(batch, seg, released_graphs_only, only_tag);
  return batch;
}

void caching_allocator::impl::collect_segment_locked(release_batch& batch, segment* seg,
                                                     bool released_graphs_only,
                                                     const tag_id* only_tag) {
  stream_state& owner = state_of(*seg->owner);
  if (owner.graph != 0 && !owner.graph_released) return;  // a graph that may still replay
  if (released_graphs_only && owner.graph == 0) return;
  if (seg->paused) return;  // sleep.cpp: pause and resume own its mapping
  if (only_tag && seg->owner->tag != *only_tag) return;
  detail::lock_guard<stream_lock> slk(owner.mu);
  if (!seg->expandable) {
    if (!seg->first->next && seg->first->state == block_state::free)
      detach_whole_segment_locked(batch, seg);
    return;
  }
  if (detach_free_chunks_locked(batch, seg, nullptr)) add_fence_streams_locked(batch, seg);
}

void caching_allocator::impl::restore_batch_locked(release_batch& batch) {
  for (auto& e : batch.fence) {
    if (e.stream != k_tombstone) put_event(e.event);
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
    if (e.stream != k_tombstone) put_event(e.event);
  }
  batch.fence.clear();
  std::size_t released = 0;
  for (std::size_t i = 0; i < batch.blocks.size(); ++i)
    released += account_release_locked(batch.blocks[i], done[i] != 0);
  batch.blocks.clear();
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
    // Only what the other address gave back meanwhile (ghost_owned) is memory back now.
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

std::size_t caching_allocator::impl::finish_deferred(device_lock& lk, bool wait) {
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
      if (frees_segment && free_segment_would_block_locked()) break;
    }
    if (!done) {
      release_batch& front = releases_.deferred.front();
      const std::uint64_t waited_id = front.id;
      release_batch waiting;  // a copy of the fence (plus tombstones) to wait on without the lock
      waiting.fence = front.fence;
      waiting.device_sync = front.device_sync;
      for (auto& t : streams_.tombstones) waiting.fence.push_back({t.event, k_tombstone});
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
  if (it != ghosts.begin() && std::prev(it)->first + std::prev(it)->second.first > b->addr)
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
        if (e.stream == k_tombstone) ++tombstones;
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
        if (!fence_done_locked(batch)) {
          for (auto& t : streams_.tombstones) batch.fence.push_back({t.event, k_tombstone});
          tombstone_pin pin(tombstone_refs_,
                            streams_.tombstones.size());  // not pooled while waited on unlocked
          driver_call_scope in_flight(driver_calls_, lk);
          wait_fence_unlocked(batch);
          in_flight.relock();
          // Waited on: the tombstone entries go (a queued batch must not keep them).
          batch.fence.erase(
              std::remove_if(batch.fence.begin(), batch.fence.end(),
                             [](const pending_event& e) { return e.stream == k_tombstone; }),
              batch.fence.end());
          detail::log().debug("device {}: waited on {} fence event(s) to release {} bytes",
                              backend_.device(), batch.fence.size(), batch.bytes);
          if (capturing())
            queue_batch_locked(batch);  // a capture began meanwhile: release after it
        }
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
