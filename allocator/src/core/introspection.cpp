// streamsafe core: what the allocator reports about itself: stats, reset_peak_stats,
// largest_free_block_bytes, find_block, snapshot, the trace recorder.
//
// Per-stream counters live under each stream's lock and are summed here; device-wide peaks are
// sampled by the fast path (streams.cpp: peak_sampler::sample) and combined with the sums. Locks:
// each call takes the device lock (mu_), then the stream locks one at a time (stats) or all of them
// (snapshot, for one consistent walk).
#include "allocator_impl.hpp"

#include <algorithm>
#include <iterator>

namespace streamsafe {

namespace {

// The statistics of `m` with the device lock held; lock_stream(st) returns what keeps st's lock
// held while its counters are read (a lock, or nothing when the caller holds every stream lock,
// as snapshot() does: then the statistics and the walk are one consistent state).
template <class Impl, class LockStream>
statistics collect_stats(const Impl& m,
                         LockStream&& lock_stream) STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
  statistics s = m.stats_;
  s.release_queued_bytes = m.releases_.bytes();
  std::int64_t inactive_split = 0;
  for (auto& [h, st] : m.streams_.states) {
    const auto held = lock_stream(*st);
    (void)held;
    auto add = [](stat& to, const stat& from) {
      to.current += from.current;
      to.allocated += from.allocated;
      to.freed += from.freed;
      to.peak = std::max(to.peak, from.peak);
    };
    const auto& x = st->stats;
    add(s.allocated_bytes, x.allocated_bytes.to_stat());
    add(s.requested_bytes, x.requested_bytes.to_stat());
    add(s.allocation, x.allocation.to_stat());
    const std::int64_t active_bytes = x.allocated_bytes.current + x.pending_bytes.current;
    add(s.active_bytes, stat{active_bytes, x.active_bytes_peak, x.allocated_bytes.total,
                             x.allocated_bytes.total - active_bytes});
    const std::int64_t active = x.allocation.current + x.pending.current;
    add(s.active, stat{active, x.active_peak, x.allocation.total, x.allocation.total - active});
    s.events_recorded += st->stats.events_recorded;
    s.stream_waits += st->stats.stream_waits;
  }
  for (auto& [base, seg] : m.streams_.segments) {
    const auto held = lock_stream(detail::state_of(*seg->owner));
    (void)held;
    for (const auto* b = seg->first; b; b = b->next) {
      if ((b->state == block_state::free || b->state == block_state::quick_cached) && b->mapped &&
          (b->prev || b->next)) {
        inactive_split += static_cast<std::int64_t>(b->size);
      }
    }
  }
  // Device-wide peaks: sampled at every allocation that may set one (allocate.cpp). The count
  // peaks are per-stream maxima, so at least the device-wide current count.
  s.allocated_bytes.peak = std::max(
      {s.allocated_bytes.peak, s.allocated_bytes.current, m.sampling_.peak_allocated.load()});
  s.active_bytes.peak = std::max(
      {s.active_bytes.peak, s.active_bytes.current, m.sampling_.peak_active.load()});
  s.requested_bytes.peak = std::max(
      {s.requested_bytes.peak, s.requested_bytes.current, m.sampling_.peak_requested.load()});
  for (stat* x : {&s.allocation, &s.active, &s.segment, &s.reserved_bytes})
    x->peak = std::max(x->peak, x->current);
  s.inactive_split_bytes.current = inactive_split;
  s.inactive_split_bytes.peak = std::max(s.inactive_split_bytes.peak, inactive_split);
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
  impl& m = *impl_;
  detail::lock_guard<detail::mutex> dlk(m.mu_);
  std::int64_t allocated = 0, active = 0, requested = 0;
  for (auto& [h, st] : m.streams_.states) {
    detail::lock_guard<stream_lock> slk(st->mu);
    auto& x = st->stats;
    for (detail::fast_stat* f :
         {&x.allocated_bytes, &x.requested_bytes, &x.allocation, &x.pending_bytes, &x.pending}) {
      f->peak = f->current;
    }
    x.active_bytes_peak = x.allocated_bytes.current + x.pending_bytes.current;
    x.active_peak = x.allocation.current + x.pending.current;
    allocated += x.allocated_bytes.current;
    active += x.active_bytes_peak;
    requested += x.requested_bytes.current;
  }
  m.sampling_.peak_allocated = allocated;
  m.sampling_.peak_active = active;
  m.sampling_.peak_requested = requested;
  statistics& s = m.stats_;
  m.growth_.reserved_high_water =
      m.reserved_high_water_locked();  // the growth policy keeps its peak
  for (stat* x : {&s.reserved_bytes, &s.inactive_split_bytes, &s.segment}) x->reset_peak();
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
  for (auto& [base, seg] : m.streams_.segments) {
    segment_snapshot ss;
    ss.address = seg->base;
    ss.size_bytes = seg->size;
    ss.mapped_bytes = seg->mapped_bytes;
    ss.stream = seg->stream;
    ss.pool = seg->small ? snapshot_pool::small : snapshot_pool::large;
    ss.expandable = seg->expandable;
    ss.paused_bytes = seg->paused_bytes;
    if (seg->owner->tag != 0) ss.tag = tag_name(seg->owner->tag);
    if (seg->owner->state != nullptr)
      ss.graph = static_cast<const impl::stream_state*>(seg->owner->state)->graph;
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
