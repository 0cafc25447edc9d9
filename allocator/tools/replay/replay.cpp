// streamsafe-replay: the replay passes (see replay.hpp) and the simulated replay device.
//
// The timed loop touches only vectors indexed by slot and the allocator; everything the
// instrumented loop adds (find_block, the recording backend's context, the trace, the
// timeline) stays out of it. Slots are dense, so ptrs / slot_* vectors replace a map.
#include "replay.hpp"

#include <streamsafe/core/caching_allocator.hpp>
#include <streamsafe/sim/simulated_device.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <unordered_map>

namespace streamsafe::replay {
namespace {

class simulated_replay_device final : public replay_device {
 public:
  explicit simulated_replay_device(std::size_t total_bytes) : dev_(config(total_bytes)) {}

  device_backend& backend() override { return dev_; }
  stream_handle stream(std::uint64_t trace_stream) override {
    if (trace_stream == 0) return 0;
    auto [it, inserted] = streams_.emplace(trace_stream, 0);
    if (inserted) it->second = dev_.create_stream();
    return it->second;
  }
  std::string description() const override {
    std::size_t free_bytes = 0, total = 0;
    const_cast<sim::simulated_device&>(dev_).memory_info(free_bytes, total);
    char buf[96];
    std::snprintf(buf, sizeof buf, "simulated device, %.2f GiB",
                  static_cast<double>(total) / (1u << 30));
    return buf;
  }

