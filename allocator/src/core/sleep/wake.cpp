// streamsafe core: waking a paused tag, resume (core/sleep.hpp; sleep.cpp pauses).
//
// For each paused segment of the tag: the runs the pause gave back are mapped again at their
// addresses, chunk by chunk as growth maps them (within the memory limit; out of memory leaves
// that segment, and every one after it, paused whole), the offloaded live blocks are copied back
// on sleep_.copy_stream and their host copies freed there (stream-ordered, so sleep_.host reuses
// them only after the restore), and the segment is no longer paused. Then every stream owning a
// resumed segment, and the caller's stream, waits on the device for one event recorded after the
// restores. Runs a deferred pause had not given back yet stay mapped; their copies are dropped.
// The hooks run last, with mu_ dropped.
#include "core/allocator_impl.hpp"
#include "core/common/logging.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace streamsafe {

pause_status caching_allocator::resume(std::string_view tag) { return resume_impl(tag, nullptr); }

pause_status caching_allocator::resume(std::string_view tag, stream_handle also_order) {
  also_order = impl_->key_of(also_order);  // cudaStreamPerThread: this thread's
  return resume_impl(tag, &also_order);
}

// A run a pause gave back, mapped again in handles sized to the tag: the run is cut, at the
// granularity, into stretches that hold live blocks (any block not free) and free stretches;
// a free stretch shorter than `chunk` joins its neighbours. Each stretch is mapped in handles of
// up to limits_.tag_handle_bytes, so a free stretch stays a handle of its own that
// empty_cache(tag) can give back whole. A stretch the driver cannot map in large handles (out of
// memory) is tried again in chunks of `chunk`. False, with nothing of the run left mapped, when
// the memory is not there.
bool caching_allocator::impl::map_resumed_run_locked(segment* seg, std::uintptr_t addr,
                                                     std::size_t bytes, std::size_t chunk) {
  const std::size_t g = limits_.small_chunk_bytes;
  const std::uintptr_t end = addr + bytes;
  struct stretch {
    std::uintptr_t lo, hi;
    bool live;
  };
  std::vector<stretch> parts;
  auto add = [&](std::uintptr_t lo, std::uintptr_t hi, bool live) {
    if (lo >= hi) return;
    if (!live && hi - lo < chunk) live = true;  // too small to give back alone
    if (!parts.empty() && parts.back().live == live && parts.back().hi == lo) {
      parts.back().hi = hi;
    } else {
      parts.push_back({lo, hi, live});
    }
  };
  {
    detail::lock_guard<stream_lock> slk(state_of(*seg->owner).mu);  // guards the block list
    std::uintptr_t at = addr;
    for (const block* b = seg->first; b; b = b->next) {
      if (b->addr + b->size <= addr || b->state == block_state::free) continue;
      if (b->addr >= end) break;
      const std::uintptr_t lo = std::max(addr, b->addr / g * g);
      const std::uintptr_t hi = std::min(end, detail::round_up(b->addr + b->size, g));
      if (lo > at) add(at, lo, false);
      add(std::max(at, lo), hi, true);
      at = std::max(at, hi);
    }
    add(at, end, false);
  }
  std::size_t done = 0;
  bool ok = true;
  for (const stretch& p : parts) {
    const std::size_t n = p.hi - p.lo;
    std::size_t got = map_chunks_locked(seg, p.lo, n, limits_.tag_handle_bytes);
    if (got != n && limits_.tag_handle_bytes > chunk) got = map_chunks_locked(seg, p.lo, n, chunk);
    if (got != n) {
      ok = false;
      break;
    }
    done += n;
  }
  if (!ok && done != 0) {
    backend_.unmap(reinterpret_cast<void*>(addr), done);
    stats_.num_device_alloc -= forget_chunks(seg, addr, done);
  }
  return ok;
}

