// streamsafe core: the growth hook of the expandable backend (growth_hook.hpp has the calls,
// growth_policy.cpp numbers the steps they serve). Each pool reserves an address range once and
// maps chunks into it: a growth maps the chunks the request lacks; past the peak, the idle
// chunks of every pool (large pools only for a small request) are queued behind a fence, up to
// the growth's excess, and mapped again into the growing pool by alias (reclaim.cpp), as queued
// memory of another pool is at step 1 and the free chunks of every pool are at the limit; those
// whose fence streams are idle go back to the driver instead. The class is this file's alone
// (growth_hook::for_expandable makes it). mu_ held throughout; the growing pool's stream lock
// too, dropped only where said.
#include "core/blocks/size_classes.hpp"
#include "core/common/logging.hpp"
#include "core/growth/growth_hook.hpp"
#include "core/streams/stream_lock_drop.hpp"

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>

namespace streamsafe {

namespace {
// Idle bytes below which a growth past the peak is not worth a release fence (one event per
// stream): PyTorch's large segment, the default chunk.
constexpr std::size_t k_min_idle_release_bytes = detail::k_large_segment_bytes;
}  // namespace

struct caching_allocator::impl::expandable_growth final : growth_hook {
  std::size_t growth_bytes_locked(const impl& m, const pool& p, std::size_t rounded) const override
      STREAMSAFE_REQUIRES(m.mu_) {
    std::size_t bytes = 0;
    planned_growth_locked(m, p, rounded, &bytes);
    return bytes;
  }

  block* grow_locked(impl& m, pool& p, std::size_t rounded) override STREAMSAFE_REQUIRES(m.mu_) {
    return m.expandable_fit_locked(p, rounded);
  }

  void prepare_growth_locked(impl& m, stream_state& st, pool& p) override
      STREAMSAFE_REQUIRES(m.mu_, st.mu) {}  // nothing: the idle chunks are found when needed

  // When the growth maps past the peak and idle memory elsewhere is worth a release fence.
  bool makes_room_first_locked(const impl& m, const pool& p, std::size_t rounded) const override
      STREAMSAFE_REQUIRES(m.mu_) {
    const block* extended = nullptr;
    if (growth_excess_locked(m, p, rounded, &extended) == 0) return false;
    // Reserved but not allocated, less the block the growth extends and what is queued already:
    // an upper bound of the whole free chunks elsewhere (other pools' blocks are not looked at
    // without their locks).
    std::int64_t allocated = 0;
    for (auto& [s, state] : m.streams_.states) allocated += state->mirror.allocated_total();
    const std::int64_t idle = m.stats_.reserved_bytes.current - allocated -
                              static_cast<std::int64_t>(extended ? extended->size : 0) -
                              static_cast<std::int64_t>(m.queued_release_bytes_locked());
    return idle >= static_cast<std::int64_t>(k_min_idle_release_bytes);
  }

  // Idle chunks queued behind a fence; those whose fence streams are idle now go back to the
  // driver (measured on the corpus: mapping them again instead keeps their old addresses, and
  // what they later give back, in the queue), the rest are reclaimed behind a device-side wait.
  block* grow_after_room_locked(impl& m, device_lock& dlk, detail::unique_lock<stream_lock>& slk,
                                stream_state& st, pool& p, std::size_t rounded) override
      STREAMSAFE_REQUIRES(m.mu_, st.mu) {
    const block* keep = nullptr;
    const std::size_t excess = growth_excess_locked(m, p, rounded, &keep);
    {
      detail::stream_lock_dropped dropped(slk, st);
      m.queue_idle_chunks_locked(keep, p.small, excess);
      try {
        m.release_completed_locked(dlk, true);
      } catch (const std::exception& e) {
        detail::log().warn("device {}: giving idle chunks back before growing failed: {}",
                           m.backend_.device(), e.what());
      }
    }
    block* b = m.reclaim_by_alias_locked(p, rounded);
    return b ? b : m.find_block_locked(st, p, rounded, true);
  }

  // Queued chunks of any pool mapped again into p's range, nothing mapped anew past the peak;
  // as the last resort, what they lack mapped anew within the limit.
  block* reclaim_queued_locked(impl& m, pool& p, std::size_t rounded, bool* in_flight) override
      STREAMSAFE_REQUIRES(m.mu_) {
    return m.reclaim_by_alias_locked(p, rounded, true, in_flight);
  }
  block* reclaim_queued_last_resort_locked(impl& m, pool& p, std::size_t rounded) override
      STREAMSAFE_REQUIRES(m.mu_) {
    return m.reclaim_by_alias_locked(p, rounded);
  }

  // The free chunks of every pool, up to the growth's excess, queued and reclaimed by alias.
  block* take_from_other_pools_locked(impl& m, detail::unique_lock<stream_lock>& slk,
                                      stream_state& st, pool& p, std::size_t rounded) override
      STREAMSAFE_REQUIRES(m.mu_, st.mu) {
    const block* keep = nullptr;
    const std::size_t excess = growth_excess_locked(m, p, rounded, &keep);
    {
      detail::stream_lock_dropped dropped(slk, st);
      m.queue_idle_chunks_locked(keep, false, excess);
    }
    return m.reclaim_by_alias_locked(p, rounded);
  }

  // Chunks mapped into p's range; a side stream's into a range reserved for it.
  block* new_memory_locked(impl& m, pool& p, std::size_t rounded, stream_handle side) override
      STREAMSAFE_REQUIRES(m.mu_) {
    return m.expandable_fit_locked(p, rounded, side);
  }

  bool supports_pause() const noexcept override { return true; }

 private:
  // The block of p's range a growth maps (null: a fresh range) and *bytes, the bytes it maps.
  const block* planned_growth_locked(const impl& m, const pool& p, std::size_t rounded,
                                     std::size_t* bytes) const STREAMSAFE_REQUIRES(m.mu_) {
    const block* choice = p.expandable ? m.choose_unmapped_locked(p, rounded, *bytes, false)
                                       : nullptr;
    if (!choice) *bytes = detail::round_up(rounded, m.limits_.small_chunk_bytes);
    return choice;
  }

  // The bytes that growth maps beyond peak reserved (0: none), and the free mapped block it
  // extends (null: none).
  std::size_t growth_excess_locked(const impl& m, const pool& p, std::size_t rounded,
                                   const block** extended) const STREAMSAFE_REQUIRES(m.mu_) {
    std::size_t map_bytes = 0;
    const block* choice = planned_growth_locked(m, p, rounded, &map_bytes);
    const block* prev = choice ? choice->prev : nullptr;
    *extended = prev && prev->state == block_state::free && prev->mapped ? prev : nullptr;
    return m.growth_room_locked().excess_over_peak(map_bytes);
  }
};

std::unique_ptr<caching_allocator::impl::growth_hook>
caching_allocator::impl::growth_hook::for_expandable() {
  return std::make_unique<expandable_growth>();
}

}  // namespace streamsafe