 private:
  static sim::device_config config(std::size_t total_bytes) {
    sim::device_config c;
    c.total_bytes = total_bytes;
    return c;
  }
  sim::simulated_device dev_;
  std::unordered_map<std::uint64_t, stream_handle> streams_;
};

bool small_request(std::size_t size_bytes) {
  // The allocator's size classes: 512-byte rounding, small pool up to 1 MiB.
  const std::size_t rounded = size_bytes < 512 ? 512 : (size_bytes + 511) / 512 * 512;
  return rounded <= (std::size_t{1} << 20);
}

}  // namespace

std::unique_ptr<replay_device> make_simulated_device(std::size_t total_bytes) {
  return std::make_unique<simulated_replay_device>(total_bytes);
}

pass_result run_pass(const replay_program& prog, replay_device& device, const options& opts,
                     const pass_options& pass) {
  recording_backend rec(device.backend());
  rec.set_recorder(pass.trace);
  std::vector<stream_handle> streams(prog.trace_streams.size());
  for (std::size_t i = 0; i < streams.size(); ++i)
    streams[i] = device.stream(prog.trace_streams[i]);
  std::vector<void*> ptrs(prog.slot_count, nullptr);
  std::vector<std::uint32_t> slot_stream(prog.slot_count, 0);
  const bool instrumented = pass.trace || pass.timeline_points != 0 || pass.track_peak ||
                            pass.snapshot_after_step.has_value();
  std::vector<std::size_t> slot_block(instrumented ? prog.slot_count : 0, 0);
  std::vector<std::size_t> slot_requested(instrumented ? prog.slot_count : 0, 0);
  const std::size_t end = pass.snapshot_after_step
                              ? std::min(*pass.snapshot_after_step + 1, prog.steps.size())
                              : prog.steps.size();
  const int dev_id = device.backend().device();

  pass_result r;
  caching_allocator alloc(rec, opts);
  const auto start = std::chrono::steady_clock::now();
  if (!instrumented) {
    // A repeated program: the host time of each repetition (one compare per step).
    std::size_t next_rep = 0;
    std::size_t next_start = prog.repetition_starts.empty() ? end : prog.repetition_starts[0];
    auto mark = start;
    for (std::size_t i = 0; i < end; ++i) {
      if (i == next_start) {
        const auto now = std::chrono::steady_clock::now();
        if (next_rep > 0)
          r.repetition_seconds.push_back(std::chrono::duration<double>(now - mark).count());
        mark = now;
        ++next_rep;
        next_start = next_rep < prog.repetition_starts.size() ? prog.repetition_starts[next_rep]
                                                              : end;
      }
      const replay_step& s = prog.steps[i];
      if (s.alloc) {
        try {
          ptrs[s.slot] = alloc.allocate(s.size_bytes, streams[s.stream]);
          slot_stream[s.slot] = s.stream;
        } catch (const out_of_memory&) {
          ptrs[s.slot] = nullptr;
          ++r.ooms;
        }
      } else if (void* p = ptrs[s.slot]) {
        if (slot_stream[s.slot] == s.stream) alloc.deallocate(p);
        else alloc.deallocate(p, streams[s.stream]);
        ptrs[s.slot] = nullptr;
      } else {
        ++r.frees_skipped;
      }
    }
    if (next_rep > 0)
      r.repetition_seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - mark).count());
  } else {
    const std::size_t buckets = std::min(pass.timeline_points, prog.steps.size());
    r.timeline.resize(buckets);
    std::int64_t allocated = 0;
    std::size_t rep = 0;  // the repetition running (repeat.hpp)
    recording_backend::counts ops_before;
    auto close_repetition = [&] {
      if (prog.repetition_starts.empty()) return;
      const recording_backend::counts now = rec.operation_counts();
      repetition_result& out = r.repetitions.back();
      out.segment_ops = {now.segment_allocs - ops_before.segment_allocs,
                         now.segment_frees - ops_before.segment_frees, now.maps - ops_before.maps,
                         now.unmaps - ops_before.unmaps};
      ops_before = now;
    };
    for (std::size_t i = 0; i < end; ++i) {
      const replay_step& s = prog.steps[i];
      if (rep < prog.repetition_starts.size() && i == prog.repetition_starts[rep]) {
        if (rep > 0) close_repetition();
        r.repetitions.emplace_back();
        ++rep;
      }
      const stream_handle trace_stream = prog.trace_streams[s.stream];
      rec.set_context(s.time_us, trace_stream, small_request(s.size_bytes));
      if (s.alloc) {
        try {
          void* p = alloc.allocate(s.size_bytes, streams[s.stream]);
          ptrs[s.slot] = p;
          slot_stream[s.slot] = s.stream;
          slot_block[s.slot] = alloc.find_block(p).size_bytes;
          slot_requested[s.slot] = s.size_bytes;
          allocated += static_cast<std::int64_t>(slot_block[s.slot]);
          if (pass.trace) {
            pass.trace->record({s.time_us, trace_action::alloc, reinterpret_cast<std::uintptr_t>(p),
                                s.size_bytes, trace_stream, dev_id});
          }
        } catch (const out_of_memory&) {
          ptrs[s.slot] = nullptr;
          ++r.ooms;
          if (pass.trace)
            pass.trace->record(
                {s.time_us, trace_action::oom, 0, s.size_bytes, trace_stream, dev_id});
        }
      } else if (void* p = ptrs[s.slot]) {
        const bool same_stream = slot_stream[s.slot] == s.stream;
        if (same_stream) alloc.deallocate(p);
        else alloc.deallocate(p, streams[s.stream]);
        ptrs[s.slot] = nullptr;
        allocated -= static_cast<std::int64_t>(slot_block[s.slot]);
        if (pass.trace) {
          const auto addr = reinterpret_cast<std::uintptr_t>(p);
          pass.trace->record(
              {s.time_us, trace_action::free_requested, addr, s.size_bytes, trace_stream, dev_id});
          // A free on another stream completes when its events do, which the tool cannot see.
          if (same_stream) {
            pass.trace->record({s.time_us, trace_action::free_completed, addr, s.size_bytes,
                                trace_stream, dev_id});
          }
        }
      } else {
        ++r.frees_skipped;
      }
      if (allocated > r.peak_allocated) {
        r.peak_allocated = allocated;
        r.peak_step = i;
      }
      if (!r.repetitions.empty()) {  // the tool's own counts: no stats() call per step
        repetition_result& cur = r.repetitions.back();
        cur.peak_allocated = std::max(cur.peak_allocated, allocated);
        cur.peak_reserved = std::max(cur.peak_reserved, rec.reserved_bytes());
      }
      if (buckets != 0) {
        timeline_point& b = r.timeline[i * buckets / prog.steps.size()];
        b.time_us = s.time_us;
        b.allocated = std::max(b.allocated, allocated);
        b.reserved = std::max(b.reserved, rec.reserved_bytes());
      }
    }
    if (!r.repetitions.empty()) close_repetition();
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.steps = end;
  r.stats = alloc.stats();
  r.reserved_end = rec.reserved_bytes();
  r.segment_ops = rec.operation_counts();
  rec.set_recorder(nullptr);

  if (pass.snapshot_after_step) {
    std::vector<live_block> blocks;
    for (std::size_t slot = 0; slot < ptrs.size(); ++slot) {
      if (!ptrs[slot]) continue;
      blocks.push_back({reinterpret_cast<std::uintptr_t>(ptrs[slot]), slot_block[slot],
                        slot_requested[slot], prog.trace_streams[slot_stream[slot]]});
    }
    const std::uint64_t t = end ? prog.steps[end - 1].time_us : 0;
    r.snapshot = build_snapshot(rec.segments(), std::move(blocks), r.stats, dev_id, t);
  }
  for (void* p : ptrs) {
    if (p) alloc.deallocate(p);
  }
  return r;
}

double replay_report::events_per_second() const {
  return best_seconds > 0 ? static_cast<double>(result.steps) / best_seconds : 0.0;
}

