// streamsafe core: a growth takes memory back from the release queue of its own pool.
//
// empty_cache in defer mode queues what its fence does not yet cover (release.cpp): typically
// right after an optimizer step, whose kernels still run. When the next step allocates on the
// same stream before the fence completes, that memory would sit in the queue, reserved, while
// the pool maps or allocates as much again: reserved bytes double for as long as the fence is
// pending, and the driver is called twice for nothing. Instead, before growing, the smallest
// queued block of the growing pool that serves the request is taken out of its batch and goes
// back to the pool's free lists, as it was before empty_cache detached it. That is as safe as it
// was then: a block of a pool is reused on the pool's own stream in stream order, and its uses
// on other streams were settled when it was freed (pending events, record_stream); the fence
// only guards the unmap, which no longer happens. Blocks of another stream's pool are never
// taken (their reuse would need that stream's order). A batch left with no block is dropped and
// its fence events go back to the pool, as the release worker does with a batch it emptied.
// Locks: mu_ and the growing pool's stream lock, as for growth.
#include "allocator_impl.hpp"
#include "format.hpp"
#include "logging.hpp"

#include <algorithm>

namespace streamsafe {

block* caching_allocator::impl::reclaim_queued_locked(pool& p, std::size_t rounded) {
  if (capturing()) return nullptr;
  auto free_mapped = [](const block* b) {
    return b && b->state == block_state::free && b->mapped ? b->size : 0;
  };
  block* best = nullptr;
  auto from = releases_.deferred.end();
  for (auto it = releases_.deferred.begin(); it != releases_.deferred.end(); ++it) {
    for (block* b : it->blocks) {
      if (b->seg->owner != &p || b->seg->paused) continue;
      // Expandable: a chunk run merges back with the free pieces around it. cuda_malloc: a whole
      // segment, refused when the whole-segment rule would keep it whole for this request.
      const std::size_t serves = b->seg->expandable
                                     ? b->size + free_mapped(b->prev) + free_mapped(b->next)
                                     : (keeps_whole(b, rounded) ? 0 : b->size);
      if (serves < rounded) continue;
      if (!best || b->size < best->size) {
        best = b;
        from = it;
      }
    }
  }
  if (!best) return nullptr;
  auto& blocks = from->blocks;
  blocks.erase(std::find(blocks.begin(), blocks.end(), best));
  from->bytes -= best->size;
  releases_.deferred_bytes -= best->size;
  if (blocks.empty()) {
    for (auto& e : from->fence) {
      if (e.stream != detail::k_tombstone_stream) put_event(e.event);
    }
    releases_.deferred.erase(from);
  }
  stats_.release_reclaimed_bytes += best->size;
  detail::log().debug(
      "device {}: {} bytes at {} taken back from the release queue for a {} byte "
      "request on stream {}",
      backend_.device(), best->size, detail::hex(best->addr), rounded, detail::hex(p.stream));
  free_block_locked(best);
  return best_fit(p, rounded);
}

}  // namespace streamsafe
