// streamsafe core: a pool, the free blocks of one stream for one size class (internal).
// Guarded by the owning stream's lock.
#pragma once

#include "core/blocks/block.hpp"
#include "core/blocks/free_lists.hpp"

namespace streamsafe::detail {

// Quick cache: blocks freed on the pool's stream, parked unmerged per size class (LIFO, at most
// k_quick_depth each), so that a free followed by an allocation of the same size costs no split
// and no merge. A miss of the pool flushes it back into the free lists.
struct quick_cache {
  static constexpr int k_quick_depth = 8;
  block* heads[free_lists::k_classes] = {};
  std::uint8_t depth[free_lists::k_classes] = {};
  std::size_t count = 0;

  bool push(block* b) noexcept {
    const int c = free_lists::class_of(b->size);
    if (depth[c] >= k_quick_depth) return false;
    b->free_next = heads[c];
    heads[c] = b;
    ++depth[c];
    ++count;
    return true;
  }
  // The block on top of the class of `size` if it has exactly that size, else nullptr.
  block* pop(std::size_t size) noexcept {
    const int c = free_lists::class_of(size);
    block* b = heads[c];
    if (!b || b->size != size) return nullptr;
    heads[c] = b->free_next;
    b->free_next = nullptr;
    --depth[c];
    --count;
    return b;
  }
  template <class F>
  void drain(F&& f) {
    if (!count) return;
    for (int c = 0; c < free_lists::k_classes && count; ++c) {
      while (block* b = heads[c]) {
        heads[c] = b->free_next;
        b->free_next = nullptr;
        --depth[c];
        --count;
        f(b);
      }
    }
  }
  template <class F>
  void for_each(F&& f) const {
    for (int c = 0; c < free_lists::k_classes; ++c) {
      for (block* b = heads[c]; b; b = b->free_next) f(b);
    }
  }
};

struct pool {
  stream_handle stream = 0;
  bool small = false;
  std::uint32_t tag = 0;  // the tag whose memory the pool holds (core/sleep.hpp; 0: untagged)
  free_lists mapped;      // free blocks backed by memory
  quick_cache quick;      // freed blocks parked for same-size reuse (state quick_cached)
  free_set unmapped;      // free address space of expandable segments (slow path only)
  segment* expandable =
      nullptr;            // this pool's first expandable segment (it may reserve more), if any
  void* state = nullptr;  // the stream_state owning this pool (stream_state.hpp)
};

}  // namespace streamsafe::detail