double replay_report::ratio() const {
  const auto& s = result.stats;
  return s.allocated_bytes.peak > 0 ? static_cast<double>(s.reserved_bytes.peak) /
                                          static_cast<double>(s.allocated_bytes.peak)
                                    : 0.0;
}

replay_report run_replay(const replay_program& program, const replay_settings& settings) {
  replay_report rep;
  double best = std::numeric_limits<double>::infinity();
  std::vector<double> best_repetitions;
  for (int i = 0; i < settings.timed_passes; ++i) {
    auto dev = settings.make_device();
    pass_result r = run_pass(program, *dev, settings.alloc_options, {});
    best = std::min(best, r.seconds);
    if (best_repetitions.empty()) best_repetitions = r.repetition_seconds;
    for (std::size_t k = 0; k < r.repetition_seconds.size() && k < best_repetitions.size(); ++k)
      best_repetitions[k] = std::min(best_repetitions[k], r.repetition_seconds[k]);
  }
  std::optional<trace_recorder> recorder;
  if (settings.trace_capacity != 0) recorder.emplace(settings.trace_capacity);
  {
    auto dev = settings.make_device();
    rep.device = dev->description();
    pass_options po;
    po.trace = recorder ? &*recorder : nullptr;
    po.timeline_points = settings.timeline_points;
    po.track_peak = true;
    rep.result = run_pass(program, *dev, settings.alloc_options, po);
  }
  rep.best_seconds = settings.timed_passes > 0 ? best : rep.result.seconds;
  for (std::size_t k = 0; k < best_repetitions.size() && k < rep.result.repetitions.size(); ++k)
    rep.result.repetitions[k].seconds = best_repetitions[k];
  if (recorder) {
    rep.trace = recorder->events();
    rep.trace_dropped = recorder->dropped();
  }
  if (settings.snapshot_at_peak && rep.result.peak_allocated > 0) {
    auto dev = settings.make_device();
    pass_options ps;
    ps.snapshot_after_step = rep.result.peak_step;
    rep.peak_snapshot = std::move(run_pass(program, *dev, settings.alloc_options, ps).snapshot);
  }
  return rep;
}

memory_snapshot build_snapshot(
    const std::map<std::uintptr_t, recording_backend::segment_view>& segments,
    std::vector<live_block> blocks, const statistics& stats, int device, std::uint64_t time_us) {
  std::sort(blocks.begin(), blocks.end(),
            [](const live_block& a, const live_block& b) { return a.address < b.address; });
  memory_snapshot snap;
  snap.device = device;
  snap.time_us = time_us;
  snap.stats = stats;
  for (const auto& [base, view] : segments) {
    segment_snapshot seg;
    seg.address = base;
    seg.size_bytes = view.size_bytes;
    seg.stream = view.stream;
    seg.pool = view.small ? snapshot_pool::small : snapshot_pool::large;
    seg.expandable = view.expandable;
    // Mapped intervals, adjacent ones merged.
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>> mapped;
    if (!view.expandable) {
      mapped.push_back({base, base + view.size_bytes});
    } else {
      for (const auto& [addr, bytes] : view.mapped) {
        if (!mapped.empty() && mapped.back().second == addr) mapped.back().second += bytes;
        else mapped.push_back({addr, addr + bytes});
      }
    }
    auto add = [&](std::uintptr_t addr, std::size_t size, snapshot_block_state state,
                   std::size_t requested, stream_handle stream) {
      block_snapshot b;
      b.address = addr;
      b.size_bytes = size;
      b.requested_bytes = requested;
      b.state = state;
      b.stream = stream;
      seg.blocks.push_back(std::move(b));
    };
    auto it = std::lower_bound(blocks.begin(), blocks.end(), base,
                               [](const live_block& b, std::uintptr_t a) { return b.address < a; });
    std::uintptr_t pos = base;
    for (const auto& [lo, hi] : mapped) {
      if (pos < lo) add(pos, lo - pos, snapshot_block_state::unmapped, 0, view.stream);
      pos = lo;
      for (; it != blocks.end() && it->address < hi; ++it) {
        if (it->address < pos) continue;  // not inside a mapped interval: cannot happen
        if (it->address > pos)
          add(pos, it->address - pos, snapshot_block_state::inactive, 0, view.stream);
        add(it->address, it->size_bytes, snapshot_block_state::active, it->requested_bytes,
            it->stream);
        pos = it->address + it->size_bytes;
      }
      if (pos < hi) add(pos, hi - pos, snapshot_block_state::inactive, 0, view.stream);
      seg.mapped_bytes += hi - lo;
      pos = hi;
    }
    if (pos < base + view.size_bytes)
      add(pos, base + view.size_bytes - pos, snapshot_block_state::unmapped, 0, view.stream);
    snap.segments.push_back(std::move(seg));
  }
  return snap;
}

}  // namespace streamsafe::replay
