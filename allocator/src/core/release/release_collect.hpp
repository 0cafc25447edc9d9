// streamsafe core: what a release collects (internal; release_collect.cpp defines it): whole
// free segments and whole free chunks detached into a release_batch, and the streams its fence
// covers. Calls only the layers beneath it (blocks/block_layer.hpp has the chain). Every
// function here runs with the device lock (mu_) held.
#pragma once

#include "core/streams/stream_layer.hpp"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace streamsafe::detail {

struct release_collect_layer : stream_layer {
  using stream_layer::stream_layer;

  std::vector<stream_handle> fence_streams_locked(const segment* seg) const
      STREAMSAFE_REQUIRES(mu_);
  void add_fence_streams_locked(release_batch& batch, const segment* seg) const
      STREAMSAFE_REQUIRES(mu_);
  void detach_whole_segment_locked(release_batch& batch, segment* seg)
      STREAMSAFE_REQUIRES(mu_);  // a free cuda_malloc segment
  static std::size_t forget_chunks(segment* seg, std::uintptr_t addr, std::size_t bytes);
  static bool whole_chunk_run(const segment* seg, std::uintptr_t addr, std::size_t bytes);
  static bool whole_chunks_of(const segment* seg, const block* b, std::uintptr_t& lo,
                              std::uintptr_t& hi);
  bool detach_free_chunks_locked(release_batch& batch, segment* seg, const block* keep)
      STREAMSAFE_REQUIRES(mu_);
  release_batch collect_releasable_locked(bool released_graphs_only = false,
                                          const tag_id* only_tag = nullptr)
      STREAMSAFE_REQUIRES(mu_);
  void collect_segment_locked(release_batch& batch, segment* seg, bool released_graphs_only,
                              const tag_id* only_tag) STREAMSAFE_REQUIRES(mu_);
};

}  // namespace streamsafe::detail
