// streamsafe core: the sleep/wake state (internal; sleep.cpp pauses, wake.cpp resumes, tags.cpp
// makes the tagged pools): each tag this allocator holds memory of, its phase and its paused
// segments, the hook called around unmaps and maps, and offload's copy stream and pinned host
// allocator.
// Lock rule: impl::sleep_ is GUARDED_BY(mu_), the device lock; every member, and every
// tag_state and paused_segment it holds, is read and written under it, except tag_state::refused
// (an atomic the fast path reads through its tag_pools, with the stream lock only). Driver calls
// of a pause or resume run with mu_ dropped and tag_state::busy counted (impl::unlocked_for_tag).
#pragma once

#include "core/blocks/block.hpp"
#include "core/common/driver_calls.hpp"

#include <streamsafe/core/caching_allocator.hpp>
#include <streamsafe/core/sleep.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace streamsafe::detail {

// One live block's copy in pinned host memory (offload mode).
struct offload_copy {
  std::uintptr_t addr = 0;
  std::size_t bytes = 0;
  void* host = nullptr;  // from sleep_state::host (allocated on copy_stream)
};

// One segment of a tag being paused: its mapped runs (chunk-aligned, every mapped block but
// those being released), its fence, and in offload mode the copies of its live blocks.
struct paused_segment {
  segment* seg = nullptr;
  std::vector<std::pair<std::uintptr_t, std::size_t>> runs;
  std::size_t bytes = 0;
  std::vector<pending_event> fence;
  std::vector<stream_handle> fence_streams;
  std::vector<offload_copy> copies;
  bool copies_enqueued = false;
  event_handle copied = 0;        // recorded on copy_stream after the copies
  std::size_t runs_unmapped = 0;  // runs[0, runs_unmapped) are back with the driver
};

struct tag_state {
  tag_id id = 0;
  std::string name;
  std::atomic<bool> refused{false};  // allocation under the tag throws tag_paused
  tag_phase phase = tag_phase::active;
  pause_mode mode = pause_mode::discard;
  std::vector<paused_segment> segments;
  std::size_t offloaded_host_bytes = 0;
  int busy = 0;  // pause/resume driver calls in flight with mu_ dropped
  // resume_async: the phase before `resuming`, the caller's stream, the worker's last error.
  tag_phase phase_before_resume = tag_phase::paused;
  bool has_resume_stream = false;
  stream_handle resume_stream = 0;
  std::string resume_error;
};

// What a resume of one tag did: maps and copies back, the hooks to call, the owner streams to
// order after the restores (wake.cpp).
struct resume_work {
  stream_handle copy_stream = 0;
  std::vector<sleep_hook_event> hooks;
  std::vector<stream_handle> owners;
  bool restored = false;
};

struct sleep_state {
  std::unordered_map<tag_id, std::unique_ptr<tag_state>> tags;  // created on first use
  std::size_t pauses_pending = 0;                               // tags in phase pausing
  std::size_t resumes_pending = 0;                              // tags in phase resuming
  sleep_hook hook;
  stream_handle copy_stream = 0;
  bool has_copy_stream = false;
  std::unique_ptr<caching_allocator> host;  // offload's pinned memory
  bool host_trim_pending = false;           // offload_keep_host false: the worker empties `host`

  // The status of a tag this allocator holds nothing of: active, no bytes.
  static pause_status unknown_tag_status(std::string_view tag) {
    pause_status s;
    s.tag = std::string(tag);
    return s;
  }
};

// Runs f with mu_ (held in lk) dropped and t.busy counted (resume and pause of t wait for it, on
// calls.done); rethrows what f threw once mu_ is held again.
template <class F>
void unlocked_for_tag(driver_calls& calls, unique_lock<mutex>& lk, tag_state& t, F&& f) {
  std::exception_ptr failed;
  ++t.busy;
  {
    driver_call_scope in_flight(calls, lk);
    try {
      f();
    } catch (...) {
      failed = std::current_exception();
    }
  }
  --t.busy;
  calls.done.notify_all();
  if (failed) std::rethrow_exception(failed);
}

}  // namespace streamsafe::detail
