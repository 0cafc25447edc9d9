// streamsafe core: the whole-segment rule of the cuda_malloc backend (internal).
//
// A free block that is a whole cudaMalloc segment (not split) does not serve a large request it
// exceeds more than `ratio` times and by more than 20 MiB: the segment stays whole for a request
// of its own size, and the request is served from the free remainder of a segment that is
// already split or from a new segment of its own. Remainders of split segments serve any
// request (best fit). Blocks within 20 MiB of the request always pass, so the check costs one
// compare on the allocation path; the rest runs only for such blocks. Why: a logits-sized free
// segment split for a long-lived activation stays split, and the next logits-sized request then
// needs a new segment (docs/observability.md, "Memory efficiency on the GPT-2 trace").
// Before a growth that would raise peak reserved, the whole free segments the rule refuses to
// the request, and those too small for it, go back to the driver (growth.cpp, release.cpp) when
// together they are at least a quarter of the new segment: they would otherwise sit idle at the
// new peak. A fence recorded then comes after the stream's newest work; the idle fence recorded
// one growth earlier (prove_idle_segments_locked) usually has completed by then, so requests
// that grow a little each step (K12) do not strand them. The rule gives way when a new segment
// would exceed
// the memory limit.
#pragma once

#include "core/blocks/size_classes.hpp"

#include <cstddef>

namespace streamsafe::detail {

// Free blocks at most this much larger than the request always pass (PyTorch's 20 MiB large
// segment: the same slack its max_split_size rule allows).
inline constexpr std::size_t k_whole_segment_slack_bytes = k_large_segment_bytes;
// Before a growth past peak reserved, idle whole segments go back when together they are at
// least this fraction (1 / divisor) of the new segment. Chosen on the tuning half of the corpus
// (docs/observability.md, "Memory efficiency on the corpus"): 1 (cover the whole new segment)
// leaves segments idle at the peak on variable shapes; releasing before every growth past the
// peak makes the fixed-shape GPT-2 trace give back and take again segments at every step.
inline constexpr std::size_t k_idle_release_divisor = 4;
// The largest accepted options::whole_segment_split_ratio (0 is off).
inline constexpr std::size_t k_max_whole_segment_ratio = 1024;

// True when a free block of `block_bytes` (a whole segment when `whole_segment`) must not be
// split for a request of `rounded` bytes. ratio 0: the rule is off.
inline constexpr bool keeps_segment_whole(std::size_t block_bytes, std::size_t rounded,
                                          std::size_t ratio, bool whole_segment) noexcept {
  return ratio != 0 && whole_segment && block_bytes - rounded > k_whole_segment_slack_bytes &&
         block_bytes / ratio >= rounded && block_bytes > rounded * ratio;
}

}  // namespace streamsafe::detail