// resume: maps ps's given-back runs and restores its copies; false (nothing changed) when the
// memory is not there.
bool caching_allocator::impl::resume_segment_locked(tag_state& t, paused_segment& ps,
                                                    resume_work& w) {
  segment* seg = ps.seg;
  const std::size_t chunk = seg->small ? limits_.small_chunk_bytes : limits_.large_chunk_bytes;
  std::size_t given_back = 0;
  for (std::size_t r = 0; r < ps.runs_unmapped; ++r) given_back += ps.runs[r].second;
  if (!detail::ledger::may_hold(static_cast<std::size_t>(stats_.reserved_bytes.current), given_back,
                                limits_.limit_bytes))
    return false;  // over the memory limit: as out of memory
  std::size_t mapped_runs = 0;
  for (; mapped_runs < ps.runs_unmapped; ++mapped_runs) {
    const auto& run = ps.runs[mapped_runs];
    // Tag-sized handles only when asked for (expandable_tag_handle_mb above the chunk); by
    // default the run is mapped again in the chunks growth mapped it in.
    const bool mapped = limits_.tag_handle_bytes != 0
                            ? map_resumed_run_locked(seg, run.first, run.second, chunk)
                            : map_chunks_locked(seg, run.first, run.second, chunk) == run.second;
    if (!mapped) break;
  }
  if (mapped_runs < ps.runs_unmapped) {  // out of memory: the segment stays paused whole
    for (std::size_t r = 0; r < mapped_runs; ++r) {
      backend_.unmap(reinterpret_cast<void*>(ps.runs[r].first), ps.runs[r].second);
      stats_.num_device_alloc -= forget_chunks(seg, ps.runs[r].first, ps.runs[r].second);
    }
    return false;
  }
  for (std::size_t r = 0; r < ps.runs_unmapped; ++r) {
    w.hooks.push_back({sleep_hook_event::kind::after_map, t.name, backend_.device(),
                       ps.runs[r].first, ps.runs[r].second});
  }
  // Offloaded contents come back on the copy stream; each host copy is freed there, so sleep_.host
  // hands it out again only after the restore (or the first copy, for a run never unmapped).
  const auto unmapped_end = ps.runs.begin() + static_cast<std::ptrdiff_t>(ps.runs_unmapped);
  for (detail::offload_copy& c : ps.copies) {
    if (!c.host) continue;
    const bool given = std::any_of(ps.runs.begin(), unmapped_end, [&](const auto& run) {
      return c.addr >= run.first && c.addr + c.bytes <= run.first + run.second;
    });
    if (given) backend_.copy_async(reinterpret_cast<void*>(c.addr), c.host, c.bytes, w.copy_stream);
    // Either way the copy stream reads or writes the block: its owner waits for it below.
    if (ps.copies_enqueued) w.restored = true;
    sleep_.host->deallocate(c.host);
    c.host = nullptr;
  }
  release_pause_events_locked(ps);
  {
    detail::lock_guard<stream_lock> slk(state_of(*seg->owner).mu);
    seg->mapped_bytes += given_back;
    seg->paused_bytes -= given_back;
    seg->paused = false;
  }
  detail::add_reserved(stats_, seg->small, static_cast<std::int64_t>(given_back));
  if (given_back != 0) trace(trace_action::segment_map, seg->base, given_back, seg->stream);
  if (std::find(w.owners.begin(), w.owners.end(), seg->stream) == w.owners.end())
    w.owners.push_back(seg->stream);
  return true;
}

void caching_allocator::impl::order_after_restore_locked(resume_work& w,
                                                         const stream_handle* also) {
  // Work on the segments' streams (and the caller's) after the resume sees the contents.
  if (also && std::find(w.owners.begin(), w.owners.end(), *also) == w.owners.end())
    w.owners.push_back(*also);
  const event_handle ready = get_event();
  backend_.record_event(ready, w.copy_stream);
  ++stats_.events_recorded;
  for (stream_handle s : w.owners) {
    auto it = streams_.states.find(s);
    if (s == w.copy_stream ||
        (it != streams_.states.end() && !it->second->alive.load(std::memory_order_acquire)))
      continue;  // a destroyed stream orders nothing (the caller's may be one not seen yet)
    stream_wait_on(s, ready);  // s is a key (per-thread streams: streams.cpp)
    ++stats_.stream_waits;
  }
  put_event(ready);  // the waits are enqueued: recording it again later changes none of them
}

