// streamsafe core: what the allocator reports about itself: stats, reset_peak_stats,
// largest_free_block_bytes, find_block, snapshot, the trace recorder.
//
// Per-stream counters live under each stream's lock and are summed here; device-wide peaks are
// sampled by the fast path (streams.cpp: peak_sampler::sample) and combined with the sums. Locks:
// each call takes the device lock (mu_), then the stream locks one at a time (stats) or all of them
// (snapshot, for one consistent walk).
#include "core/allocator_impl.hpp"

#include <algorithm>
#include <iterator>

namespace streamsafe {

namespace {

// The statistics of `m` with the device lock held; lock_stream(st) returns what keeps st's lock
// held while its counters are read (a lock, or nothing when the caller holds every stream lock,
// as snapshot() does: then the statistics and the walk are one consistent state).
// long: one pass over every stream's counters under the locks that make them consistent
template <class Impl, class LockStream>
statistics collect_stats(const Impl& m,
                         LockStream&& lock_stream) STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
  using detail::k_kinds;
  statistics s = m.stats_;
  s.release_queued_bytes = m.releases_.bytes();
  for (auto& [h, st] : m.streams_.states) {
    const auto held = lock_stream(*st);
    (void)held;
    auto add = [](stat& to, const stat& from) {
      to.current += from.current;
      to.allocated += from.allocated;
      to.freed += from.freed;
    };
    for (std::size_t k = 0; k < k_kinds; ++k) {
      pool_statistics& to = detail::kind_stats(s, k);
      const detail::stream_kind_stats& x = st->stats.by[k];
      add(to.allocated_bytes, x.allocated_bytes.to_stat());
      add(to.requested_bytes, x.requested_bytes.to_stat());
      add(to.allocation, x.allocation.to_stat());
      const std::int64_t active_bytes = x.allocated_bytes.current + x.pending_bytes.current;
      add(to.active_bytes,
          stat{active_bytes, 0, x.allocated_bytes.total, x.allocated_bytes.total - active_bytes});
      const std::int64_t active = x.allocation.current + x.pending.current;
      add(to.active, stat{active, 0, x.allocation.total, x.allocation.total - active});
    }
    s.events_recorded += st->stats.events_recorded;
    s.stream_waits += st->stats.stream_waits;
  }
  std::int64_t inactive_split[k_kinds] = {};
  for (auto& [base, seg] : m.streams_.segments) {
    const auto held = lock_stream(detail::state_of(*seg->owner));
    (void)held;
    for (const auto* b = seg->first; b; b = b->next) {
      if ((b->state == block_state::free || b->state == block_state::quick_cached) && b->mapped &&
          (b->prev || b->next)) {
        inactive_split[detail::k_all] += static_cast<std::int64_t>(b->size);
        inactive_split[detail::kind_of(seg->small)] += static_cast<std::int64_t>(b->size);
      }
    }
  }
  // Peaks: device-wide, sampled at every allocation that may set one (allocate.cpp); reserved
  // bytes and segments are device-level counters already (stats_). Never below the current
  // value (a sample may have read a stream's mirror before its last change).
  const detail::peak_sampler& p = m.sampling_;
  for (std::size_t k = 0; k < k_kinds; ++k) {
    pool_statistics& to = detail::kind_stats(s, k);
    auto peak = [&](stat& x, detail::sampled q) {
      x.peak = std::max(x.current, p.peak[q][k].load(std::memory_order_relaxed));
    };
    peak(to.allocated_bytes, detail::s_allocated_bytes);
    peak(to.requested_bytes, detail::s_requested_bytes);
    peak(to.allocation, detail::s_allocation);
    peak(to.active_bytes, detail::s_active_bytes);
    peak(to.active, detail::s_active);
    for (stat* x : {&to.segment, &to.reserved_bytes}) x->peak = std::max(x->peak, x->current);
    to.inactive_split_bytes.current = inactive_split[k];
    detail::peak_sampler::raise(p.inactive_split_peak[k], inactive_split[k]);
    to.inactive_split_bytes.peak = p.inactive_split_peak[k].load(std::memory_order_relaxed);
  }
  return s;
}

}  // namespace

statistics caching_allocator::stats() const {
  const impl& m = *impl_;
  detail::lock_guard<detail::mutex> dlk(m.mu_);
  return collect_stats(m,
                       [](impl::stream_state& st) { return std::unique_lock<stream_lock>(st.mu); });
}

void caching_allocator::reset_peak_stats() {
  using detail::k_kinds;
  impl& m = *impl_;
  detail::lock_guard<detail::mutex> dlk(m.mu_);
  std::int64_t now[detail::k_sampled][k_kinds] = {};
  for (auto& [h, st] : m.streams_.states) {
    detail::lock_guard<stream_lock> slk(st->mu);
    st->stats.reset_peaks();
    for (std::size_t k = 0; k < k_kinds; ++k) {
      const detail::stream_kind_stats& x = st->stats.by[k];
      now[detail::s_allocated_bytes][k] += x.allocated_bytes.current;
      now[detail::s_requested_bytes][k] += x.requested_bytes.current;
      now[detail::s_allocation][k] += x.allocation.current;
      now[detail::s_active_bytes][k] += x.active_bytes_peak;
      now[detail::s_active][k] += x.active_peak;
    }
  }
  for (std::size_t q = 0; q < detail::k_sampled; ++q) {
    for (std::size_t k = 0; k < k_kinds; ++k) m.sampling_.peak[q][k] = now[q][k];
  }
  // The next stats() or snapshot() walk sets them to the inactive split bytes it finds.
  for (auto& x : m.sampling_.inactive_split_peak) x = 0;
  statistics& s = m.stats_;
  m.growth_.reserved_high_water =
      m.reserved_high_water_locked();  // the growth policy keeps its peak
  for (std::size_t k = 0; k < k_kinds; ++k) {
    pool_statistics& x = detail::kind_stats(s, k);
    for (stat* y : {&x.reserved_bytes, &x.inactive_split_bytes, &x.segment}) y->reset_peak();
  }
}

