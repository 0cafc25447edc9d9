// streamsafe core: the growth layer of caching_allocator::impl (internal; growth.cpp defines
// it): growth's mechanisms, new segments, address ranges and mapped chunks, and the move of a
// whole free segment between streams. When each is used is the growth policy's choice
// (growth_policy.cpp, in impl). Calls only the layers beneath it (blocks/block_layer.hpp has
// the chain). The device lock (mu_) and the growing pool's stream lock are held throughout.
#pragma once

#include "core/release/release_collect.hpp"

#include <cstddef>
#include <cstdint>

namespace streamsafe::detail {

struct growth_layer : release_collect_layer {
  using release_collect_layer::release_collect_layer;

  block* new_segment_locked(pool& p, std::size_t rounded) STREAMSAFE_REQUIRES(mu_);
  block* add_segment_locked(pool& p, std::uintptr_t base, std::size_t size, bool mapped)
      STREAMSAFE_REQUIRES(mu_);
  // side: 0, or a side stream joined into the capture of p's graph, whose growth maps only into
  // ranges of its own (segment::side_stream).
  block* choose_unmapped_locked(const pool& p, std::size_t rounded, std::size_t& map_bytes,
                                bool within_limit = true, stream_handle side = 0) const
      STREAMSAFE_REQUIRES(mu_);
  void reserve_range_locked(pool& p, std::size_t rounded, stream_handle side = 0)
      STREAMSAFE_REQUIRES(mu_);
  std::size_t large_chunk_for_locked(std::size_t bytes) const STREAMSAFE_REQUIRES(mu_);
  std::size_t map_chunks_locked(segment* seg, std::uintptr_t addr, std::size_t bytes,
                                std::size_t chunk, std::size_t fine_from = SIZE_MAX,
                                std::size_t fine = 0) STREAMSAFE_REQUIRES(mu_);
  block* expandable_fit_locked(pool& p, std::size_t rounded, stream_handle side = 0)
      STREAMSAFE_REQUIRES(mu_);
  block* cut_chunks_locked(block* b, std::size_t bytes) STREAMSAFE_REQUIRES(mu_);
  block* steal_segment_locked(pool& p, std::size_t rounded, bool whole_rule)
      STREAMSAFE_REQUIRES(mu_);
  block* move_segment_locked(segment* seg, pool& p) STREAMSAFE_REQUIRES(mu_);
};

}  // namespace streamsafe::detail
