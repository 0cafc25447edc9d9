// streamsafe core: blocks, segments and pools (internal).
//
// A segment is memory held from the driver: a cudaMalloc allocation, or for an expandable
// segment a reserved virtual range of which some chunks are mapped. Its blocks tile it exactly,
// in address order (prev/next). A block is in one of four states:
//   free          in its pool's free set (mapped or unmapped set), reusable on the pool stream
//   active        handed out, in the allocator's active map
//   pending_free  freed by the host, waiting for events of other streams (pending list)
//   releasing     detached, behind a release fence, about to go back to the driver
//   quick_cached  freed on its own stream and parked, unmerged, in its pool's quick cache for
//                 reuse at the same size; merged back (flushed) on any pool miss and before a
//                 release
// Invariants (checked by caching_allocator::check_invariants): blocks tile their segment; two
// free neighbours with the same mapped state never coexist (they are merged; quick_cached blocks
// are not free in this sense); a block is in exactly one place (free lists, quick cache, active
// map, pending list or a release batch).
// Guarded by the lock of the stream that owns the block's segment (stream_state.hpp).
#pragma once

#include <streamsafe/backends/device_backend.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <vector>

namespace streamsafe::detail {

struct segment;
struct pool;

enum class block_state : std::uint8_t { free, active, pending_free, releasing, quick_cached };

struct pending_event {
  event_handle event = 0;
  stream_handle stream = 0;
};

inline constexpr std::uint32_t k_idle_proven = 1;  // block::idle_fence: its uses are done

// The stream of a pending_event that is a destroyed stream's tombstone (not pooled).
inline constexpr stream_handle k_tombstone_stream = ~stream_handle{0};

// Cache-line aligned: the fast path writes a block on every allocation and free, and blocks of
// streams used by different threads must not share a line (they may have been allocated one after
// the other by one thread).
struct alignas(64) block {
  std::uintptr_t addr = 0;
  std::size_t size = 0;       // bytes, a multiple of 512
  std::size_t requested = 0;  // bytes asked for (active blocks)
  segment* seg = nullptr;
  block* prev = nullptr;
  block* next = nullptr;
  block_state state = block_state::free;
  bool mapped = true;
  // A whole free cudaMalloc segment's idle proof (empty_cache.cpp, prove_idle_segments_locked):
  // 0 none, k_idle_proven every use it had has completed (it may go back to the driver without a
  // new fence), else the id of its stream's idle fence still pending. Cleared when allocated.
  std::uint32_t idle_fence = 0;
  std::vector<stream_handle> uses;    // recorded streams other than the segment's stream
  std::vector<pending_event> events;  // must complete before the block is reused
  // Links of the stream's pending list while pending_free (pending_list.hpp).
  block* pending_prev = nullptr;
  block* pending_next = nullptr;
  bool pending_linked = false;
  // pending_free when an empty_cache:defer call could not release it: a later reclaim() gives
  // back its memory once its events completed (empty_cache.cpp, release_after_pending_locked).
  bool release_after = false;
  // Links of the free list holding this block (free_lists.hpp); free_class < 0 when in none.
  block* free_prev = nullptr;
  block* free_next = nullptr;
  std::int16_t free_class = -1;
  bool free_held =
      false;  // active, but freed during a graph capture (capture.cpp: capture_state::held_frees)
  // IPC (ipc.cpp): exports of this block not finished (open, or released with the consumer's
  // event not yet seen complete); while non-zero a free is held (ipc_held).
  std::uint32_t ipc_exports = 0;
  bool ipc_held = false;  // active, but freed by the producer while exported (ipc.cpp)
  // releasing, expandable: its memory was reclaimed by another pool (reclaim.cpp, map_alias);
  // the unmap of this address gives nothing back, and its bytes count there, not here.
  bool aliased = false;
  std::uintptr_t alias_at = 0;  // aliased: where the memory is mapped now
  std::size_t ghost_owned = 0;  // aliased: bytes whose other mapping is gone (its to give back)
};

struct segment {
  std::uintptr_t base = 0;
  std::size_t size = 0;          // address span (the reserved range of an expandable segment)
  std::size_t mapped_bytes = 0;  // counted in reserved bytes
  stream_handle stream = 0;      // the pool's stream
  bool small = false;
  bool expandable = false;
  pool* owner = nullptr;
  // Expandable, in a CUDA graph's pool: non-zero for a range reserved for a side stream that
  // joined the pool's capture; only that stream's growth maps into it (one segment per pool and
  // stream, as PyTorch's allocator keeps), and other growth never does (growth.cpp).
  stream_handle side_stream = 0;
  block* first = nullptr;
  std::vector<stream_handle> used_streams;  // streams that used it since the last release
  // Sleep/wake (sleep.cpp): set from pause until resume; nothing else releases, moves or grows
  // into it meanwhile. paused_bytes: mapped blocks' bytes whose chunks pause gave back (their
  // blocks keep mapped = true: resume maps them again); not in mapped_bytes.
  bool paused = false;
  std::size_t paused_bytes = 0;
  // Expandable: the mapped chunks, start -> bytes, each one backend map (and unmapped only
  // whole). Chunks are multiples of the driver's granularity, not all of one size (growth.cpp).
  std::map<std::uintptr_t, std::size_t> chunks;
};

// Best-fit order: size, then address.
struct block_order {
  using is_transparent = void;
  using key = std::pair<std::size_t, std::uintptr_t>;
  bool operator()(const block* a, const block* b) const noexcept {
    return a->size != b->size ? a->size < b->size : a->addr < b->addr;
  }
  bool operator()(const block* a, const key& k) const noexcept {
    return a->size != k.first ? a->size < k.first : a->addr < k.second;
  }
  bool operator()(const key& k, const block* b) const noexcept {
    return k.first != b->size ? k.first < b->size : k.second < b->addr;
  }
};

using free_set = std::set<block*, block_order>;

}  // namespace streamsafe::detail
