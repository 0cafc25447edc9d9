// streamsafe core: the caching allocator's state (internal; shared by caching_allocator.cpp,
// which allocates and frees, and release.cpp, which gives memory back behind fences).
//
// Lock: mu_ guards everything below. It is released around host-blocking backend calls
// (synchronize_event, synchronize_device) and around the driver calls that return memory
// (free_segment, unmap), whose blocks are detached (state releasing) meanwhile.
#pragma once

#include "block.hpp"

#include <streamsafe/core/caching_allocator.hpp>

#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace streamsafe {

struct caching_allocator::impl {
  using block = detail::block;
  using segment = detail::segment;
  using pool = detail::pool;

  // Streams the allocator has seen, with their two pools.
  struct stream_state {
    pool small_pool;
    pool large_pool;
    bool alive = true;
  };

  // Memory detached for release, and the fence that must complete first.
  struct release_batch {
    std::vector<block*> blocks;  // whole-segment blocks (cuda_malloc) or chunk runs (expandable)
    std::vector<detail::pending_event> fence;
    bool device_sync = false;
    std::size_t bytes = 0;
  };

  impl(device_backend& backend, options opts);

  device_backend& backend_;
  options opts_;
  std::size_t limit_bytes_ = 0;
  std::size_t small_chunk_bytes_ = 0;  // expandable small pools: the driver's granularity
  std::size_t large_chunk_bytes_ = 0;  // expandable large pools: options::expandable_chunk_bytes
  std::size_t chunk_bytes(const segment* seg) const { return seg->small ? small_chunk_bytes_ : large_chunk_bytes_; }
  std::size_t device_total_bytes_ = 0;

  mutable std::mutex mu_;
  std::unordered_map<stream_handle, std::unique_ptr<stream_state>> streams_;
  std::unordered_map<std::uintptr_t, block*> active_blocks_;
  std::map<std::uintptr_t, segment*> segments_;  // by base address
  std::list<block*> pending_blocks_;             // pending_free, in free order
  std::vector<event_handle> free_events_;
  std::deque<release_batch> deferred_;
  std::size_t deferred_bytes_ = 0;
  // Events recorded on streams just before they were destroyed: part of every fence until done.
  std::vector<detail::pending_event> tombstones_;
  statistics stats_;

  // ---- caching_allocator.cpp -----------------------------------------------------------------
  stream_state& stream_locked(stream_handle stream);
  pool& pool_locked(stream_handle stream, bool small) {
    auto& s = stream_locked(stream);
    return small ? s.small_pool : s.large_pool;
  }
  block* best_fit_locked(detail::free_set& set, std::size_t rounded, bool small) const;
  block* take_pending_locked(stream_handle stream, bool small, std::size_t rounded);
  block* new_segment_locked(pool& p, std::size_t rounded);
  block* expandable_fit_locked(pool& p, std::size_t rounded);
  bool map_chunks_locked(std::uintptr_t addr, std::size_t bytes, std::size_t chunk);
  block* steal_segment_locked(pool& p, std::size_t rounded);
  block* find_block_locked(pool& p, std::size_t rounded, bool allow_growth);
  void split_locked(block* b, std::size_t rounded);
  void free_block_locked(block* b);           // to its pool, merging free neighbours
  block* merge_locked(block* dst, block* src); // src follows or precedes dst; returns survivor
  void process_events_locked();
  void retire_pending_locked(block* b);
  event_handle get_event_locked();
  void put_event_locked(event_handle e) { free_events_.push_back(e); }
  void note_use_locked(segment* seg, stream_handle stream);
  std::string oom_message_locked(std::size_t size, std::size_t rounded, stream_handle stream);
  std::size_t largest_free_locked() const;
  [[noreturn]] void throw_invalid_pointer_locked(const void* ptr, const char* what) const;
  void deallocate_impl(void* ptr, const stream_handle* stream);

  // ---- release.cpp -------------------------------------------------------------------------
  std::vector<stream_handle> fence_streams_locked(const segment* seg) const;
  release_batch collect_releasable_locked();
  void record_fence_locked(release_batch& batch);
  bool fence_done_locked(const release_batch& batch);
  // Waits (host) on the batch's fence; called without the lock.
  void wait_fence_unlocked(release_batch& batch);
  // Gives the batch's memory back; called with lk locked, drops it around driver calls.
  std::size_t release_batch_memory(std::unique_lock<std::mutex>& lk, release_batch& batch);
  std::size_t finish_deferred(std::unique_lock<std::mutex>& lk, bool wait);
  std::size_t release_cached(std::unique_lock<std::mutex>& lk, empty_cache_mode mode);
  void destroy_all();
};

}  // namespace streamsafe