void caching_allocator::impl::set_phase_after_resume_locked(tag_state& t,
                                                            std::vector<paused_segment> kept) {
  const bool was_pausing = t.phase == tag_phase::pausing;
  t.segments = std::move(kept);
  t.offloaded_host_bytes = 0;
  for (const paused_segment& ps : t.segments) {
    for (const detail::offload_copy& c : ps.copies) t.offloaded_host_bytes += c.host ? c.bytes : 0;
  }
  tag_phase next = tag_phase::active;
  if (!t.segments.empty()) {
    const bool all = std::all_of(t.segments.begin(), t.segments.end(),
                                 [](const auto& ps) { return ps.runs_unmapped == ps.runs.size(); });
    next = all ? tag_phase::paused : tag_phase::pausing;
  }
  if (was_pausing && next != tag_phase::pausing) --sleep_.pauses_pending;
  if (!was_pausing && next == tag_phase::pausing) ++sleep_.pauses_pending;
  t.phase = next;
  if (next == tag_phase::active) t.refused.store(false, std::memory_order_release);
}

// The resume of t on this thread (also of one handed to the worker); throws out_of_memory.
void caching_allocator::impl::resume_tag_locked(device_lock& lk, tag_state& t,
                                                const stream_handle* also,
                                                const std::string& where) {
  if (t.phase == tag_phase::resuming) {  // handed to the worker and not done yet: done here
    t.phase = t.phase_before_resume;
    --sleep_.resumes_pending;
  }
  resume_work w;
  if (std::any_of(t.segments.begin(), t.segments.end(),
                  [](const auto& ps) { return ps.copies_enqueued && !ps.copies.empty(); }))
    w.copy_stream = copy_stream_locked();
  // The memory the tag needs back, made room for within the limit as a growth would be: the
  // untagged cache and other tags' cache go back first (growth_policy.cpp, make_room_locked).
  std::size_t wanted = 0;
  for (const paused_segment& ps : t.segments) {
    for (std::size_t r = 0; r < ps.runs_unmapped; ++r) wanted += ps.runs[r].second;
  }
  if (wanted != 0) make_room_locked(lk, wanted);
  std::vector<paused_segment> kept;
  std::size_t missing = 0;
  for (paused_segment& ps : t.segments) {
    if (missing != 0 || !resume_segment_locked(t, ps, w)) {
      missing += ps.bytes;
      kept.push_back(std::move(ps));
    }
  }
  if (w.restored) order_after_restore_locked(w, also);
  set_phase_after_resume_locked(t, std::move(kept));
  if (!w.hooks.empty() && sleep_.hook) {
    const sleep_hook hook = sleep_.hook;
    detail::unlocked_for_tag(driver_calls_, lk, t, [&] { call_hooks_unlocked(w.hooks, hook); });
  }
  if (w.restored && !opts_.offload_keep_host && sleep_.host) {
    // The backup goes back to the system once the restores are done: on the worker when there
    // is one (this thread does not wait), else here.
    if (worker_usable_locked() && ensure_worker_locked()) {
      sleep_.host_trim_pending = true;
      worker_.kick_now();
    } else {
      trim_host_locked(lk, &t);
    }
  }
  if (missing != 0) {
    ++stats_.num_ooms;
    const std::string message = where + ": out of memory mapping " + std::to_string(missing) +
                                " bytes; that part stays paused, the rest is resumed: free memory "
                                "and call resume again";
    detail::log().warn("{}", message);
    throw out_of_memory(message);
  }
}

// offload_keep_host false: the pinned host memory that holds no paused tag's copy goes back
// (waiting, mu_ dropped, for the restores that read it). t: the tag whose resume asks, kept
// busy meanwhile (null on the worker's own pass).
void caching_allocator::impl::trim_host_locked(device_lock& lk, tag_state* t) {
  sleep_.host_trim_pending = false;
  caching_allocator* host = sleep_.host.get();
  if (!host) return;
  auto trim = [host] { host->empty_cache(empty_cache_mode::wait); };
  if (t) {
    detail::unlocked_for_tag(driver_calls_, lk, *t, trim);
  } else {
    driver_call_scope in_flight(driver_calls_, lk);
    trim();
  }
}

