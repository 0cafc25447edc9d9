// Test support for the whole-segment rule (options::whole_segment_split_ratio): its options,
// idle whole segments cached on a stream, and whether a block lies inside a segment.
#pragma once

#include "support/sim_fixture.hpp"

#include <cstddef>

namespace streamsafe::test {

// whole_segment_split_ratio `ratio`, under a memory limit of `limit_bytes` (0: none).
inline options with_ratio(std::size_t ratio, std::size_t limit_bytes = 0) {
  options o;
  o.whole_segment_split_ratio = ratio;
  o.memory_limit_bytes = limit_bytes;
  return o;
}

inline bool inside(const void* p, const void* seg, std::size_t seg_bytes) {
  return addr(p) >= addr(seg) && addr(p) < addr(seg) + seg_bytes;
}

// Two segments of `bytes` each, allocated on s and freed: whole, idle, cached.
inline void cache_two_segments(sim_env& env, stream_handle s, std::size_t bytes) {
  void* a = env.alloc.allocate(bytes, s);
  void* b = env.alloc.allocate(bytes, s);
  env.alloc.deallocate(a);
  env.alloc.deallocate(b);
}

}  // namespace streamsafe::test
