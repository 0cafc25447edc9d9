// streamsafe core: the release queue's state (internal): memory detached for release, and the
// fences that must complete first (release.cpp gives it back; release_worker.cpp polls it).
// Lock rule: impl::releases_ is GUARDED_BY(mu_), the device lock; every member is read and
// written under it. Blocks in a queued batch are detached (state releasing) and owned by no
// pool; their bytes still count as reserved until the driver call returns.
#pragma once

#include "core/blocks/block.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <utility>
#include <vector>

namespace streamsafe::detail {

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

// Memory detached for release, and the fence that must complete first.
struct release_batch {
  std::vector<block*> blocks;          // whole-segment blocks (cuda_malloc) or chunk runs
  std::vector<stream_handle> streams;  // the streams the fence covers
  std::vector<pending_event> fence;
  bool device_sync = false;
  std::size_t bytes = 0;
  std::uint64_t id = 0;  // identifies a queued batch across a wait without the lock
};

// A queued block (a run of chunks) and the batch that holds it (reclaim.cpp).
struct queued_run {
  std::deque<release_batch>::iterator batch;
  block* b;
};

struct release_queue {
  std::deque<release_batch> deferred;  // fenced batches waiting for their fence, oldest first
  std::size_t deferred_bytes = 0;      // the bytes of `deferred`
  std::uint64_t next_batch_id = 1;
  // cudaMalloc segments out of the segment map while free_segment runs without mu_ (release.cpp):
  // their one block is detached (releasing) and their bytes still count as reserved.
  std::vector<segment*> releasing_segments;
  // Blocks freed by a slow-path free with uses on other streams (pending_free, in their owner's
  // pending list with no events yet): the free made no backend call (it may run in a stream
  // callback, K16); fence_unfenced_locked (free.cpp) records their events from an ordinary call.
  std::vector<block*> unfenced;
  bool empty_cache_requested = false;  // empty_cache asked for in a stream callback
  // empty_cache:defer left blocks pending other streams' events (block::release_after): each
  // reclaim() releases what retired of them, until none is left (release.cpp).
  bool release_after_pending = false;
  // The old addresses of memory a pool reclaimed by mapping it again (reclaim.cpp): new
  // address range start -> its bytes, the queued aliased block at the old address (a "ghost")
  // and the address in the ghost's range of the memory mapped at the range's start. While a
  // ghost is mapped, unmapping the new address gives nothing back (it becomes the ghost's to
  // give back: block::ghost_owned).
  struct ghost_range {
    std::size_t bytes;
    block* ghost;
    std::uintptr_t from;
  };
  std::map<std::uintptr_t, ghost_range> ghosts;

  bool empty() const noexcept { return deferred.empty(); }
  std::size_t bytes() const noexcept { return deferred_bytes; }
};

}  // namespace streamsafe::detail
