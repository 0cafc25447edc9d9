// streamsafe benchmarks: the simulated-device adapters (streamsafe_bench_sim).
//
// The real caching allocator over streamsafe::sim::simulated_device: no CUDA runtime call
// anywhere, so these runs measure the allocator's bookkeeping alone (size classes, pools, block
// split and merge, stream-use tracking). The simulated device takes one mutex per call, but the
// same-stream allocate/free path does not call the device once its pool is warm.
//
// One simulated device (80 GiB, 2 MiB granularity) serves both adapters; each adapter owns one
// caching_allocator, created on first use and intentionally never destroyed (the process exits
// with it, so no teardown lands in a measurement). The adapter shape is described in
// bench_common.hpp.
#pragma once

#include "bench_common.hpp"

#include <streamsafe/core/caching_allocator.hpp>
#include <streamsafe/sim/simulated_device.hpp>

#include <array>
#include <atomic>
#include <mutex>

namespace streamsafe_bench {

// The simulated device and its stream pool.
struct sim_env {
  static streamsafe::sim::simulated_device& device() {
    static auto* dev = new streamsafe::sim::simulated_device(streamsafe::sim::device_config{});
    return *dev;
  }

  static streamsafe::stream_handle stream(stream_role role, int index = 0) {
    static std::array<std::atomic<streamsafe::stream_handle>, k_stream_slots> slots{};
    static std::mutex create_mutex;
    std::atomic<streamsafe::stream_handle>& slot =
        slots[static_cast<std::size_t>(stream_slot(role, index))];
    streamsafe::stream_handle s = slot.load(std::memory_order_acquire);
    if (s != 0) return s;
    std::lock_guard<std::mutex> lock(create_mutex);
    s = slot.load(std::memory_order_relaxed);
    if (s == 0) {
      s = device().create_stream();
      slot.store(s, std::memory_order_release);
    }
    return s;
  }
};

// Reuse = all_streams: options::reuse_fence:all_streams, with a second stream (stream_role::other)
// known to the allocator, so that each reuse fence records one event.
template <streamsafe::backend_kind Kind,
          streamsafe::reuse_fence_scope Reuse = streamsafe::reuse_fence_scope::allocation_stream>
class sim_streamsafe_adapter {
 public:
  using stream_type = streamsafe::stream_handle;

  static const char* name() {
    if (Reuse == streamsafe::reuse_fence_scope::all_streams) {
      return Kind == streamsafe::backend_kind::expandable
                 ? "sim_streamsafe_expandable_reuse_fence"
                 : "sim_streamsafe_cuda_malloc_reuse_fence";
    }
    return Kind == streamsafe::backend_kind::expandable ? "sim_streamsafe_expandable"
                                                        : "sim_streamsafe_cuda_malloc";
  }
  static stream_type stream(stream_role role, int index = 0) {
    return sim_env::stream(role, index);
  }
  static void synchronize(stream_type) {}  // nothing runs on the simulated streams here
  static sim_streamsafe_adapter& get() {
    static auto* a = new sim_streamsafe_adapter();
    return *a;
  }

  void* allocate(std::size_t bytes, stream_type s) { return alloc_.allocate(bytes, s); }
  // The host free: the last use is on the allocation stream (no event, no stream argument).
  void deallocate(void* p, stream_type) { alloc_.deallocate(p); }

  std::int64_t events_recorded() const {
    return static_cast<std::int64_t>(alloc_.stats().events_recorded);
  }
  std::int64_t stream_waits() const {
    return static_cast<std::int64_t>(alloc_.stats().stream_waits);
  }
  void release_cached() { alloc_.empty_cache(streamsafe::empty_cache_mode::wait); }
  void reset_peak_reserved() { alloc_.reset_peak_stats(); }
  std::int64_t peak_reserved_bytes() { return alloc_.stats().reserved_bytes.peak; }
  std::int64_t reserved_bytes() { return alloc_.stats().reserved_bytes.current; }

 private:
  sim_streamsafe_adapter() : alloc_(sim_env::device(), make_options()) {
    if (Reuse == streamsafe::reuse_fence_scope::all_streams) {
      alloc_.deallocate(alloc_.allocate(512, stream(stream_role::other)));  // a second known stream
    }
  }
  static streamsafe::options make_options() {
    streamsafe::options o;
    o.backend = Kind;
    o.reuse_fence = Reuse;
    return o;
  }

  streamsafe::caching_allocator alloc_;
};

using sim_streamsafe_cuda_malloc = sim_streamsafe_adapter<streamsafe::backend_kind::cuda_malloc>;
using sim_streamsafe_expandable = sim_streamsafe_adapter<streamsafe::backend_kind::expandable>;
using sim_streamsafe_cuda_malloc_reuse_fence = sim_streamsafe_adapter<
    streamsafe::backend_kind::cuda_malloc, streamsafe::reuse_fence_scope::all_streams>;
using sim_streamsafe_expandable_reuse_fence = sim_streamsafe_adapter<
    streamsafe::backend_kind::expandable, streamsafe::reuse_fence_scope::all_streams>;

}  // namespace streamsafe_bench
