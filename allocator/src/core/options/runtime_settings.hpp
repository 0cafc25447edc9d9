// streamsafe core: the options a program may change while the allocator runs (internal).
//
// max_split_size, garbage_collection_threshold, roundup_power2_divisions and
// graph_capture_record_stream_reuse (runtime_options), held in atomics: allocate reads them with
// relaxed loads, without a lock; set_runtime_options (runtime_options.cpp) writes them under the
// device lock, so that two writers never interleave their entries. A concurrent allocation sees
// each option's old or new value; the blocks already cached are not touched.
#pragma once

#include "core/blocks/size_classes.hpp"

#include <streamsafe/core/options.hpp>

#include <array>
#include <atomic>
#include <cstddef>

namespace streamsafe::detail {

struct runtime_settings {
  explicit runtime_settings(const runtime_options& r) noexcept { store(r); }

  std::atomic<std::size_t> max_split_size_bytes{0};
  std::atomic<double> garbage_collection_threshold{0};
  std::atomic<bool> rounds{false};  // some interval has more than one division
  std::atomic<bool> graph_capture_record_stream_reuse{true};
  std::array<std::atomic<std::size_t>, power2_divisions::k_intervals> divisions{};

  void store(const runtime_options& r) noexcept {
    max_split_size_bytes.store(r.max_split_size_bytes, std::memory_order_relaxed);
    garbage_collection_threshold.store(r.garbage_collection_threshold, std::memory_order_relaxed);
    for (std::size_t i = 0; i < divisions.size(); ++i)
      divisions[i].store(r.roundup_power2_divisions.by_interval[i], std::memory_order_relaxed);
    rounds.store(r.roundup_power2_divisions.any(), std::memory_order_relaxed);
    graph_capture_record_stream_reuse.store(r.graph_capture_record_stream_reuse,
                                            std::memory_order_relaxed);
  }

  runtime_options load() const noexcept {
    runtime_options r;
    r.max_split_size_bytes = max_split_size_bytes.load(std::memory_order_relaxed);
    r.garbage_collection_threshold = garbage_collection_threshold.load(std::memory_order_relaxed);
    for (std::size_t i = 0; i < divisions.size(); ++i)
      r.roundup_power2_divisions.by_interval[i] = divisions[i].load(std::memory_order_relaxed);
    r.graph_capture_record_stream_reuse = graph_capture_record_stream_reuse.load(
        std::memory_order_relaxed);
    return r;
  }

  // The request's rounded size: one relaxed load when no interval rounds.
  std::size_t round(std::size_t size_bytes) const noexcept {
    if (!rounds.load(std::memory_order_relaxed)) return round_request(size_bytes);
    const std::size_t d = divisions[power2_divisions::interval_of(size_bytes)].load(
        std::memory_order_relaxed);
    return round_power2_divisions(size_bytes, d);
  }
};

}  // namespace streamsafe::detail
