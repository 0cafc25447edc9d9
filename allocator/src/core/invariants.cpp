// streamsafe core: check_invariants, one checker per structure.
//
// Checked: the segments (blocks tile them; each block in the one place its state allows: free
// lists, quick cache, active map, pending list, a release batch), the pools' free lists and
// unmapped sets, the quick caches, the active maps, the pending lists, the segments being
// released, the frees held by a graph capture, and the statistics against the blocks (reserved
// bytes and segments for every pool and for each kind, small and large).
// Locks: the device lock and every stream lock, held for the whole check.
#include "core/allocator_impl.hpp"
#include "core/blocks/size_classes.hpp"
#include "core/common/format.hpp"

#include <algorithm>
#include <array>
#include <unordered_map>

namespace streamsafe {

using detail::hex;

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::logic_error("streamsafe invariant violated: " + what);
}

}  // namespace

// What the walk of the segments found, against what the other structures hold.
struct detail::diagnostics_layer::census {
  std::int64_t reserved_bytes = 0, allocated_bytes = 0, active_bytes = 0;  // from the blocks
  // By pool kind (detail::kind_of: small, large; [k_all] unused): mapped bytes and segments.
  std::array<std::int64_t, detail::k_kinds> kind_reserved_bytes{}, kind_segments{};
  std::int64_t stat_allocated_bytes = 0, stat_active_bytes = 0;  // from the statistics
  std::size_t free_blocks = 0, active_blocks = 0, pending_blocks = 0, quick_cached_blocks = 0,
              held_blocks = 0;
  std::size_t free_list_blocks = 0, quick_cache_blocks = 0, pending_list_blocks = 0,
              active_map_blocks = 0;

  // A segment's mapped bytes, in every pool and in its kind.
  void count_segment(const segment* seg) noexcept {
    const auto mapped = static_cast<std::int64_t>(seg->mapped_bytes);
    reserved_bytes += mapped;
    kind_reserved_bytes[detail::kind_of(seg->small)] += mapped;
    ++kind_segments[detail::kind_of(seg->small)];
  }
};

// A block's state against where it is.
void detail::diagnostics_layer::check_block_locked(const block* b, census& c) const {
  const segment* seg = b->seg;
  const bool in_mapped = detail::free_lists::contains(b);
  const bool in_unmapped = seg->owner->unmapped.count(const_cast<block*>(b)) != 0;
  const bool in_pool = b->mapped ? in_mapped : in_unmapped;
  if (b->mapped && in_unmapped) fail("mapped block in the unmapped set");
  if (b->pending_linked != (b->state == block_state::pending_free))
    fail("block " + hex(b->addr) + ": its pending-list link disagrees with its state");
  const stream_state& owner = state_of(*seg->owner);
  const auto bytes = static_cast<std::int64_t>(b->size);
  switch (b->state) {
    case block_state::free:
      ++c.free_blocks;
      if (!in_pool) fail("free block " + hex(b->addr) + " missing from its pool");
      if (b->next && b->next->state == block_state::free && b->next->mapped == b->mapped)
        fail("two free neighbours not merged at " + hex(b->addr));
      break;
    case block_state::active:
      if (in_pool || in_mapped) fail("active block " + hex(b->addr) + " is in a free pool");
      if (owner.active.find(b->addr) != b)
        fail("active block missing from its stream's active map");
      c.allocated_bytes += bytes;
      c.active_bytes += bytes;
      ++c.active_blocks;
      if (!b->mapped) fail("active block is unmapped");
      break;
    case block_state::pending_free:
      if (in_pool || in_mapped) fail("pending block in a free pool");
      c.active_bytes += bytes;
      ++c.pending_blocks;
      break;
    case block_state::releasing:
      if (in_pool || in_mapped) fail("releasing block in a free pool");
      // An address of memory another pool reclaimed (reclaim.cpp): counted there.
      if (b->aliased) {
        const std::int64_t elsewhere = bytes - static_cast<std::int64_t>(b->ghost_owned);
        c.reserved_bytes -= elsewhere;
        c.kind_reserved_bytes[detail::kind_of(seg->small)] -= elsewhere;
      }
      break;
    case block_state::quick_cached:
      if (in_pool || in_mapped)
        fail("quick-cached block " + hex(b->addr) + " is also in the free lists");
      if (!b->mapped) fail("quick-cached block is unmapped");
      if (owner.active.find(b->addr) != b)
        fail("quick-cached block " + hex(b->addr) + " missing from its stream's active map");
      ++c.quick_cached_blocks;
      break;
  }
  c.held_blocks += b->free_held ? 1 : 0;
}