std::size_t caching_allocator::largest_free_block_bytes() const {
  detail::lock_guard<detail::mutex> dlk(impl_->mu_);
  return impl_->largest_free_locked(nullptr);
}

int caching_allocator::device() const noexcept { return impl_->backend_.device(); }

options caching_allocator::config() const {
  detail::lock_guard<detail::mutex> dlk(impl_->mu_);  // a whole set_runtime_options, not half
  options o = impl_->opts_;
  impl_->runtime_.load().apply_to(o);
  return o;
}

caching_allocator::block_info caching_allocator::find_block(const void* ptr) const {
  impl& m = *impl_;
  detail::lock_guard<detail::mutex> dlk(m.mu_);
  impl::stream_state* owner = m.owner_locked(ptr);
  if (!owner) return {};
  detail::lock_guard<stream_lock> slk(owner->mu);
  const block* b = owner->active.find_active(reinterpret_cast<std::uintptr_t>(ptr));
  if (!b) return {};
  return {b->addr, b->size, b->seg->stream};
}

caching_allocator::block_info caching_allocator::find_block_containing(const void* ptr) const {
  impl& m = *impl_;
  detail::lock_guard<detail::mutex> dlk(m.mu_);
  impl::stream_state* owner = m.owner_locked(ptr);
  if (!owner) return {};
  detail::lock_guard<stream_lock> slk(owner->mu);
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = m.streams_.segments.upper_bound(p);
  if (it == m.streams_.segments.begin()) return {};
  const segment* seg = std::prev(it)->second;
  for (const block* b = seg->first; b && b->addr <= p; b = b->next) {
    if (p < b->addr + b->size && b->state == block_state::active)
      return {b->addr, b->size, seg->stream};
  }
  return {};
}

void caching_allocator::set_trace_recorder(trace_recorder* recorder) noexcept {
  impl_->trace_.store(recorder, std::memory_order_release);
}

const trace_recorder* caching_allocator::trace() const noexcept {
  return impl_->trace_.load(std::memory_order_acquire);
}

namespace {
// An address of queued memory another pool reclaimed (reclaim.cpp) holds only what it owns
// again (ghost_owned); the rest is counted at the other address (as check_invariants does).
std::size_t aliased_bytes_of(const detail::segment* seg) {
  std::size_t bytes = 0;
  for (const detail::block* b = seg->first; b; b = b->next) {
    if (b->state == detail::block_state::releasing && b->aliased) bytes += b->size - b->ghost_owned;
  }
  return bytes;
}
}  // namespace

memory_snapshot caching_allocator::snapshot() const {
  const impl& m = *impl_;
  memory_snapshot snap;
  snap.device = m.backend_.device();
  snap.time_us = trace_recorder::now_us();
  detail::lock_guard<detail::mutex> dlk(m.mu_);
  std::vector<std::unique_lock<stream_lock>> locks;
  for (auto& [h, st] : m.streams_.states) locks.emplace_back(st->mu);
  // The statistics under the same locks as the walk: one state.
  snap.stats = collect_stats(m, [](impl::stream_state&) { return 0; });
  // Every segment counted in the statistics: those in the segment map and those being freed
  // with mu_ dropped (release.cpp), in address order.
  std::vector<const segment*> segs;
  segs.reserve(m.streams_.segments.size() + m.releases_.releasing_segments.size());
  for (auto& [base, seg] : m.streams_.segments) segs.push_back(seg);
  for (const segment* seg : m.releases_.releasing_segments) segs.push_back(seg);
  std::sort(segs.begin(), segs.end(),
            [](const segment* a, const segment* b) { return a->base < b->base; });
  for (const segment* seg : segs) {
    segment_snapshot ss;
    ss.address = seg->base;
    ss.size_bytes = seg->size;
    ss.mapped_bytes = seg->mapped_bytes;
    ss.stream = seg->stream;
    ss.pool = seg->small ? snapshot_pool::small : snapshot_pool::large;
    ss.expandable = seg->expandable;
    ss.paused_bytes = seg->paused_bytes;
    ss.aliased_bytes = aliased_bytes_of(seg);
    ss.mapped_bytes -= ss.aliased_bytes;
    if (seg->owner->tag != 0) ss.tag = tag_name(seg->owner->tag);
    ss.graph_pool = state_of(*seg->owner).graph;
    for (const block* b = seg->first; b; b = b->next) {
      block_snapshot bs;
      bs.address = b->addr;
      bs.size_bytes = b->size;
      bs.stream = seg->stream;
      switch (b->state) {
        case block_state::active:
          bs.state = snapshot_block_state::active;
          bs.requested_bytes = b->requested;
          break;
        case block_state::pending_free:
          bs.state = snapshot_block_state::pending_free;
          for (const auto& e : b->events) {
            if (e.stream != detail::k_tombstone_stream) bs.waiting_on.push_back(e.stream);
          }
          break;
        case block_state::releasing: bs.state = snapshot_block_state::releasing; break;
        case block_state::free:
        case block_state::quick_cached:
          bs.state = b->mapped ? snapshot_block_state::inactive : snapshot_block_state::unmapped;
          break;
      }
      ss.blocks.push_back(std::move(bs));
    }
    snap.segments.push_back(std::move(ss));
  }
  return snap;
}

}  // namespace streamsafe
