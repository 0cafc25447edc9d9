// streamsafe core: fit, split and merge of blocks within one pool.
//
// Invariants (block.hpp): the blocks of a segment tile it in address order; two free neighbours
// with the same mapped state never coexist; a free block is in its pool's free lists (mapped)
// or unmapped set; a quick_cached block is in its pool's quick cache and its stream's active
// map, in no free list. Every function here needs the lock of the stream that owns the pool.
#include "core/blocks/block_layer.hpp"
#include "core/blocks/segment_fit.hpp"
#include "core/blocks/size_classes.hpp"

namespace streamsafe {

block* detail::block_layer::new_block(stream_state& st) {
  if (block* b = st.spare) {
    st.spare = b->next;
    // A fresh block, but the vectors keep their capacity: a recycled block recording a use or
    // an event allocates nothing.
    std::vector<stream_handle> uses = std::move(b->uses);
    std::vector<detail::pending_event> events = std::move(b->events);
    uses.clear();
    events.clear();
    *b = block{};
    b->uses = std::move(uses);
    b->events = std::move(events);
    return b;
  }
  return new block;
}

void detail::block_layer::recycle_block(stream_state& st, block* b) {
  b->next = st.spare;
  st.spare = b;
}

block* detail::block_layer::best_fit(pool& p, std::size_t rounded) const {
  block* b = p.mapped.find(rounded);
  if (!b) return nullptr;
  if (runtime_.max_split_size_bytes.load(std::memory_order_relaxed) != 0 &&
      split_limit_refuses(p, b, rounded))
    return nullptr;
  // A whole free segment far larger than the request stays whole (segment_fit.hpp): the best
  // block that may be split instead, if any. One compare for blocks close in size.
  if (b->size - rounded > detail::k_whole_segment_slack_bytes && keeps_whole(b, rounded)) {
    return p.mapped.find_if(rounded, [&](const block* x) {
      return !keeps_whole(x, rounded) && !split_limit_refuses(p, x, rounded);
    });
  }
  return b;
}

// max_split_size: b may not be split for a request of `rounded` bytes.
bool detail::block_layer::split_limit_refuses(const pool& p, const block* b,
                                              std::size_t rounded) const noexcept {
  const std::size_t max_split = runtime_.max_split_size_bytes.load(std::memory_order_relaxed);
  if (max_split == 0 || p.small || b->seg->expandable) return false;
  // Oversize blocks are never split, and serve only requests close to their size.
  if (rounded < max_split && b->size >= max_split) return true;
  return rounded >= max_split && b->size >= rounded + detail::k_large_segment_bytes;
}

bool detail::block_layer::keeps_whole(const block* b, std::size_t rounded) const noexcept {
  return !b->seg->expandable &&
         detail::keeps_segment_whole(b->size, rounded, opts_.whole_segment_split_ratio,
                                     !b->prev && !b->next);
}

// b is given back before a growth past the peak (segment_fit.hpp's rule).
bool detail::block_layer::idle_at_growth(const block* b, std::size_t rounded) const noexcept {
  // A whole free segment that the growth for `rounded` leaves unused: too small for it, or kept
  // whole by the rule. Given back before a growth past peak reserved (segment_fit.hpp).
  return !b->prev && !b->next && (b->size < rounded || keeps_whole(b, rounded));
}

block* detail::block_layer::fit_ignoring_whole_rule(pool& p, std::size_t rounded) const {
  block* b = p.mapped.find(rounded);
  return b && !split_limit_refuses(p, b, rounded) ? b : nullptr;
}

block* detail::block_layer::merge_locked(block* lo, block* hi) {
  lo->size += hi->size;
  lo->next = hi->next;
  if (hi->next) hi->next->prev = lo;
  recycle_block(state_of(*lo->seg->owner), hi);
  return lo;
}

block* detail::block_layer::free_block_locked(block* b) {
  b->state = block_state::free;
  b->requested = 0;
  b->uses.clear();
  pool& p = *b->seg->owner;
  auto remove = [&](block* x) {
    if (x->mapped) p.mapped.erase(x);
    else p.unmapped.erase(x);
  };
  if (block* prev = b->prev;
      prev && prev->state == block_state::free && prev->mapped == b->mapped) {
    remove(prev);
    b = merge_locked(prev, b);
  }
  if (block* next = b->next;
      next && next->state == block_state::free && next->mapped == b->mapped) {
    remove(next);
    b = merge_locked(b, next);
  }
  if (b->mapped) p.mapped.insert(b);
  else p.unmapped.insert(b);
  return b;
}

void detail::block_layer::split_locked(block* b, std::size_t rounded) {
  const std::size_t remaining = b->size - rounded;
  bool split = (b->seg->expandable || b->seg->small) ? remaining >= detail::k_min_block_bytes
                                                     : remaining > detail::k_small_request_bytes;
  const std::size_t max_split = runtime_.max_split_size_bytes.load(std::memory_order_relaxed);
  if (!b->seg->expandable && !b->seg->small && max_split != 0 && b->size >= max_split) {
    split = false;
  }
  if (!split) return;
  free_block_locked(
      split_off_locked(b, rounded));  // merges with a free follower of the same mapped state
}

block* detail::block_layer::split_off_locked(block* b, std::size_t offset) {
  block* rest = new_block(state_of(*b->seg->owner));
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

block* detail::block_layer::take_cached_fit_locked(pool& p, std::size_t rounded) {
  // An exact-size block from the quick cache; anything else is a best fit after the quick
  // cache is merged back, so that caching never costs fragmentation.
  if (block* b = p.quick.pop(rounded)) return b;
  if (p.quick.count) flush_quick_locked(p);
  return best_fit(p, rounded);
}

void detail::block_layer::flush_quick_locked(pool& p) {
  detail::active_map& parked = state_of(p).active;  // quick_cached blocks stay there while parked
  p.quick.drain([&](block* b) {
    parked.erase(b->addr);
    free_block_locked(b);
  });
}

}  // namespace streamsafe
