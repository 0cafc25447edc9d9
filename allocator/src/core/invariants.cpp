// streamsafe core: check_invariants, one checker per structure.
//
// Checked: the segments (blocks tile them; each block in the one place its state allows: free
// lists, quick cache, active map, pending list, a release batch), the pools' free lists and
// unmapped sets, the quick caches, the active maps, the pending lists, the segments being
// released, the frees held by a graph capture, and the statistics against the blocks.
// Locks: the device lock and every stream lock, held for the whole check.
#include "allocator_state.hpp"
#include "format.hpp"
#include "size_classes.hpp"

namespace streamsafe {

using detail::hex;

void caching_allocator::check_invariants() const {
  const impl& m = *impl_;
  std::lock_guard<std::mutex> dlk(m.mu_);
  std::vector<std::unique_lock<stream_lock>> locks;
  for (auto& [h, st] : m.streams_) locks.emplace_back(st->mu);
  auto fail = [](const std::string& what) { throw std::logic_error("streamsafe invariant violated: " + what); };
  std::int64_t reserved = 0, allocated = 0, active = 0;
  std::size_t active_count = 0, free_seen = 0, pending_seen = 0, free_in_pools = 0, pending_total = 0,
              active_total = 0, cached_seen = 0, cached_in_pools = 0;
  for (auto& [base, seg] : m.segments_) {
    if (seg->base != base) fail("segment map key differs from its base");
    const impl::stream_state& owner = impl::state_of(*seg->owner);
    std::uintptr_t expect = seg->base;
    std::size_t mapped = 0;
    for (const block* b = seg->first; b; b = b->next) {
      if (b->addr != expect) fail("blocks do not tile segment " + hex(seg->base) + " at " + hex(b->addr));
      if (b->seg != seg) fail("block " + hex(b->addr) + " points at another segment");
      if (b->next && b->next->prev != b) fail("broken prev link after " + hex(b->addr));
      if (b->size == 0 || b->size % detail::k_min_block_bytes != 0) fail("block size not a multiple of 512");
      if (b->mapped) mapped += b->size;
      if (!seg->expandable && !b->mapped) fail("unmapped block in a cuda_malloc segment");
      const bool in_mapped = detail::free_lists::contains(b);
      const bool in_unmapped = seg->owner->unmapped.count(const_cast<block*>(b)) != 0;
      const bool in_pool = b->mapped ? in_mapped : in_unmapped;
      if (b->mapped && in_unmapped) fail("mapped block in the unmapped set");
      if (b->pending_linked != (b->state == block_state::pending_free))
        fail("block " + hex(b->addr) + ": its pending-list link disagrees with its state");
      switch (b->state) {
        case block_state::free:
          ++free_seen;
          if (!in_pool) fail("free block " + hex(b->addr) + " missing from its pool");
          if (b->next && b->next->state == block_state::free && b->next->mapped == b->mapped)
            fail("two free neighbours not merged at " + hex(b->addr));
          break;
        case block_state::active:
          if (in_pool || in_mapped) fail("active block " + hex(b->addr) + " is in a free pool");
          if (owner.active.find(b->addr) != b) fail("active block missing from its stream's active map");
          allocated += static_cast<std::int64_t>(b->size);
          active += static_cast<std::int64_t>(b->size);
          ++active_count;
          if (!b->mapped) fail("active block is unmapped");
          break;
        case block_state::pending_free:
          if (in_pool || in_mapped) fail("pending block in a free pool");
          active += static_cast<std::int64_t>(b->size);
          ++pending_seen;
          break;
        case block_state::releasing:
          if (in_pool || in_mapped) fail("releasing block in a free pool");
          break;
        case block_state::quick_cached:
          if (in_pool || in_mapped) fail("quick-cached block " + hex(b->addr) + " is also in the free lists");
          if (!b->mapped) fail("quick-cached block is unmapped");
          if (owner.active.find(b->addr) != b) fail("quick-cached block " + hex(b->addr) + " missing from its stream's active map");
          ++cached_seen;
          break;
      }
      expect += b->size;
    }
    if (expect != seg->base + seg->size) fail("blocks do not cover segment " + hex(seg->base));
    if (mapped != seg->mapped_bytes) fail("mapped bytes of segment " + hex(seg->base) + " disagree");
    reserved += static_cast<std::int64_t>(mapped);
  }
  std::int64_t stat_allocated = 0, stat_active = 0;
  for (auto& [h, st] : m.streams_) {
    for (const pool* p : {&st->small_pool, &st->large_pool}) {
      free_in_pools += p->mapped.size() + p->unmapped.size();
      p->mapped.for_each([&](const block* b) {
        if (b->seg->owner != p || !b->mapped || b->state != block_state::free) fail("pool holds a foreign or non-free block");
      });
      for (const block* b : p->unmapped) {
        if (b->seg->owner != p || b->mapped || b->state != block_state::free) fail("unmapped pool holds a bad block");
      }
      std::size_t in_quick = 0;
      p->quick.for_each([&](const block* b) {
        ++in_quick;
        if (b->seg->owner != p || b->state != block_state::quick_cached) fail("quick cache holds a foreign or non-quick-cached block");
      });
      if (in_quick != p->quick.count) fail("quick cache count disagrees");
      cached_in_pools += in_quick;
    }
    pending_total += st->pending.size();
    active_total += st->active.size();
    const impl::stream_state* owner_state = st.get();  // (clang 14: no lambda capture of a binding)
    st->active.for_each([&](const block* b) {
      if (&impl::state_of(*b->seg->owner) != owner_state ||
          (b->state != block_state::active && b->state != block_state::quick_cached))
        fail("active map holds a block of another stream, or one neither active nor quick-cached");
    });
    stat_allocated += st->stats.allocated_bytes.current;
    stat_active += st->stats.allocated_bytes.current + st->stats.pending_bytes.current;
    if (st->cur_allocated.load() != st->stats.allocated_bytes.current) fail("allocated mirror disagrees");
  }
  for (const segment* seg : m.releasing_segments_) {  // being freed with mu_ dropped (release.cpp)
    if (seg->expandable || seg->first->next || seg->first->state != block_state::releasing)
      fail("segment " + hex(seg->base) + " out of the segment map is not a whole segment being released");
    reserved += static_cast<std::int64_t>(seg->mapped_bytes);
  }
  std::size_t held_seen = 0;
  for (auto& [base, seg] : m.segments_) {
    for (const block* b = seg->first; b; b = b->next) held_seen += b->free_held ? 1 : 0;
  }
  for (const auto& h : m.held_frees_) {
    if (h.b->state != block_state::active || !h.b->free_held) fail("a free held during a capture is not an active held block");
  }
  if (held_seen != m.held_frees_.size()) fail("held frees disagree with the blocks marked held");
  if (free_in_pools != free_seen) fail("pools hold blocks that are not in any segment");
  if (cached_in_pools != cached_seen) fail("quick caches hold blocks that are not in any segment");
  if (pending_seen != pending_total) fail("pending lists disagree with pending blocks");
  if (active_count + cached_seen != active_total) fail("active maps hold blocks not in any segment");
  if (reserved != m.stats_.reserved_bytes.current) fail("reserved bytes statistic disagrees with segments");
  if (allocated != stat_allocated) fail("allocated bytes statistic disagrees with blocks");
  if (active != stat_active) fail("active bytes statistic disagrees with blocks");
}

}  // namespace streamsafe
