// streamsafe core: giving memory back to the driver behind a release fence.
//
// empty_cache (and the out-of-memory retry) detach what can go back: whole free cuda_malloc
// segments, and the whole free chunks inside free blocks of expandable segments (state
// releasing). A fence then covers every stream that may still touch that memory, chosen by the
// fence scope: one event per stream, recorded now, not one per free. In wait mode the host
// waits on exactly those events (never a device-wide sync unless the scope is `device`), with
// the lock dropped; in defer mode a batch whose fence is still pending is queued and finished by
// later calls (reclaim, empty_cache, the allocation slow path). Only then are free_segment /
// unmap called, also without the lock. A failed driver call puts its memory back in the pool.
#include "allocator_state.hpp"
#include "logging.hpp"
#include "size_classes.hpp"

#include <algorithm>
#include <chrono>

namespace streamsafe {

using detail::block;
using detail::block_state;
using detail::pending_event;
using detail::segment;

namespace {

// Splits b at offset: b keeps [0, offset), the returned block takes the rest (same state).
block* split_off(block* b, std::size_t offset) {
  auto* rest = new block;
  rest->addr = b->addr + offset;
  rest->size = b->size - offset;
  rest->seg = b->seg;
  rest->prev = b;
  rest->next = b->next;
  rest->mapped = b->mapped;
  rest->state = b->state;
  if (b->next) b->next->prev = rest;
  b->next = rest;
  b->size = offset;
  return rest;
}

}  // namespace

std::vector<stream_handle> caching_allocator::impl::fence_streams_locked(const segment* seg) const {
  std::vector<stream_handle> out;
  auto alive = [&](stream_handle s) {
    auto it = streams_.find(s);
    return it != streams_.end() && it->second->alive;
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
      for (auto& [s, state] : streams_) {
        if (state->alive) out.push_back(s);
      }
      break;
    case fence_scope::device:
      break;
  }
  return out;
}

caching_allocator::impl::release_batch caching_allocator::impl::collect_releasable_locked() {
  release_batch batch;
  for (auto& [base, seg] : segments_) {
    if (!seg->expandable) {
      block* f = seg->first;
      if (!f->next && f->state == block_state::free) {
        seg->owner->mapped.erase(f);
        f->state = block_state::releasing;
        batch.blocks.push_back(f);
        batch.bytes += f->size;
      }
      continue;
    }
    const std::size_t gran = chunk_bytes(seg);
    for (block* b = seg->first; b; b = b->next) {
      if (b->state != block_state::free || !b->mapped) continue;
      const std::uintptr_t lo = seg->base + detail::round_up(b->addr - seg->base, gran);
      const std::uintptr_t hi = seg->base + (b->addr + b->size - seg->base) / gran * gran;
      if (hi <= lo) continue;
      seg->owner->mapped.erase(b);
      block* mid = b;
      if (lo > b->addr) {
        mid = split_off(b, lo - b->addr);
        seg->owner->mapped.insert(b);
      }
      if (hi < mid->addr + mid->size) {
        block* tail = split_off(mid, hi - mid->addr);
        seg->owner->mapped.insert(tail);
      }
      mid->state = block_state::releasing;
      batch.blocks.push_back(mid);
      batch.bytes += mid->size;
      b = mid;
    }
  }
  return batch;
}

void caching_allocator::impl::record_fence_locked(release_batch& batch) {
  if (opts_.release_fence == fence_scope::device) {
    batch.device_sync = true;
    return;
  }
  std::vector<stream_handle> streams;
  for (const block* b : batch.blocks) {
    for (stream_handle s : fence_streams_locked(b->seg)) {
      if (std::find(streams.begin(), streams.end(), s) == streams.end()) streams.push_back(s);
    }
  }
  try {
    for (stream_handle s : streams) {
      event_handle e = get_event_locked();
      batch.fence.push_back({e, s});
      backend_.record_event(e, s);
      ++stats_.events_recorded;
    }
  } catch (...) {
    for (auto& e : batch.fence) put_event_locked(e.event);
    batch.fence.clear();
    throw;
  }
}

bool caching_allocator::impl::fence_done_locked(const release_batch& batch) {
  if (batch.device_sync) return false;
  for (const auto& e : batch.fence) {
    if (!backend_.query_event(e.event)) return false;
  }
  for (const auto& t : tombstones_) {
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
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start);
  std::lock_guard<std::mutex> lk(mu_);
  if (batch.device_sync) ++stats_.num_sync_all_streams;
  stats_.fence_waits += batch.device_sync ? 1 : batch.fence.size();
  stats_.fence_wait_ns += static_cast<std::uint64_t>(ns.count());
}

std::size_t caching_allocator::impl::release_batch_memory(std::unique_lock<std::mutex>& lk, release_batch& batch) {
  std::vector<char> done(batch.blocks.size(), 0);
  std::exception_ptr error;
  lk.unlock();
  for (std::size_t i = 0; i < batch.blocks.size(); ++i) {
    block* b = batch.blocks[i];
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
  lk.lock();
  for (auto& e : batch.fence) {
    if (e.stream != ~stream_handle{0}) put_event_locked(e.event);  // tombstones are not pooled
  }
  batch.fence.clear();
  std::size_t released = 0;
  for (std::size_t i = 0; i < batch.blocks.size(); ++i) {
    block* b = batch.blocks[i];
    segment* seg = b->seg;
    if (!done[i]) {
      free_block_locked(b);  // still mapped: back to the pool
      continue;
    }
    released += b->size;
    stats_.reserved_bytes.decrease(static_cast<std::int64_t>(b->size));
    stats_.bytes_released += b->size;
    ++stats_.num_device_free;
    if (seg->expandable) {
      seg->mapped_bytes -= b->size;
      b->mapped = false;
      detail::log().debug("device {}: segment_unmap {} bytes at {:#x}", backend_.device(), b->size, b->addr);
      free_block_locked(b);
    } else {
      detail::log().debug("device {}: segment_free {} bytes at {:#x}", backend_.device(), b->size, b->addr);
      stats_.segment.decrease(1);
      segments_.erase(seg->base);
      delete b;
      delete seg;
    }
  }
  if (error) std::rethrow_exception(error);
  return released;
}

std::size_t caching_allocator::impl::finish_deferred(std::unique_lock<std::mutex>& lk, bool wait) {
  std::size_t released = 0;
  while (!deferred_.empty()) {
    if (!fence_done_locked(deferred_.front()) && !wait) break;
    release_batch batch = std::move(deferred_.front());
    deferred_.pop_front();
    deferred_bytes_ -= batch.bytes;
    if (!fence_done_locked(batch)) {
      for (auto& t : tombstones_) batch.fence.push_back({t.event, ~stream_handle{0}});
      lk.unlock();
      try {
        wait_fence_unlocked(batch);
      } catch (...) {
        lk.lock();
        deferred_bytes_ += batch.bytes;
        deferred_.push_front(std::move(batch));
        throw;
      }
      lk.lock();
    }
    released += release_batch_memory(lk, batch);
  }
  return released;
}

std::size_t caching_allocator::impl::release_cached(std::unique_lock<std::mutex>& lk, empty_cache_mode mode) {
  if (!pending_blocks_.empty()) process_events_locked();
  std::size_t released = 0;
  release_batch batch = collect_releasable_locked();
  if (!batch.blocks.empty()) {
    try {
      record_fence_locked(batch);
    } catch (...) {
      for (block* b : batch.blocks) free_block_locked(b);
      throw;
    }
    if (mode == empty_cache_mode::defer && !fence_done_locked(batch)) {
      ++stats_.releases_deferred;
      deferred_bytes_ += batch.bytes;
      detail::log().debug("device {}: release of {} bytes deferred behind {} fence event(s)", backend_.device(),
                          batch.bytes, batch.fence.size());
      deferred_.push_back(std::move(batch));
    } else {
      if (mode == empty_cache_mode::wait && !fence_done_locked(batch)) {
        for (auto& t : tombstones_) batch.fence.push_back({t.event, ~stream_handle{0}});
        lk.unlock();
        try {
          wait_fence_unlocked(batch);
        } catch (...) {
          lk.lock();
          for (auto& e : batch.fence) {
            if (e.stream != ~stream_handle{0}) put_event_locked(e.event);
          }
          for (block* b : batch.blocks) free_block_locked(b);
          throw;
        }
        lk.lock();
        detail::log().debug("device {}: waited on {} fence event(s) to release {} bytes", backend_.device(),
                            batch.fence.size(), batch.bytes);
      }
      released += release_batch_memory(lk, batch);
    }
  }
  released += finish_deferred(lk, mode == empty_cache_mode::wait);
  return released;
}

void caching_allocator::impl::destroy_all() {
  try {
    std::unique_lock<std::mutex> lk(mu_);
    while (!pending_blocks_.empty()) {
      block* b = pending_blocks_.front();
      for (auto& e : b->events) backend_.synchronize_event(e.event);
      retire_pending_locked(b);
    }
    release_cached(lk, empty_cache_mode::wait);
    if (!active_blocks_.empty()) {
      detail::log().warn("device {}: allocator destroyed with {} live block(s), {} bytes; their segments are kept",
                         backend_.device(), active_blocks_.size(), stats_.allocated_bytes.current);
    }
    for (auto it = segments_.begin(); it != segments_.end();) {
      segment* seg = it->second;
      if (seg->expandable && seg->mapped_bytes == 0) {
        backend_.release_address_range(reinterpret_cast<void*>(seg->base), seg->size);
        for (block* b = seg->first; b;) {
          block* next = b->next;
          delete b;
          b = next;
        }
        delete seg;
        it = segments_.erase(it);
      } else {
        ++it;
      }
    }
    for (event_handle e : free_events_) backend_.destroy_event(e);
    free_events_.clear();
    for (auto& t : tombstones_) backend_.destroy_event(t.event);
    tombstones_.clear();
  } catch (const std::exception& e) {
    detail::log().error("device {}: error while destroying the allocator: {}", backend_.device(), e.what());
  }
}

// ---- public interface -------------------------------------------------------------------------

std::size_t caching_allocator::empty_cache() { return empty_cache(impl_->opts_.empty_cache); }

std::size_t caching_allocator::empty_cache(empty_cache_mode mode) {
  std::unique_lock<std::mutex> lk(impl_->mu_);
  return impl_->release_cached(lk, mode);
}

std::size_t caching_allocator::reclaim() {
  std::unique_lock<std::mutex> lk(impl_->mu_);
  if (!impl_->pending_blocks_.empty()) impl_->process_events_locked();
  return impl_->finish_deferred(lk, false);
}

std::size_t caching_allocator::pending_release_bytes() const {
  std::lock_guard<std::mutex> lk(impl_->mu_);
  return impl_->deferred_bytes_;
}

}  // namespace streamsafe
