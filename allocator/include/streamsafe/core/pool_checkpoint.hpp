// streamsafe: the checkpoint of a CUDA graph's private pool (caching_allocator::
// checkpoint_graph_pool / restore_graph_pool), what PyTorch's cudagraph trees
// (torch.compile mode="reduce-overhead") take after recording a graph and restore when they
// switch to another path of the tree.
//
// A checkpoint is the layout of the pool's segments: for each segment its base address, size
// and pool (small or large), and for each of its blocks, in address order, the address, the
// size and whether it was allocated (handed out and not freed) at the checkpoint. Free, cached,
// quick-cached and pending blocks all count as not allocated. An expandable segment's unmapped
// address space is listed as blocks not allocated, so that the blocks tile each segment.
// Restoring it frees every block of the pool allocated now and makes each allocated block of the
// checkpoint allocated again, at its address, with its size; the rest of the checkpoint's
// segments is free. pool_restore lists both, as PyTorch's CheckpointDelta does.
// Thread safety: plain values; no internal synchronisation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace streamsafe {

struct pool_checkpoint_block {
  std::uintptr_t address = 0;
  std::size_t size_bytes = 0;       // a multiple of 512
  std::size_t requested_bytes = 0;  // allocated: what its caller asked for; else 0
  bool allocated = false;
};

struct pool_checkpoint_segment {
  std::uintptr_t address = 0;
  std::size_t size_bytes = 0;  // address span (an expandable segment's reserved range)
  bool small = false;          // the small pool's (requests up to 1 MiB)
  bool expandable = false;
  std::vector<pool_checkpoint_block> blocks;  // address order, tiling the segment
};

struct pool_checkpoint {
  int device = 0;
  std::uint64_t graph = 0;  // the graph whose private pool it is (the id given at capture)
  std::vector<pool_checkpoint_segment> segments;  // address order

  std::size_t allocated_blocks() const noexcept {
    std::size_t n = 0;
    for (const auto& s : segments)
      for (const auto& b : s.blocks) n += b.allocated ? 1 : 0;
    return n;
  }
};

// What restore_graph_pool changed: the blocks it freed (allocated before, in address order)
// and those it allocated (the checkpoint's allocated blocks, in address order). A block
// allocated both before and in the checkpoint, at the same address and size, is in both.
struct pool_restore {
  std::vector<void*> freed;
  std::vector<void*> allocated;
};

}  // namespace streamsafe
