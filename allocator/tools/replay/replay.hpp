// streamsafe-replay: replaying a replay_program through a real caching_allocator.
//
// A pass builds a fresh device (simulated, or a GPU through streamsafe::cuda backends), wraps
// it in a recording_backend, builds a caching_allocator with the given options, maps the
// trace's streams to device streams (trace stream 0 -> the legacy default stream 0, others ->
// new streams), and runs the steps: alloc -> allocate(size, stream); free -> deallocate(ptr)
// on the allocation stream, deallocate(ptr, stream) (a stream-ordered free) on another. An
// allocation that throws out_of_memory is counted and its free skipped. After the steps, blocks
// the trace never freed are freed (untimed, unrecorded) so the allocator is destroyed clean.
//
// run_replay() runs, in order: `timed_passes` timed passes (the loop does nothing but allocator
// calls; the best time gives events/s), one instrumented pass (the trace, the timeline of
// allocated and reserved bytes, the step of peak allocated bytes), and, when asked, a pass that
// stops at that step and takes a memory_snapshot. Passes on the simulated device are
// deterministic, so every pass makes the same decisions.
//
// Until the core offers a trace hook and caching_allocator::snapshot(), the trace's segment
// rows and the snapshot's segments come from the recording_backend, and blocks from the
// tool's own view of live allocations (find_block for their sizes): blocks freed on another
// stream and still waiting for their events then show as inactive, not pending_free.
// Thread safety: one replay per thread; nothing is shared between calls.
#pragma once

#include "recording_backend.hpp"
#include "trace_reader.hpp"

#include <streamsafe/core/options.hpp>
#include <streamsafe/core/snapshot.hpp>
#include <streamsafe/core/statistics.hpp>
#include <streamsafe/core/trace.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace streamsafe::replay {

// One device for one pass; destroyed after the allocator built on it.
class replay_device {
 public:
  virtual ~replay_device() = default;
  virtual device_backend& backend() = 0;
  // The device stream standing for the trace's stream id (created on first use; 0 -> 0).
  virtual stream_handle stream(std::uint64_t trace_stream) = 0;
  virtual std::string description() const = 0;
};

// The simulated device of total_bytes (granularity 2 MiB, expandable segments supported).
std::unique_ptr<replay_device> make_simulated_device(std::size_t total_bytes);
// A GPU through streamsafe::cuda's cuda_malloc or expandable backend; trace streams other than 0
// become new non-blocking CUDA streams. Throws backend_error where there is no such GPU.
std::unique_ptr<replay_device> make_gpu_device(int device, backend_kind kind);

struct timeline_point {
  std::uint64_t time_us = 0;   // trace time of the last step in the bucket
  std::int64_t allocated = 0;  // the most allocated bytes within the bucket
  std::int64_t reserved = 0;   // the most reserved bytes within the bucket
};

// What one pass asks for beyond the replay itself (all off: a timed pass).
struct pass_options {
  trace_recorder* trace = nullptr;  // the tool-level trace of the pass
  std::size_t timeline_points = 0;  // 0: no timeline; else at most this many buckets
  bool track_peak = false;          // follow allocated bytes to find the step of the peak
  std::optional<std::size_t> snapshot_after_step;  // stop after this step and take a snapshot
};

// One repetition of a repeated program (repeat.hpp), from the instrumented pass.
struct repetition_result {
  recording_backend::counts segment_ops;  // segment operations made during the repetition
  std::int64_t peak_allocated = 0;        // the most allocated bytes within it
  std::int64_t peak_reserved = 0;         // the most reserved bytes within it
  double seconds = 0;  // host time of the repetition in the fastest timed pass (0: none ran)
};

struct pass_result {
  double seconds = 0;               // host time of the step loop
  std::size_t steps = 0;            // steps run
  std::size_t ooms = 0;             // allocations that threw out_of_memory
  std::size_t frees_skipped = 0;    // frees of those allocations
  statistics stats;                 // after the steps, before the cleanup frees
  std::int64_t peak_allocated = 0;  // track_peak: the most allocated bytes seen by the tool
  std::size_t peak_step = 0;        // track_peak: first step reaching peak_allocated
  std::int64_t reserved_end = 0;    // recording_backend's reserved bytes after the steps
  recording_backend::counts segment_ops;
  std::vector<timeline_point> timeline;
  std::vector<repetition_result> repetitions;  // instrumented pass of a repeated program
  std::vector<double> repetition_seconds;      // timed pass: each repetition's host time
  std::optional<memory_snapshot> snapshot;
};

// One pass over a device the caller made (fresh: its memory unused).
pass_result run_pass(const replay_program& program, replay_device& device, const options& opts,
                     const pass_options& pass);

struct replay_settings {
  options alloc_options;
  std::function<std::unique_ptr<replay_device>()> make_device;  // called once per pass
  int timed_passes = 3;                // 0: no timed pass (seconds from the instrumented one)
  std::size_t trace_capacity = 0;      // 0: no trace
  std::size_t timeline_points = 2000;  // 0: no timeline
  bool snapshot_at_peak = false;
};

struct replay_report {
  std::string device;       // description of the device
  double best_seconds = 0;  // fastest timed pass (or the instrumented pass when none)
  pass_result result;       // the instrumented pass
  std::vector<trace_event> trace;
  std::uint64_t trace_dropped = 0;
  std::optional<memory_snapshot> peak_snapshot;
  double events_per_second() const;
  double ratio() const;  // peak reserved / peak allocated (0 when nothing was allocated)
};

replay_report run_replay(const replay_program& program, const replay_settings& settings);

// A memory_snapshot from what the tool knows: the recording backend's segments and mapped
// ranges, and the live blocks (address, block size, requested size, trace stream).
struct live_block {
  std::uintptr_t address = 0;
  std::size_t size_bytes = 0;
  std::size_t requested_bytes = 0;
  stream_handle stream = 0;
};
memory_snapshot build_snapshot(
    const std::map<std::uintptr_t, recording_backend::segment_view>& segments,
    std::vector<live_block> blocks, const statistics& stats, int device, std::uint64_t time_us);

}  // namespace streamsafe::replay