// A segment's tiling and mapping.
void detail::diagnostics_layer::check_segment_locked(std::uintptr_t key, const segment* seg,
                                                     census& c) const {
  if (seg->base != key) fail("segment map key differs from its base");
  std::uintptr_t expect = seg->base;
  std::size_t mapped = 0;
  for (const block* b = seg->first; b; b = b->next) {
    if (b->addr != expect)
      fail("blocks do not tile segment " + hex(seg->base) + " at " + hex(b->addr));
    if (b->seg != seg) fail("block " + hex(b->addr) + " points at another segment");
    if (b->next && b->next->prev != b) fail("broken prev link after " + hex(b->addr));
    if (b->size == 0 || b->size % detail::k_min_block_bytes != 0)
      fail("block size not a multiple of 512");
    if (b->mapped) mapped += b->size;
    if (!seg->expandable && !b->mapped) fail("unmapped block in a cuda_malloc segment");
    check_block_locked(b, c);
    expect += b->size;
  }
  if (expect != seg->base + seg->size) fail("blocks do not cover segment " + hex(seg->base));
  if (mapped != seg->mapped_bytes + seg->paused_bytes)
    fail("mapped bytes of segment " + hex(seg->base) + " disagree");
  if (seg->paused_bytes != 0 && !seg->paused)
    fail("segment " + hex(seg->base) + " has paused bytes but is not paused");
  c.count_segment(seg);
}

// A pool's free lists, unmapped set and quick cache.
void detail::diagnostics_layer::check_pool_locked(const pool& p, census& c) const {
  c.free_list_blocks += p.mapped.size() + p.unmapped.size();
  p.mapped.for_each([&](const block* b) {
    if (b->seg->owner != &p || !b->mapped || b->state != block_state::free)
      fail("pool holds a foreign or non-free block");
  });
  for (const block* b : p.unmapped) {
    if (b->seg->owner != &p || b->mapped || b->state != block_state::free)
      fail("unmapped pool holds a bad block");
  }
  std::size_t in_quick = 0;
  p.quick.for_each([&](const block* b) {
    ++in_quick;
    if (b->seg->owner != &p || b->state != block_state::quick_cached)
      fail("quick cache holds a foreign or non-quick-cached block");
  });
  if (in_quick != p.quick.count) fail("quick cache count disagrees");
  c.quick_cache_blocks += in_quick;
}

// A stream's pools, active map and counters.
void detail::diagnostics_layer::check_stream_locked(const stream_state& st, census& c) const {
  check_pool_locked(st.small_pool, c);
  check_pool_locked(st.large_pool, c);
  for (const auto& tp : st.tagged) {
    check_pool_locked(tp->small_pool, c);
    check_pool_locked(tp->large_pool, c);
  }
  c.pending_list_blocks += st.pending.size() + st.unfenced.size();
  c.active_map_blocks += st.active.size();
  st.active.for_each([&](const block* b) {
    if (&state_of(*b->seg->owner) != &st ||
        (b->state != block_state::active && b->state != block_state::quick_cached))
      fail("active map holds a block of another stream, or one neither active nor quick-cached");
  });
  const detail::stream_kind_stats& all = st.stats.by[detail::k_all];
  c.stat_allocated_bytes += all.allocated_bytes.current;
  c.stat_active_bytes += all.allocated_bytes.current + all.pending_bytes.current;
  if (st.mirror.allocated_total() != all.allocated_bytes.current ||
      st.mirror.pending_total() != all.pending_bytes.current)
    fail("allocated or pending mirror disagrees");
  const detail::stream_kind_stats& small = st.stats.by[detail::kind_of(true)];
  const detail::stream_kind_stats& large = st.stats.by[detail::kind_of(false)];
  if (small.allocation.current + large.allocation.current != all.allocation.current ||
      small.requested_bytes.current + large.requested_bytes.current !=
          all.requested_bytes.current ||
      small.pending.current + large.pending.current != all.pending.current)
    fail("a stream's small and large pool counters do not add up to its total");
}

void detail::diagnostics_layer::check_releasing_segments_locked(census& c) const {
  for (const segment* seg :
       releases_.releasing_segments) {  // being freed with mu_ dropped (release.cpp)
    if (seg->expandable || seg->first->next || seg->first->state != block_state::releasing)
      fail("segment " + hex(seg->base) +
           " out of the segment map is not a whole segment being released");
    c.count_segment(seg);
  }
}

