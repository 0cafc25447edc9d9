// streamsafe core: sleep and wake, pause and resume of a tag's memory (core/sleep.hpp).
//
// pause(tag) marks every expandable segment of the tag's pools paused (no release, growth or
// allocation touches it until resume) and records, per segment, its mapped runs (chunk-aligned:
// every mapped block except chunks being released already) and a fence: one event on each
// stream that may touch it, chosen as for empty_cache (options::release_fence; the `device`
// scope fences every known stream here, so that defer mode can poll it). Offload: the live
// blocks (each run of adjacent ones as one range) are copied to pinned host memory (sleep_.host, a
// caching_allocator over the backend's host backend) on sleep_.copy_stream, which first waits on
// the device for the fence events and the tombstones; the copy's event then stands for the fence. A
// segment whose fence (or copy) has completed is unmapped, the hook first, with mu_ dropped
// (tag_state::busy counts the calls in flight; resume and a second pause wait for them). Wait mode
// waits on exactly those events, no lock held; defer mode never waits: what is ready goes now, the
// rest at the release worker's passes (or, without a worker, at reclaim, tag_status and a second
// pause of the tag). Blocks keep their state and `mapped` flag while paused; segment::paused_bytes
// holds the bytes given back, out of mapped_bytes and reserved bytes. resume is in wake.cpp.
// Nothing here runs during a graph capture (pause and resume refuse; the worker waits).
#include "core/allocator_impl.hpp"
#include "core/common/format.hpp"
#include "core/common/logging.hpp"
#include "core/growth/growth_hook.hpp"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

