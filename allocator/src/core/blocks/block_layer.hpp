// streamsafe core: the block layer of caching_allocator::impl (internal; blocks.cpp defines it):
// fit, split and merge of blocks within one pool. impl is built as a chain of layers, each the
// functions of one concern over the shared state (allocator_state.hpp), each calling only the
// layers beneath it: this one, then streams/stream_layer.hpp, release/release_collect.hpp,
// stats/diagnostics_layer.hpp, then the coordinator (allocator_impl.hpp). Every function here
// needs the lock of the stream that owns the pool.
#pragma once

#include "core/allocator_state.hpp"

#include <cstddef>

namespace streamsafe::detail {

struct block_layer : allocator_state {
  using allocator_state::allocator_state;

  block* new_block(stream_state& st);
  void recycle_block(stream_state& st, block* b);
  block* best_fit(pool& p, std::size_t rounded) const;
  bool split_limit_refuses(const pool& p, const block* b, std::size_t rounded) const noexcept;
  bool keeps_whole(const block* b, std::size_t rounded) const noexcept;  // segment_fit.hpp
  bool idle_at_growth(const block* b, std::size_t rounded) const noexcept;
  block* fit_ignoring_whole_rule(pool& p, std::size_t rounded) const;  // at the memory limit
  void split_locked(block* b, std::size_t rounded);  // b's remainder, if worth a block
  block* split_off_locked(block* b, std::size_t offset);
  block* take_cached_fit_locked(pool& p, std::size_t rounded);  // quick cache, else best fit
  block* free_block_locked(block* b);         // to its pool, merging free neighbours
  block* merge_locked(block* lo, block* hi);  // address-adjacent; returns the survivor
  void flush_quick_locked(pool& p);
};

}  // namespace streamsafe::detail
