// streamsafe core: the state of one device's caching allocator (internal): detail::
// allocator_state, the base of caching_allocator::impl (allocator_impl.hpp, which declares the
// functions). One member per concern, each a type of its own header with its lock rule there:
//   stream_state.hpp      stream_state (each under its own lock), stream_registry  streams_
//   event_pool.hpp        pooled events, under the pool's own leaf lock           events_
//   release_queue.hpp     release_batch, the deferred queue, unfenced frees       releases_
//   release_worker.hpp    the worker thread, its flags and pass counters          worker_
//   capture_state.hpp     captures, graphs, held frees                            capture_
//   sleep_state.hpp       tags, paused segments, hook, offload's copy stream      sleep_
//   ipc_registry.hpp      exports and imports                                     ipc_
//   driver_calls.hpp      driver calls made with mu_ dropped                      driver_calls_
//   growth_state.hpp      limits (fixed at construction), the high-water mark     limits_, growth_
//   ledger/ledger.hpp     held bytes by state; memory being released               ledger_
//   statistics_state.hpp  per-stream counters, device counters, sampled peaks     stats_, sampling_
// Locks, in order: mu_ (the device lock, slow paths only) guards every member marked GUARDED_BY;
// then any number of stream_state::mu (the same-stream fast path takes only its own); the event
// pool's lock is a leaf. Whoever holds mu_ may take stream locks; a thread holding a stream lock
// never waits for mu_ (the fast path drops its stream lock, takes mu_, then the stream lock
// again). Holding mu_ does not keep a stream's pools still: what was seen under a stream lock
// holds only while that lock is held, since that stream's fast path may allocate from them as
// soon as it is dropped (steal_segment_locked re-checks its choice under the lock). mu_ is
// dropped around host-blocking backend calls (synchronize_event, synchronize_device) and the
// driver calls that return memory (free_segment, unmap), whose blocks are detached (state
// releasing) meanwhile: driver_call_scope counts them. The members not GUARDED_BY are fixed at
// construction, atomics read without a lock, or the event pool (its own lock).
// clang checks these rules (-Wthread-safety, thread_annotations.hpp).
#pragma once

#include "core/capture/capture_state.hpp"
#include "core/common/driver_calls.hpp"
#include "core/common/thread_annotations.hpp"
#include "core/events/event_pool.hpp"
#include "core/growth/growth_room.hpp"
#include "core/growth/growth_state.hpp"
#include "core/ipc/ipc_registry.hpp"
#include "core/ledger/ledger.hpp"
#include "core/options/runtime_settings.hpp"
#include "core/release/release_queue.hpp"
#include "core/release/release_worker.hpp"
#include "core/sleep/sleep_state.hpp"
#include "core/stats/statistics_state.hpp"
#include "core/streams/stream_state.hpp"

#include <streamsafe/core/caching_allocator.hpp>

#include <atomic>
#include <cstdint>
#include <memory>

namespace streamsafe::detail {

// Who made an allocator: fixed at construction (caching_allocator.cpp).
struct allocator_identity {
  std::uint64_t id = 0;
  std::uint64_t fork_generation = 0;
  std::int64_t creator_pid = 0;
};

struct allocator_state {
  allocator_state(device_backend& backend, options opts, const allocator_identity& who)
      : backend_(backend), opts_(opts), runtime_(runtime_options::of(opts)), id_(who.id),
        fork_generation_(who.fork_generation), creator_pid_(who.creator_pid) {}

  device_backend& backend_;
  // The options given at creation. max_split_size_bytes, garbage_collection_threshold and
  // roundup_power2_divisions are read from runtime_ instead: they may change while it runs.
  options opts_;
  runtime_settings runtime_;
  const std::uint64_t id_;               // distinguishes allocators in the threads' stream caches
  const std::uint64_t fork_generation_;  // fork.cpp: the process's fork count when it was made
  const std::int64_t creator_pid_;       // release_worker.cpp: no worker in another process
  bool trace_log_ = false;  // the logger was at trace level when the allocator was made
  std::unique_ptr<trace_recorder> own_trace_;    // when options::trace_capacity is set
  std::atomic<trace_recorder*> trace_{nullptr};  // where trace events go (nullptr: off)

  mutable mutex mu_;      // the device lock
  growth_limits limits_;  // written only by the constructor: read without a lock
  stream_registry streams_ STREAMSAFE_GUARDED_BY(mu_);
  std::atomic<std::int64_t> tombstone_refs_{0};  // tombstone entries of pending blocks and waits
  event_pool events_;                            // its own leaf lock
  release_queue releases_ STREAMSAFE_GUARDED_BY(mu_);
  release_worker worker_ STREAMSAFE_GUARDED_BY(mu_);
  capture_state capture_ STREAMSAFE_GUARDED_BY(mu_);
  std::atomic<int> captures_underway_{0};  // capture_.captures.size(), read without mu_
  std::atomic<int> routes_open_{0};        // capture_.routes.size(), read without mu_
  sleep_state sleep_ STREAMSAFE_GUARDED_BY(mu_);
  ipc_registry ipc_ STREAMSAFE_GUARDED_BY(mu_);
  driver_calls driver_calls_ STREAMSAFE_GUARDED_BY(mu_);
  growth_state growth_ STREAMSAFE_GUARDED_BY(mu_);
  ledger ledger_ STREAMSAFE_GUARDED_BY(mu_);
  statistics stats_ STREAMSAFE_GUARDED_BY(mu_);  // device-level; per stream: stream_state::stats
  peak_sampler sampling_;                        // atomics, no lock
  // The fast path's hint of free headroom under the peak (growth_policy.cpp): written under mu_
  // where reserved bytes change, read without it (a stale hint only sends a request to the slow
  // path, which decides under mu_).
  std::atomic<std::size_t> headroom_hint_{0};

  void trace(trace_action action, std::uintptr_t address, std::size_t size,
             stream_handle stream) noexcept {
    if (trace_recorder* t = trace_.load(std::memory_order_acquire))
      t->record(action, address, size, stream, backend_.device());
  }
  bool capturing() const noexcept {
    return captures_underway_.load(std::memory_order_acquire) != 0;
  }
  std::size_t reserved_high_water_locked() const STREAMSAFE_REQUIRES(mu_) {
    return growth_.high_water(stats_);
  }
  // Reserved bytes against the limit and the peak, for the growth rules (growth_room.hpp).
  growth_room growth_room_locked() const STREAMSAFE_REQUIRES(mu_) {
    return {static_cast<std::size_t>(stats_.reserved_bytes.current), limits_.limit_bytes,
            reserved_high_water_locked()};
  }
  // Reserved bytes on their way back: the deferred queue and the worker's release in flight.
  std::size_t queued_release_bytes_locked() const STREAMSAFE_REQUIRES(mu_) {
    return releases_.bytes() + stats_.release_worker_bytes;
  }
};

}  // namespace streamsafe::detail

namespace streamsafe {

// Short names for the core's source files (through allocator_impl.hpp, the only includer).
using detail::block;
using detail::block_state;
using detail::driver_call_scope;
using detail::for_each_pool;
using detail::pool;
using detail::pool_of;
using detail::segment;
using detail::state_of;
using detail::stream_lock;
using detail::tagged_pool;
using device_lock = detail::unique_lock<detail::mutex>;  // mu_, dropped around driver calls

}  // namespace streamsafe