// The worker: the resumes handed to it.
std::size_t caching_allocator::impl::advance_resumes_locked(device_lock& lk) {
  std::vector<tag_state*> resuming;
  for (auto& [id, t] : sleep_.tags) {
    if (t->phase == tag_phase::resuming) resuming.push_back(t.get());
  }
  std::size_t resumed = 0;
  for (tag_state* t : resuming) {
    wait_tag_idle_locked(lk, *t);
    if (t->phase != tag_phase::resuming) continue;
    const bool has_also = t->has_resume_stream;
    const stream_handle also = t->resume_stream;
    try {
      resume_tag_locked(lk, *t, has_also ? &also : nullptr,
                        "streamsafe: resume('" + t->name + "') on device " +
                            std::to_string(backend_.device()) + " (release worker)");
      t->resume_error.clear();
    } catch (const std::exception& e) {
      if (!lk.owns_lock()) lk.lock();
      t->resume_error = e.what();  // tag_status().error; the tag stays paused
    }
    ++resumed;
  }
  return resumed;
}

pause_status caching_allocator::resume_impl(std::string_view tag, const stream_handle* also) {
  impl& m = *impl_;
  if (m.inherited()) m.throw_inherited("resume");
  const tag_id id = tag_of(tag);
  const std::string where = "streamsafe: resume('" + std::string(tag) + "') on device " +
                            std::to_string(m.backend_.device());
  if (callback_scope::active())
    throw std::logic_error(where + " inside a stream callback: a resume makes CUDA calls");
  device_lock lk(m.mu_);
  auto found = m.sleep_.tags.find(id);
  if (found == m.sleep_.tags.end())
    return detail::sleep_state::unknown_tag_status(tag);  // nothing of the tag here: a no-op
  impl::tag_state& t = *found->second;
  m.wait_tag_idle_locked(lk, t);
  if (t.phase == tag_phase::active) return m.tag_status_locked(t);  // resuming twice: a no-op
  m.detect_captures_locked(lk);
  if (m.capturing())
    throw std::logic_error(where + " during a CUDA graph capture: resume after the capture ends");
  m.resume_tag_locked(lk, t, also, where);
  return m.tag_status_locked(t);
}

pause_status caching_allocator::resume_async(std::string_view tag) {
  return resume_async_impl(tag, nullptr);
}

pause_status caching_allocator::resume_async(std::string_view tag, stream_handle also_order) {
  also_order = impl_->key_of(also_order);  // cudaStreamPerThread: this thread's
  return resume_async_impl(tag, &also_order);
}

pause_status caching_allocator::resume_async_impl(std::string_view tag, const stream_handle* also) {
  impl& m = *impl_;
  {
    device_lock lk(m.mu_);
    const tag_id id = tag_of(tag);
    auto found = m.sleep_.tags.find(id);
    if (!m.inherited() && !callback_scope::active() && m.worker_usable_locked() &&
        found != m.sleep_.tags.end() && m.ensure_worker_locked()) {
      impl::tag_state& t = *found->second;
      if (t.phase == tag_phase::resuming || t.phase == tag_phase::active)
        return m.tag_status_locked(t);  // already handed over, or nothing to do
      t.phase_before_resume = t.phase;
      t.phase = tag_phase::resuming;
      t.has_resume_stream = also != nullptr;
      t.resume_stream = also ? *also : 0;
      ++m.sleep_.resumes_pending;
      m.worker_.kick_now();
      return m.tag_status_locked(t);
    }
  }
  return resume_impl(tag, also);  // no worker: on this thread
}

pause_status caching_allocator::wait_resumed(std::string_view tag,
                                             std::chrono::nanoseconds timeout) {
  impl& m = *impl_;
  const tag_id id = tag_of(tag);
  device_lock lk(m.mu_);
  auto found = m.sleep_.tags.find(id);
  if (found == m.sleep_.tags.end()) return detail::sleep_state::unknown_tag_status(tag);
  impl::tag_state& t = *found->second;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (t.phase == tag_phase::resuming && std::chrono::steady_clock::now() < deadline) {
    if (!m.worker_.thread || !m.worker_usable_locked()) break;
    if (!m.wait_for_worker_locked(lk, &deadline)) break;
  }
  if (t.phase == tag_phase::resuming && (!m.worker_.thread || !m.worker_usable_locked())) {
    m.resume_tag_locked(lk, t, t.has_resume_stream ? &t.resume_stream : nullptr,
                        "streamsafe: resume('" + t.name + "')");
  }
  return m.tag_status_locked(t);
}

}  // namespace streamsafe