void detail::diagnostics_layer::check_held_frees_locked(const census& c) const {
  for (const auto& h : capture_.held_frees) {
    if (h.b->state != block_state::active || !h.b->free_held)
      fail("a free held during a capture is not an active held block");
  }
  if (c.held_blocks != capture_.held_frees.size())
    fail("held frees disagree with the blocks marked held");
}

// The counts and the statistics agree.
void detail::diagnostics_layer::check_census_locked(const census& c) const {
  if (c.free_list_blocks != c.free_blocks) fail("pools hold blocks that are not in any segment");
  if (c.quick_cache_blocks != c.quick_cached_blocks)
    fail("quick caches hold blocks that are not in any segment");
  if (c.pending_blocks != c.pending_list_blocks) fail("pending lists disagree with pending blocks");
  if (c.active_blocks + c.quick_cached_blocks != c.active_map_blocks)
    fail("active maps hold blocks not in any segment");
  if (c.reserved_bytes != stats_.reserved_bytes.current)
    fail("reserved bytes statistic " + std::to_string(stats_.reserved_bytes.current) +
         " disagrees with segments " + std::to_string(c.reserved_bytes));
  std::int64_t segments = 0;
  for (const bool small : {true, false}) {
    const std::size_t k = detail::kind_of(small);
    const pool_statistics& ks = detail::kind_stats(stats_, k);
    const char* kind = small ? "small" : "large";
    if (c.kind_reserved_bytes[k] != ks.reserved_bytes.current)
      fail(std::string(kind) + " pool reserved bytes statistic " +
           std::to_string(ks.reserved_bytes.current) + " disagrees with its segments " +
           std::to_string(c.kind_reserved_bytes[k]));
    if (c.kind_segments[k] != ks.segment.current)
      fail(std::string(kind) + " pool segment statistic " + std::to_string(ks.segment.current) +
           " disagrees with its segments " + std::to_string(c.kind_segments[k]));
    segments += c.kind_segments[k];
  }
  if (segments != stats_.segment.current)
    fail("segment statistic " + std::to_string(stats_.segment.current) +
         " disagrees with the segments " + std::to_string(segments));
  if (c.allocated_bytes != c.stat_allocated_bytes)
    fail("allocated bytes statistic disagrees with blocks");
  if (c.active_bytes != c.stat_active_bytes) fail("active bytes statistic disagrees with blocks");
}

void caching_allocator::check_invariants() const {
  const impl& m = *impl_;
  detail::lock_guard<detail::mutex> dlk(m.mu_);
  std::vector<std::unique_lock<stream_lock>> locks;
  for (auto& [h, st] : m.streams_.states) locks.emplace_back(st->mu);
  impl::census c;
  for (auto& [base, seg] : m.streams_.segments) m.check_segment_locked(base, seg, c);
  for (auto& [h, st] : m.streams_.states) {
    detail::assume_held(st->mu);  // locked above, in `locks`
    m.check_stream_locked(*st, c);
  }
  m.check_releasing_segments_locked(c);
  m.check_held_frees_locked(c);
  m.check_ipc_locked();
  m.check_census_locked(c);
  m.check_dead_streams_locked();
}

// Destroyed and retired stream states.
void detail::diagnostics_layer::check_dead_streams_locked() const {
  // Each state's segment count; destroyed streams are in streams_.states and streams_.dead alike;
  // the tombstone is one event; retired states are out of streams_.states, own nothing, name no
  // stream.
  std::unordered_map<const stream_state*, std::size_t> owned;
  for (auto& [base, seg] : streams_.segments) ++owned[&state_of(*seg->owner)];
  for (const segment* seg : releases_.releasing_segments) ++owned[&state_of(*seg->owner)];
  std::size_t dead = 0;
  for (auto& [h, st] : streams_.states) {
    if (owned[st.get()] != st->segments)
      fail("a stream's segment count disagrees with the segments");
    if (!st->alive.load(std::memory_order_acquire)) {
      ++dead;
      if (std::find(streams_.dead.begin(), streams_.dead.end(), st.get()) == streams_.dead.end()) {
        fail("destroyed stream " + hex(h) + " missing from the destroyed streams");
      }
    }
  }
  if (dead != streams_.dead.size()) fail("the destroyed streams disagree with the stream states");
  if (streams_.tombstones.size() > 1) fail("more than one tombstone");
  for (const auto& st : streams_.spare) {
    if (st->segments != 0 ||
        st->cache_key.load(std::memory_order_acquire) != detail::k_tombstone_stream) {
      fail("a retired stream state owns segments or names a stream");
    }
  }
}

}  // namespace streamsafe
