// streamsafe core: expandable backend, idle chunks unmapped before a growth past the peak.
//
// When mapping chunks for a request would raise peak reserved while at least 20 MiB is reserved
// but not allocated besides the free block the growth extends (less is not worth a fence), whole
// free chunks are unmapped first, behind their release fence, up to the bytes the growth exceeds
// the peak by: the new chunks take their place and the peak does not rise. The smallest free
// runs go first (the least likely to serve a later request), and no more chunks than the excess
// (fewer unmaps now, fewer maps again later). The free block the growth extends is kept. A
// small-pool growth takes only large pools' chunks. The fence is handled in the empty_cache
// mode (wait: the host waits on it; defer: what is busy is queued and the growth goes on). Below
// the peak growth costs nothing. Measured on the tuning half of the corpus (docs/observability.md,
// "Memory efficiency on the corpus").
#include "allocator_impl.hpp"
#include "logging.hpp"
#include "size_classes.hpp"

#include <algorithm>

namespace streamsafe {

namespace {
// Idle bytes below which a growth past the peak is not worth a release fence (one event per
// stream, and in wait mode a host wait on them): PyTorch's large segment, the default chunk.
constexpr std::size_t k_min_idle_release_bytes = detail::k_large_segment_bytes;
}  // namespace

std::size_t caching_allocator::impl::expandable_growth_excess_locked(const pool& p,
                                                                     std::size_t rounded,
                                                                     const block** extended) const {
  std::size_t map_bytes = 0;
  const block* choice = p.expandable ? choose_unmapped_locked(p, rounded, map_bytes) : nullptr;
  *extended = nullptr;
  if (!choice) {
    map_bytes = detail::round_up(rounded, limits_.small_chunk_bytes);  // a fresh range
  } else if (const block* prev = choice->prev;
             prev && prev->state == block_state::free && prev->mapped) {
    *extended = prev;
  }
  const auto reserved = static_cast<std::size_t>(stats_.reserved_bytes.current);
  const std::size_t peak = reserved_high_water_locked();
  return reserved + map_bytes > peak ? reserved + map_bytes - peak : 0;
}

bool caching_allocator::impl::expandable_growth_raises_peak_locked(const pool& p,
                                                                   std::size_t rounded) const {
  const block* extended = nullptr;
  if (expandable_growth_excess_locked(p, rounded, &extended) == 0) return false;
  // Reserved but not allocated, less the block the growth extends: an upper bound of the whole
  // free chunks elsewhere (other pools' blocks are not looked at without their locks).
  std::int64_t allocated = 0;
  for (auto& [s, state] : streams_.states)
    allocated += state->cur_allocated.load(std::memory_order_relaxed);
  const std::int64_t idle = stats_.reserved_bytes.current - allocated -
                            static_cast<std::int64_t>(extended ? extended->size : 0);
  return idle >= static_cast<std::int64_t>(k_min_idle_release_bytes);
}

std::size_t caching_allocator::impl::release_idle_chunks_before_growth(device_lock& lk,
                                                                       stream_state& st,
                                                                       std::size_t rounded) {
  detect_captures_locked(lk);
  if (capturing()) return 0;
  // A small-pool growth (2 MiB chunks) takes only large pools' free chunks, as they are: walking
  // and flushing the small pools for 2 MiB made random_allocations (10,000 live small blocks)
  // several times slower.
  const bool small = detail::is_small(rounded);
  if (!small) prepare_release_locked();
  const block* keep = nullptr;
  std::size_t excess = 0;
  {
    detail::lock_guard<stream_lock> slk(st.mu);
    excess = expandable_growth_excess_locked(pool_of(st, small), rounded, &keep);
  }
  if (excess == 0) return 0;
  // Every whole free chunk run is detached; the smallest are kept, chunk by chunk, up to the
  // excess, and the rest is merged back into its pool.
  release_batch all;
  for (auto& [base, seg] : streams_.segments) {
    stream_state& owner = state_of(*seg->owner);
    if (!seg->expandable || seg->paused || (small && seg->small) ||
        (owner.graph != 0 && !owner.graph_released))
      continue;  // sleep.cpp owns a paused segment's mapping
    detail::lock_guard<stream_lock> slk(owner.mu);
    detach_free_chunks_locked(all, seg, keep);
  }
  std::stable_sort(all.blocks.begin(), all.blocks.end(),
                   [](const block* a, const block* b) { return a->size < b->size; });
  release_batch chosen;
  release_batch rest;
  for (block* b : all.blocks) {
    if (chosen.bytes >= excess) {
      rest.blocks.push_back(b);
      continue;
    }
    // Of the last run taken, only the chunks that cover the excess.
    const std::size_t lacking = excess - chosen.bytes;
    if (b->size > lacking) {
      segment* seg = b->seg;
      detail::lock_guard<stream_lock> slk(state_of(*seg->owner).mu);  // guards seg->chunks
      std::uintptr_t cut = b->addr;
      for (auto it = seg->chunks.lower_bound(b->addr); cut - b->addr < lacking; ++it)
        cut = it->first + it->second;
      if (cut < b->addr + b->size) rest.blocks.push_back(split_off_locked(b, cut - b->addr));
    }
    chosen.blocks.push_back(b);
    chosen.bytes += b->size;
    add_fence_streams_locked(chosen, b->seg);
  }
  restore_batch_locked(rest);
  if (chosen.blocks.empty()) return 0;
  detail::log().debug(
      "device {}: unmapping {} bytes of idle chunks before a growth {} bytes past peak reserved",
      backend_.device(), chosen.bytes, excess);
  // In the empty_cache mode: wait mode waits on the fence (the chunks' last uses may still be
  // queued on the allocating stream itself), defer mode queues what is busy and grows.
  return release_collected(lk, chosen, opts_.empty_cache);
}

}  // namespace streamsafe
