// streamsafe core: the growth hook of the cuda_malloc backend (growth_hook.hpp has the calls,
// growth_policy.cpp numbers the steps they serve). Memory comes and goes as whole cudaMalloc
// segments: a growth is a new segment (a large pool past the peak first takes another stream's
// whole free segment that fits and that the whole-segment rule would not keep whole; at the
// limit the rule gives way); past the peak, the whole free segments that rule refuses to the
// request go back first (proven idle ones at once, the rest behind a fence, queued); queued
// memory of another pool, and another stream's free memory at the limit, move over as whole
// segments. The class is this file's alone (growth_hook::for_cuda_malloc makes it). mu_ held
// throughout; the growing pool's stream lock too, dropped only where said.
#include "core/blocks/segment_fit.hpp"
#include "core/blocks/size_classes.hpp"
#include "core/common/logging.hpp"
#include "core/growth/growth_hook.hpp"
#include "core/streams/stream_lock_drop.hpp"

#include <exception>
#include <memory>

namespace streamsafe {

struct caching_allocator::impl::cuda_malloc_growth final : growth_hook {
  std::size_t growth_bytes_locked(const impl& m, const pool& p, std::size_t rounded) const override
      STREAMSAFE_REQUIRES(m.mu_) {
    return detail::segment_bytes_for(rounded);
  }

  block* grow_locked(impl& m, pool& p, std::size_t rounded) override STREAMSAFE_REQUIRES(m.mu_) {
    if (block* b = m.adopt_dead_segment_locked(p, rounded)) return b;
    block* b = nullptr;
    // A new large segment past peak reserved while another stream's large pool holds a whole
    // free segment that fits (and that the whole-segment rule would not keep whole for this
    // request: a few small blocks must not pin it): it moves to p behind an event wait.
    if (!p.small && m.growth_room_locked().raises_peak(detail::segment_bytes_for(rounded)))
      b = m.steal_segment_locked(p, rounded, true);
    if (!b) b = m.new_segment_locked(p, rounded);
    // At the memory limit the whole-segment rule gives way: split the best fit rather than fail.
    if (!b && m.opts_.whole_segment_split_ratio != 0) b = m.fit_ignoring_whole_rule(p, rounded);
    return b;
  }

  // K12: an idle fence ahead of the next growth (release_refused_segments gives back at once
  // what it proved idle).
  void prepare_growth_locked(impl& m, stream_state& st, pool& p) override
      STREAMSAFE_REQUIRES(m.mu_, st.mu) {
    if (!p.small && m.opts_.whole_segment_split_ratio != 0) m.prove_idle_segments_locked(st, p);
  }

  // A large pool under the whole-segment rule, past the peak and within the limit, when the
  // idle segments the rule refuses are a good part of the growth (worth the driver calls).
  bool makes_room_first_locked(const impl& m, const pool& p, std::size_t rounded) const override
      STREAMSAFE_REQUIRES(m.mu_) {
    if (p.small || m.opts_.whole_segment_split_ratio == 0) return false;
    // Below the peak growth costs nothing; at the limit the rule gives way (find_block_locked).
    if (!m.growth_room_locked().past_peak_within_limit(detail::segment_bytes_for(rounded)))
      return false;
    std::size_t idle = 0;
    p.mapped.for_each([&](const block* b) { idle += m.idle_at_growth(b, rounded) ? b->size : 0; });
    return idle >= detail::segment_bytes_for(rounded) / detail::k_idle_release_divisor;
  }

  // The refused whole free segments go back first (opportunistic: a failed release leaves its
  // memory in the pool); then the search again: the pool may have changed meanwhile.
  block* grow_after_room_locked(impl& m, device_lock& dlk, detail::unique_lock<stream_lock>& slk,
                                stream_state& st, pool& p, std::size_t rounded) override
      STREAMSAFE_REQUIRES(m.mu_, st.mu) {
    {
      detail::stream_lock_dropped dropped(slk, st);
      try {
        m.release_refused_segments(dlk, st, rounded);
      } catch (const std::exception& e) {
        detail::log().warn(
            "device {}: giving refused whole segments back before growing failed: {}",
            m.backend_.device(), e.what());
      }
    }
    return m.find_block_locked(st, p, rounded, true);
  }

  // A queued whole segment of another pool, moved to p, the whole-segment rule kept (no release
  // in flight stands in its way: *in_flight is left as it is).
  block* reclaim_queued_locked(impl& m, pool& p, std::size_t rounded, bool* in_flight) override
      STREAMSAFE_REQUIRES(m.mu_) {
    return m.reclaim_segment_locked(p, rounded, true);
  }
  block* reclaim_queued_last_resort_locked(impl& m, pool& p, std::size_t rounded) override
      STREAMSAFE_REQUIRES(m.mu_) {
    return m.reclaim_segment_locked(p, rounded, false);
  }

  // Another stream's whole free segment that the rule does not keep whole for the request.
  block* take_from_other_pools_locked(impl& m, detail::unique_lock<stream_lock>& slk,
                                      stream_state& st, pool& p, std::size_t rounded) override
      STREAMSAFE_REQUIRES(m.mu_, st.mu) {
    return m.steal_segment_locked(p, rounded, true);
  }

  // A new segment, for the capturing stream and a side stream alike (PyTorch: one segment per
  // pool and stream).
  block* new_memory_locked(impl& m, pool& p, std::size_t rounded, stream_handle side) override
      STREAMSAFE_REQUIRES(m.mu_) {
    return m.new_segment_locked(p, rounded);
  }

  bool supports_pause() const noexcept override { return false; }  // no mapping to keep
};

std::unique_ptr<caching_allocator::impl::growth_hook>
caching_allocator::impl::growth_hook::for_cuda_malloc() {
  return std::make_unique<cuda_malloc_growth>();
}

}  // namespace streamsafe