namespace streamsafe {

using detail::hex;

namespace {

std::string tag_where(const std::string& call, std::string_view tag, int device) {
  return "streamsafe: " + call + "('" + std::string(tag) + "') on device " + std::to_string(device);
}

}  // namespace

stream_handle caching_allocator::impl::copy_stream_locked() {
  if (!sleep_.has_copy_stream) {
    sleep_.copy_stream = backend_.create_stream();
    sleep_.has_copy_stream = true;
  }
  return sleep_.copy_stream;
}

caching_allocator& caching_allocator::impl::host_allocator_locked() {
  if (!sleep_.host) {
    device_backend* host = backend_.host_backend();
    if (!host)
      throw config_error("streamsafe: device " + std::to_string(backend_.device()) + ": the " +
                         backend_.name() + " backend has no pinned host memory for offload");
    options o;
    o.backend = backend_kind::cuda_malloc;
    o.empty_cache = empty_cache_mode::wait;
    o.release_worker = release_worker_mode::off;
    sleep_.host = std::make_unique<caching_allocator>(*host, o);
  }
  return *sleep_.host;
}

void caching_allocator::impl::call_hooks_unlocked(const std::vector<sleep_hook_event>& events,
                                                  const sleep_hook& hook) {
  if (!hook) return;
  for (const sleep_hook_event& e : events) {
    try {
      hook(e);
    } catch (const std::exception& ex) {
      detail::log().warn("device {}: sleep hook for tag '{}' at {} threw: {} (ignored)",
                         backend_.device(), e.tag, hex(e.address), ex.what());
    } catch (...) {
      detail::log().warn("device {}: sleep hook for tag '{}' threw (ignored)", backend_.device(),
                         e.tag);
    }
  }
}

void caching_allocator::impl::wait_tag_idle_locked(device_lock& lk, const tag_state& t) {
  driver_calls_.done.wait(lk, [&]() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS { return t.busy == 0; });
}

// Offload: host memory for t's segments still to copy (sleep_.host, mu_ dropped), then their
// copies on the copy stream behind their fences.
void caching_allocator::impl::enqueue_offload_locked(device_lock& lk, tag_state& t) {
  // The pinned host memory first, for every segment still to copy, with mu_ dropped: a first
  // pause pins gigabytes (cudaHostAlloc, about 2 GB/s) and no other call of this allocator may
  // wait for that. busy keeps resume and other pauses of the tag off t.segments meanwhile.
  std::vector<detail::offload_copy*> need;
  for (paused_segment& ps : t.segments) {
    if (ps.copies_enqueued || ps.runs_unmapped == ps.runs.size()) continue;
    for (detail::offload_copy& c : ps.copies) {
      if (!c.host) need.push_back(&c);
    }
  }
  if (!need.empty()) {
    caching_allocator& host = host_allocator_locked();
    const stream_handle cs = copy_stream_locked();
    // On a failure what was allocated stays for the next try.
    detail::unlocked_for_tag(driver_calls_, lk, t, [&] {
      for (detail::offload_copy* c : need) c->host = host.allocate(c->bytes, cs);
    });
  }
  // Then the copies, behind every use the fence covers (and destroyed streams' last work).
  for (paused_segment& ps : t.segments) {
    if (ps.copies_enqueued || ps.runs_unmapped == ps.runs.size()) continue;
    ps.copies_enqueued = true;
    if (ps.copies.empty()) continue;
    const stream_handle cs = copy_stream_locked();
    for (const auto& e : ps.fence) backend_.stream_wait_event(cs, e.event);
    for (const auto& tomb : streams_.tombstones) backend_.stream_wait_event(cs, tomb.event);
    stats_.stream_waits += ps.fence.size() + streams_.tombstones.size();
    std::size_t bytes = 0;
    for (const detail::offload_copy& c : ps.copies) {
      backend_.copy_async(c.host, reinterpret_cast<const void*>(c.addr), c.bytes, cs);
      bytes += c.bytes;
    }
    ps.copied = get_event();
    backend_.record_event(ps.copied, cs);
    ++stats_.events_recorded;
    t.offloaded_host_bytes += bytes;
  }
}

// Polls only.
bool caching_allocator::impl::pause_ready_locked(const paused_segment& ps) {
  if (ps.copied != 0) return backend_.query_event(ps.copied);
  for (const auto& e : ps.fence) {
    if (!backend_.query_event(e.event)) return false;
  }
  for (const auto& tomb : streams_.tombstones) {
    if (!backend_.query_event(tomb.event)) return false;
  }
  return true;
}

// Waits (mu_ dropped) for the fences or copies of t's segments still mapped; returns them.
std::vector<caching_allocator::impl::paused_segment*> caching_allocator::impl::wait_pause_locked(
    device_lock& lk, tag_state& t) {
  std::vector<paused_segment*> ready;
  std::vector<event_handle> waits;
  for (paused_segment& ps : t.segments) {
    if (ps.runs_unmapped == ps.runs.size()) continue;
    ready.push_back(&ps);
    if (ps.copied != 0) {
      waits.push_back(ps.copied);  // the copy waited for the fence on the device
    } else {
      for (const auto& e : ps.fence) waits.push_back(e.event);
    }
  }
  for (const auto& tomb : streams_.tombstones) waits.push_back(tomb.event);
  const auto pinned = static_cast<std::int64_t>(streams_.tombstones.size());
  tombstone_refs_.fetch_add(pinned);  // not pooled while waited on unlocked
  try {
    detail::unlocked_for_tag(driver_calls_, lk, t, [&] {
      for (event_handle e : waits) backend_.synchronize_event(e);
    });
  } catch (...) {
    tombstone_refs_.fetch_sub(pinned);
    throw;
  }
  tombstone_refs_.fetch_sub(pinned);
  ++stats_.fence_waits;
  return ready;
}

// The hooks, then the unmaps of `ready` (mu_ dropped), then their bookkeeping.
std::size_t caching_allocator::impl::unmap_paused_locked(
    device_lock& lk, tag_state& t, const std::vector<paused_segment*>& ready) {
  std::vector<sleep_hook_event> hooks;
  std::vector<std::size_t> before;
  for (const paused_segment* ps : ready) {
    before.push_back(ps->runs_unmapped);
    for (std::size_t i = ps->runs_unmapped; i < ps->runs.size(); ++i) {
      hooks.push_back({sleep_hook_event::kind::before_unmap, t.name, backend_.device(),
                       ps->runs[i].first, ps->runs[i].second});
    }
  }
  const sleep_hook hook = sleep_.hook;
  std::exception_ptr error;
  // The runs unmapped, counted here and published under mu_ (tag_status reads runs_unmapped).
  std::vector<std::size_t> unmapped = before;
  detail::unlocked_for_tag(driver_calls_, lk, t, [&] {
    call_hooks_unlocked(hooks, hook);
    for (std::size_t i = 0; i < ready.size(); ++i) {
      const paused_segment* ps = ready[i];
      try {
        for (; unmapped[i] < ps->runs.size(); ++unmapped[i]) {
          const auto& run = ps->runs[unmapped[i]];
          backend_.unmap(reinterpret_cast<void*>(run.first), run.second);
        }
      } catch (...) {
        if (!error) error = std::current_exception();  // the rest of that segment stays mapped
      }
    }
  });
  for (std::size_t i = 0; i < ready.size(); ++i) ready[i]->runs_unmapped = unmapped[i];
  std::size_t released = 0;
  for (std::size_t i = 0; i < ready.size(); ++i) {
    paused_segment& ps = *ready[i];
    std::size_t bytes = 0;
    for (std::size_t r = before[i]; r < ps.runs_unmapped; ++r) bytes += ps.runs[r].second;
    if (bytes != 0) {
      segment* seg = ps.seg;
      detail::lock_guard<stream_lock> slk(state_of(*seg->owner).mu);
      seg->mapped_bytes -= bytes;
      seg->paused_bytes += bytes;
      std::size_t ghosted = 0;  // still mapped at an address queued for release (reclaim.cpp)
      for (std::size_t r = before[i]; r < ps.runs_unmapped; ++r) {
        stats_.num_device_free += forget_chunks(seg, ps.runs[r].first, ps.runs[r].second);
        ghosted += unghost_locked(ps.runs[r].first, ps.runs[r].second, seg->small);
        retire_exports_in_locked(ps.runs[r].first, ps.runs[r].second);  // ipc.cpp
      }
      detail::sub_reserved(stats_, seg->small, static_cast<std::int64_t>(bytes - ghosted));
      stats_.bytes_released += bytes - ghosted;
      trace(trace_action::segment_unmap, seg->base, bytes, seg->stream);
      released += bytes;
    }
    if (ps.runs_unmapped == ps.runs.size()) release_pause_events_locked(ps);
  }
  detail::log().debug("device {}: pause('{}'): {} bytes back to the driver", backend_.device(),
                      t.name, released);
  if (error) std::rethrow_exception(error);
  return released;
}

void caching_allocator::impl::release_pause_events_locked(paused_segment& ps) {
  for (const auto& e : ps.fence) put_event(e.event);
  ps.fence.clear();
  if (ps.copied != 0) put_event(ps.copied);
  ps.copied = 0;
}

// Unmaps (hooks first, mu_ dropped) the segments of t that are ready; wait: waits for them.
std::size_t caching_allocator::impl::advance_pause_locked(device_lock& lk, tag_state& t,
                                                          bool wait) {
  if (t.phase != tag_phase::pausing || capturing()) return 0;
  wait_tag_idle_locked(lk, t);
  if (t.phase != tag_phase::pausing) return 0;  // resumed by another thread meanwhile
  if (t.mode == pause_mode::offload) {
    enqueue_offload_locked(lk, t);
    if (t.phase != tag_phase::pausing) return 0;
  }
  std::vector<paused_segment*> ready;
  if (wait) {
    ready = wait_pause_locked(lk, t);
  } else {
    for (paused_segment& ps : t.segments) {
      if (ps.runs_unmapped < ps.runs.size() && pause_ready_locked(ps)) ready.push_back(&ps);
    }
  }
  const std::size_t released = ready.empty() ? 0 : unmap_paused_locked(lk, t, ready);
  if (std::all_of(t.segments.begin(), t.segments.end(),
                  [](const paused_segment& ps) { return ps.runs_unmapped == ps.runs.size(); })) {
    t.phase = tag_phase::paused;
    --sleep_.pauses_pending;
  }
  return released;
}

// Every tag being paused.
std::size_t caching_allocator::impl::advance_pauses_locked(device_lock& lk) {
  std::size_t released = 0;
  std::vector<tag_state*> pausing;
  for (auto& [id, t] : sleep_.tags) {
    if (t->phase == tag_phase::pausing) pausing.push_back(t.get());
  }
  std::exception_ptr error;
  for (tag_state* t : pausing) {
    try {
      released += advance_pause_locked(lk, *t, false);
    } catch (...) {
      if (!lk.owns_lock()) lk.lock();
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  return released;
}

// The serve path's wait on the tags still pausing (serve_path.cpp): on the host, mu_ dropped, for
// the fences of their segments still mapped (or their copies, once enqueued: offload), bounded
// in all by bound_us (0: exactly, as empty_cache:wait waits), then the pauses move along without
// waiting. True when a pause gave memory back or ended.
bool caching_allocator::impl::wait_pausing_tags_locked(device_lock& lk, std::uint64_t bound_us) {
  std::vector<tag_state*> pausing;
  for (auto& [id, t] : sleep_.tags) {
    if (t->phase == tag_phase::pausing) pausing.push_back(t.get());
  }
  if (pausing.empty() || capturing()) return false;
  const auto start = std::chrono::steady_clock::now();
  auto left_us = [&]() -> std::uint64_t {
    const auto spent = static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                              start)
            .count());
    return spent >= bound_us ? 0 : bound_us - spent;
  };
  for (tag_state* t : pausing) {
    if (t->phase != tag_phase::pausing) continue;  // moved by another thread meanwhile
    std::vector<event_handle> waits;
    for (const paused_segment& ps : t->segments) {
      if (ps.runs_unmapped == ps.runs.size()) continue;
      if (ps.copied != 0) {
        waits.push_back(ps.copied);
      } else {
        for (const auto& e : ps.fence) waits.push_back(e.event);
      }
    }
    for (const auto& tomb : streams_.tombstones) waits.push_back(tomb.event);
    const auto pinned = static_cast<std::int64_t>(streams_.tombstones.size());
    tombstone_refs_.fetch_add(pinned);  // not pooled while waited on unlocked
    bool done = true;
    try {
      detail::unlocked_for_tag(driver_calls_, lk, *t, [&] {
        for (event_handle e : waits) {
          if (bound_us == 0) {
            backend_.synchronize_event(e);
          } else if (!backend_.synchronize_event_for(e, left_us())) {
            done = false;
            break;
          }
        }
      });
    } catch (...) {
      tombstone_refs_.fetch_sub(pinned);
      throw;
    }
    tombstone_refs_.fetch_sub(pinned);
    ++stats_.fence_waits;
    if (!done) break;
  }
  const std::size_t pending_before = sleep_.pauses_pending;
  const std::size_t released = advance_pauses_locked(lk);
  return released != 0 || sleep_.pauses_pending != pending_before;
}

pause_status caching_allocator::impl::tag_status_locked(const tag_state& t) {
  pause_status s;
  s.tag = t.name;
  s.phase = t.phase;
  s.offloaded_host_bytes = t.offloaded_host_bytes;
  s.error = t.resume_error;
  for (const paused_segment& ps : t.segments) {
    for (std::size_t r = ps.runs_unmapped; r < ps.runs.size(); ++r)
      s.pending_bytes += ps.runs[r].second;
  }
  for (auto& [base, seg] : streams_.segments) {
    if (seg->owner->tag != t.id) continue;
    detail::lock_guard<stream_lock> slk(state_of(*seg->owner).mu);
    s.reserved_bytes += seg->mapped_bytes;
    s.released_bytes += seg->paused_bytes;
    for (const block* b = seg->first; b; b = b->next) {
      if (b->state == block_state::active) s.allocated_bytes += b->size;
    }
  }
  return s;
}

void caching_allocator::impl::destroy_sleep_state_locked(device_lock& lk) {
  // Pauses underway finish (their fences waited on): nothing a segment still maps is left to a
  // later unmap. Offloaded contents are dropped; the host copies go back to sleep_.host.
  for (auto& [id, t] : sleep_.tags) {
    if (t->phase == tag_phase::resuming) t->phase = t->phase_before_resume;  // not done: dropped
    try {
      if (t->phase == tag_phase::pausing) advance_pause_locked(lk, *t, true);
    } catch (const std::exception& e) {
      detail::log().error("device {}: finishing pause('{}') at destruction: {}", backend_.device(),
                          t->name, e.what());
    }
    for (paused_segment& ps : t->segments) {
      if (ps.runs_unmapped == 0) ps.seg->paused = false;  // still mapped: released as cache
      release_pause_events_locked(ps);
      for (detail::offload_copy& c : ps.copies) {
        if (c.host && sleep_.host) sleep_.host->deallocate(c.host);
        c.host = nullptr;
      }
    }
    t->segments.clear();
  }
  sleep_.host.reset();  // waits on its fences (the copies on sleep_.copy_stream)
  if (sleep_.has_copy_stream) {
    backend_.destroy_stream(sleep_.copy_stream);
    sleep_.has_copy_stream = false;
  }
}

// ---- public calls ----------------------------------------------------------------------------

pause_status caching_allocator::pause(std::string_view tag, pause_mode mode) {
  return pause(tag, mode, impl_->opts_.empty_cache);
}

// pause: the tag's segments marked paused, their runs and fence streams; the fences recorded.
std::vector<caching_allocator::impl::paused_segment> caching_allocator::impl::collect_pause_locked(
    tag_id tag, pause_mode mode, const std::string& where) {
  // The fence streams: the empty_cache scope; for `device` every known stream (polled in defer
  // mode, where a device-wide synchronisation could only be waited for).
  std::vector<stream_handle> every;
  for (auto& [s, st] : streams_.states) {
    if (st->graph == 0 && st->alive.load(std::memory_order_acquire)) every.push_back(s);
  }
  std::vector<paused_segment> segs;
  for (auto& [base, seg] : streams_.segments) {
    if (seg->owner->tag != tag || !seg->expandable) continue;
    detail::lock_guard<stream_lock> slk(state_of(*seg->owner).mu);
    flush_quick_locked(*seg->owner);
    paused_segment ps;
    ps.seg = seg;
    for (block* b = seg->first; b; b = b->next) {
      if (!b->mapped || b->state == block_state::releasing) continue;
      if (!ps.runs.empty() && ps.runs.back().first + ps.runs.back().second == b->addr) {
        ps.runs.back().second += b->size;
      } else {
        ps.runs.emplace_back(b->addr, b->size);
      }
      ps.bytes += b->size;
      if (mode == pause_mode::offload && b->state == block_state::active && !b->free_held) {
        // Live blocks side by side are one copy (one host buffer, one driver call each way).
        if (!ps.copies.empty() && ps.copies.back().addr + ps.copies.back().bytes == b->addr) {
          ps.copies.back().bytes += b->size;
        } else {
          ps.copies.push_back({b->addr, b->size, nullptr});
        }
      }
    }
    for (const auto& run : ps.runs) {
      if (!whole_chunk_run(seg, run.first, run.second))
        throw std::logic_error(where + ": mapped run " + hex(run.first) + " of " +
                               std::to_string(run.second) + " bytes is not chunk-aligned");
    }
    // A graph's private pool (capture.cpp): the graph may replay on any stream, so every
    // stream fences it, as at the graph's release (allocation_stream, the unsafe scope, excepted).
    const bool graph_pool = state_of(*seg->owner).graph != 0;
    ps.fence_streams = opts_.release_fence == fence_scope::device ||
                               (graph_pool && opts_.release_fence != fence_scope::allocation_stream)
                           ? every
                           : fence_streams_locked(seg);
    // The copy stream too: a restore of an earlier resume may still write the blocks.
    if (sleep_.has_copy_stream) ps.fence_streams.push_back(sleep_.copy_stream);
    segs.push_back(std::move(ps));
  }
  return segs;
}

void caching_allocator::impl::record_pause_fences_locked(std::vector<paused_segment>& segs) {
  try {
    for (paused_segment& ps : segs) {
      if (ps.runs.empty()) continue;
      for (stream_handle s : ps.fence_streams) {
        const event_handle e = get_event();
        ps.fence.push_back({e, s});
        record_event_on(e, s);  // s is a key (per-thread streams: streams.cpp)
        ++stats_.events_recorded;
      }
    }
  } catch (...) {
    for (paused_segment& ps : segs) release_pause_events_locked(ps);
    throw;
  }
}

pause_status caching_allocator::pause(std::string_view tag, pause_mode mode, empty_cache_mode how) {
  impl& m = *impl_;
  if (m.inherited()) m.throw_inherited("pause");
  const tag_id id = tag_of(tag);  // config_error for a bad name
  const std::string where = tag_where("pause", tag, m.backend_.device());
  if (callback_scope::active())
    throw std::logic_error(where + " inside a stream callback: a pause makes CUDA calls");
  device_lock lk(m.mu_);
  if (!m.growth_hook_->supports_pause()) {
    throw config_error(
        where +
        ": pause needs the expandable backend (backend:expandable, "
        "expandable_segments:True); cudaMalloc segments cannot keep their addresses");
  }
  if (mode == pause_mode::offload && !m.backend_.host_backend())
    throw config_error(where + ": offload needs pinned host memory, which the " +
                       m.backend_.name() + " backend does not provide");
  m.detect_captures_locked(lk);
  if (m.capturing())
    throw std::logic_error(where + " during a CUDA graph capture: no memory can be released then");
  impl::tag_state& t = m.tag_state_locked(id);
  m.wait_tag_idle_locked(lk, t);
  if (t.phase == tag_phase::resuming) {  // a resume_async not done yet: first, here
    try {
      m.resume_tag_locked(lk, t, nullptr, where);
    } catch (const out_of_memory&) {
      // The part that could not be mapped is still paused: the pause below covers the rest.
    }
  }
  const bool worker = m.worker_usable_locked();
  if (t.phase != tag_phase::active) {  // pausing twice: a no-op that moves the first one along
    if (how == empty_cache_mode::wait || !worker)
      m.advance_pause_locked(lk, t, how == empty_cache_mode::wait);
    return m.tag_status_locked(t);
  }
  m.fence_unfenced_locked();
  std::vector<impl::paused_segment> segs = m.collect_pause_locked(id, mode, where);
  m.record_pause_fences_locked(segs);
  for (impl::paused_segment& ps : segs) ps.seg->paused = true;
  t.segments = std::move(segs);
  t.mode = mode;
  t.phase = tag_phase::pausing;
  t.refused.store(true, std::memory_order_release);
  ++m.sleep_.pauses_pending;
  detail::log().debug("device {}: pause('{}', {}): {} segment(s)", m.backend_.device(), t.name,
                      mode == pause_mode::offload ? "offload" : "discard", t.segments.size());
  if (how == empty_cache_mode::wait) {
    m.advance_pause_locked(lk, t, true);
  } else if (worker && m.ensure_worker_locked()) {
    m.worker_.kick_now();  // the worker enqueues the copies and unmaps: nothing on this thread
  } else {
    m.advance_pause_locked(lk, t, false);
  }
  return m.tag_status_locked(t);
}

pause_status caching_allocator::tag_status(std::string_view tag) {
  impl& m = *impl_;
  const tag_id id = tag_of(tag);
  device_lock lk(m.mu_);
  auto found = m.sleep_.tags.find(id);
  if (found == m.sleep_.tags.end()) return detail::sleep_state::unknown_tag_status(tag);
  impl::tag_state& t = *found->second;
  // Moves a deferred pause along on this thread when no worker does (never waits).
  if (t.phase == tag_phase::pausing && !m.worker_usable_locked() && !callback_scope::active() &&
      !m.inherited()) {
    m.detect_captures_locked(lk);
    m.advance_pause_locked(lk, t, false);
  }
  return m.tag_status_locked(t);
}

void caching_allocator::set_sleep_hook(sleep_hook hook) {
  device_lock lk(impl_->mu_);
  impl_->sleep_.hook = std::move(hook);
}

std::size_t caching_allocator::release_host_cache() {
  device_lock lk(impl_->mu_);
  return impl_->sleep_.host ? impl_->sleep_.host->empty_cache(empty_cache_mode::wait) : 0;
}

}  // namespace streamsafe
