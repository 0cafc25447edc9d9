// streamsafe preload: the interposer's state and behaviour (internal to src/frontends/preload/):
// the caching allocator it serves from (one per process, created on first use), the registry of
// the streams it has seen, the per-device batches of cudaFree'd pointers behind their fences,
// and the statistics. preload.cpp holds the interposed entry points and their contracts.
//
// Thread safety: every member may be called from any thread. Locks: a device slot's mutex
// (its batches) is taken before the caching allocator's; the stream registry's mutex is taken
// last and held only around table operations. No lock is held across a host-blocking call.
#pragma once

#include "core/common/logging.hpp"
#include "preload_backend.hpp"
#include "real_cuda.hpp"

#include <streamsafe/backends/device_guard.hpp>
#include <streamsafe/backends/expandable_backend.hpp>
#include <streamsafe/backends/gpu.hpp>
#include <streamsafe/core/errors.hpp>
#include <streamsafe/frontends/allocator.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace streamsafe::preload {

constexpr int k_max_devices = cuda::allocator::max_devices;
constexpr std::size_t k_batches_in_flight = 2;

struct fenced_batch {
  std::vector<cudaEvent_t> events;
  std::vector<void*> ptrs;
};

struct counters {
  std::atomic<std::uint64_t> mallocs{0}, frees{0}, malloc_asyncs{0}, free_asyncs{0};
  std::atomic<std::uint64_t> passthrough_allocs{0}, passthrough_frees{0};
  std::atomic<std::uint64_t> batches{0}, fence_events{0}, batched_frees{0};
  std::atomic<std::uint64_t> flushes{0}, private_syncs{0}, errors{0};
};

// The per-device state of the interposer.
struct device_slot {
  std::mutex mutex;                    // guards the fields below (not the counters)
  std::vector<void*> open;             // freed by cudaFree since the last fence
  std::unordered_set<void*> queued;    // open + in flight (double-free detection)
  std::deque<fenced_batch> in_flight;  // fenced, oldest first
  std::vector<cudaEvent_t> spare_events;
  std::atomic<cudaStream_t> private_stream{nullptr};  // cudaMalloc's pool stream
  counters count;
};

struct stream_info {
  int device = 0;
  bool non_blocking = false;
};

inline bool special(cudaStream_t s) noexcept { return cuda::is_special_stream(s); }

class interposer {
 public:
  static interposer& get() {
    static interposer* const the = new interposer;  // never destroyed (atexit summary, teardown)
    return *the;
  }

  bool enabled() const noexcept { return enabled_; }

  cuda::allocator& alloc() {
    static cuda::allocator* const a = [this] {
      std::vector<std::string> warnings;
      const options opts = options::from_environment(&warnings);
      for (const auto& w : warnings) detail::log().warn("{}", w);
      auto* made = new cuda::allocator(opts, make_platform());
      detail::log().info("preload: serving cudaMalloc/cudaFree/cudaMallocAsync/cudaFreeAsync ({})",
                         opts.to_string());
      std::atexit([] { interposer::get().summary(); });
      return made;
    }();
    return *a;
  }

  device_slot& slot(int device) { return slots_[device]; }

  // ---- the stream registry ----------------------------------------------------------------
  void note_created(cudaStream_t s, unsigned int flags) {
    if (special(s)) return;
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess) return;
    std::lock_guard<std::mutex> lk(streams_mutex_);
    streams_[s] = {device, (flags & cudaStreamNonBlocking) != 0};
  }

  // The stream's registry entry, learned now if it was created elsewhere. False for special
  // handles and streams the runtime does not know.
  bool learn(cudaStream_t s, stream_info& out) {
    if (special(s)) return false;
    {
      std::lock_guard<std::mutex> lk(streams_mutex_);
      auto it = streams_.find(s);
      if (it != streams_.end()) {
        out = it->second;
        return true;
      }
    }
    stream_info info;
    unsigned int flags = 0;
    if (cudaStreamGetDevice(s, &info.device) != cudaSuccess ||
        cudaStreamGetFlags(s, &flags) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    info.non_blocking = (flags & cudaStreamNonBlocking) != 0;
    std::lock_guard<std::mutex> lk(streams_mutex_);
    streams_[s] = info;
    out = info;
    return true;
  }

  void forget(cudaStream_t s) {
    std::lock_guard<std::mutex> lk(streams_mutex_);
    streams_.erase(s);
  }

  std::vector<cudaStream_t> fence_streams(int device) {
    std::vector<cudaStream_t> out{cudaStreamLegacy};
    std::lock_guard<std::mutex> lk(streams_mutex_);
    for (const auto& [s, info] : streams_) {
      if (info.device == device && info.non_blocking) out.push_back(s);
    }
    return out;
  }

  // ---- batches ----------------------------------------------------------------------------
  // REQUIRES: slot.mutex held. Closes the open batch with one event per fence stream (plus
  // `extra`, a stream about to be destroyed). False when the legacy stream could not be
  // recorded (the batch stays open).
  bool close_open_locked(int device, device_slot& slot, cudaStream_t extra = nullptr) {
    if (slot.open.empty()) return true;
    std::vector<cudaStream_t> targets = fence_streams(device);
    if (extra && std::find(targets.begin(), targets.end(), extra) == targets.end())
      targets.push_back(extra);
    fenced_batch batch;
    try {
      cuda::device_guard guard(device);
      for (cudaStream_t s : targets) {
        cudaEvent_t e = nullptr;
        if (!slot.spare_events.empty()) {
          e = slot.spare_events.back();
          slot.spare_events.pop_back();
        } else if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
          (void)cudaGetLastError();
          throw backend_error("cudaEventCreateWithFlags failed");
        }
        if (cudaEventRecord(e, s) != cudaSuccess) {
          (void)cudaGetLastError();
          slot.spare_events.push_back(e);
          if (s == cudaStreamLegacy)
            throw backend_error("cudaEventRecord on the legacy stream failed");
          forget(s);  // a stream destroyed behind our back: it has no work left to fence
          continue;
        }
        batch.events.push_back(e);
      }
    } catch (const std::exception& e) {
      for (cudaEvent_t ev : batch.events) slot.spare_events.push_back(ev);
      detail::log().debug("preload: device {}: batch not fenced yet: {}", device, e.what());
      return false;
    }
    slot.count.batches++;
    slot.count.fence_events += batch.events.size();
    slot.count.batched_frees += slot.open.size();
    batch.ptrs.swap(slot.open);
    slot.in_flight.push_back(std::move(batch));
    return true;
  }

  // REQUIRES: slot.mutex held. Moves the pointers of the batches whose fences completed (oldest
  // first, stopping at the first pending one) into `done`. Never blocks.
  void take_completed_locked(device_slot& slot, std::vector<void*>& done) {
    while (!slot.in_flight.empty()) {
      fenced_batch& b = slot.in_flight.front();
      for (cudaEvent_t e : b.events) {
        if (cudaEventQuery(e) != cudaSuccess)
          return;  // cudaErrorNotReady: not recorded as last error
      }
      for (void* p : b.ptrs) slot.queued.erase(p);
      done.insert(done.end(), b.ptrs.begin(), b.ptrs.end());
      slot.spare_events.insert(slot.spare_events.end(), b.events.begin(), b.events.end());
      slot.in_flight.pop_front();
    }
  }

  void give_back(std::vector<void*>& done) {
    for (void* p : done) {
      try {
        alloc().deallocate(p);  // the fence completed: the block is idle
      } catch (const std::exception& e) {
        detail::log().error("preload: returning a freed block: {}", e.what());
      }
    }
    done.clear();
  }

  // Before an allocation on `device`: reuse what completed, fence what was freed since.
  void prepare(int device) {
    device_slot& slot = slots_[device];
    std::vector<void*> done;
    {
      std::lock_guard<std::mutex> lk(slot.mutex);
      if (slot.in_flight.empty() && slot.open.empty()) return;
      take_completed_locked(slot, done);
      if (slot.in_flight.size() < k_batches_in_flight) close_open_locked(device, slot);
    }
    give_back(done);
  }

  // Out of memory, empty_cache: close and wait for every batch of the device (host waits on
  // exactly their events, without the slot's lock; the real cudaFree would have synchronised).
  void flush(int device) {
    device_slot& slot = slots_[device];
    slot.count.flushes++;
    std::deque<fenced_batch> batches;
    bool synced = false;
    {
      std::lock_guard<std::mutex> lk(slot.mutex);
      if (!close_open_locked(device, slot)) {
        // The legacy stream could not be recorded: fall back to a device-wide wait.
        cuda::device_guard guard(device);
        synced = cudaDeviceSynchronize() == cudaSuccess;
        (void)cudaGetLastError();
        if (synced) {
          fenced_batch b;
          b.ptrs.swap(slot.open);
          slot.in_flight.push_back(std::move(b));
        }
      }
      batches.swap(slot.in_flight);
    }
    std::vector<void*> done;
    for (fenced_batch& b : batches) {
      for (cudaEvent_t e : b.events) (void)cudaEventSynchronize(e);
      done.insert(done.end(), b.ptrs.begin(), b.ptrs.end());
    }
    {
      std::lock_guard<std::mutex> lk(slot.mutex);
      for (void* p : done) slot.queued.erase(p);
      for (fenced_batch& b : batches) {
        slot.spare_events.insert(slot.spare_events.end(), b.events.begin(), b.events.end());
      }
    }
    give_back(done);
  }

  // Host free of everything queued on every device (closing, waiting) and the cache emptied.
  std::size_t empty_cache() {
    cuda::allocator& a = alloc();
    for (int d = 0; d < std::min(a.device_count(), k_max_devices); ++d) {
      if (a.find_device_allocator(d)) flush(d);
    }
    return a.empty_cache();
  }

  // ---- statistics -------------------------------------------------------------------------
  std::string stats_json(int device) {
    cuda::allocator& a = alloc();
    const statistics s = a.stats(device);
    device_slot& slot = slots_[device];
    std::size_t queued = 0, in_flight = 0;
    {
      std::lock_guard<std::mutex> lk(slot.mutex);
      queued = slot.queued.size();
      in_flight = slot.in_flight.size();
    }
    const counters& c = slot.count;
    char buf[2048];
    std::snprintf(
        buf, sizeof buf,
        "{\"device\": %d, \"cudaMalloc\": %llu, \"cudaFree\": %llu, \"cudaMallocAsync\": %llu, "
        "\"cudaFreeAsync\": %llu, \"passthrough_allocs\": %llu, \"passthrough_frees\": %llu, "
        "\"free_batches\": %llu, \"batched_frees\": %llu, \"fence_events\": %llu, "
        "\"queued_frees\": %zu, "
        "\"batches_in_flight\": %zu, \"flushes\": %llu, \"private_stream_syncs\": %llu, "
        "\"errors\": %llu, \"num_device_alloc\": %llu, \"num_device_free\": %llu, "
        "\"allocated_bytes\": %lld, \"allocated_bytes_peak\": %lld, \"reserved_bytes\": %lld, "
        "\"reserved_bytes_peak\": %lld, \"events_recorded\": %llu, \"stream_waits\": %llu, "
        "\"num_ooms\": %llu}",
        device, ull(c.mallocs), ull(c.frees), ull(c.malloc_asyncs), ull(c.free_asyncs),
        ull(c.passthrough_allocs), ull(c.passthrough_frees), ull(c.batches), ull(c.batched_frees),
        ull(c.fence_events), queued, in_flight, ull(c.flushes), ull(c.private_syncs), ull(c.errors),
        static_cast<unsigned long long>(s.num_device_alloc),
        static_cast<unsigned long long>(s.num_device_free),
        static_cast<long long>(s.allocated_bytes.current),
        static_cast<long long>(s.allocated_bytes.peak),
        static_cast<long long>(s.reserved_bytes.current),
        static_cast<long long>(s.reserved_bytes.peak),
        static_cast<unsigned long long>(s.events_recorded),
        static_cast<unsigned long long>(s.stream_waits),
        static_cast<unsigned long long>(s.num_ooms));
    return buf;
  }

  void summary() noexcept {
    try {
      if (!detail::log().should_log(spdlog::level::info)) return;
      cuda::allocator& a = alloc();
      for (int d = 0; d < std::min(a.device_count(), k_max_devices); ++d) {
        if (!a.find_device_allocator(d)) continue;
        const statistics s = a.stats(d);
        const counters& c = slots_[d].count;
        detail::log().info(
            "preload summary, device {}: cudaMalloc {} / cudaFree {} / cudaMallocAsync {} / "
            "cudaFreeAsync {} "
            "served; driver allocations {}, driver frees {}; passed through: {} allocations, {} "
            "frees; "
            "{} frees in {} fenced batches ({} events); peak reserved {:.1f} MiB, peak allocated "
            "{:.1f} MiB; "
            "flushes (empty_cache, out of memory) {}",
            d, ull(c.mallocs), ull(c.frees), ull(c.malloc_asyncs), ull(c.free_asyncs),
            s.num_device_alloc, s.num_device_free, ull(c.passthrough_allocs),
            ull(c.passthrough_frees), ull(c.batched_frees), ull(c.batches), ull(c.fence_events),
            static_cast<double>(s.reserved_bytes.peak) / 1048576.0,
            static_cast<double>(s.allocated_bytes.peak) / 1048576.0, ull(c.flushes));
        detail::log().info("preload summary, device {}: {}", d, stats_json(d));
      }
      detail::log().flush();
    } catch (...) {
    }
  }

 private:
  interposer() {
    const char* env = std::getenv("STREAMSAFE_PRELOAD");
    enabled_ = !(env && (std::strcmp(env, "0") == 0 || std::strcmp(env, "off") == 0));
  }

  static unsigned long long ull(const std::atomic<std::uint64_t>& v) noexcept { return v.load(); }

  cuda::platform make_platform() {
    cuda::platform p = cuda::platform::cuda();
    p.device_count = [] { return std::min(cuda::device_count(), k_max_devices); };
    p.make_backend = [this](int device, const options& opts) -> std::unique_ptr<device_backend> {
      device_slot& s = slots_[device];
      if (!s.private_stream.load()) {
        cuda::device_guard guard(device);
        cudaStream_t stream = nullptr;
        const cudaError_t e = real().stream_create_with_flags(&stream, cudaStreamNonBlocking);
        if (e != cudaSuccess) {
          (void)cudaGetLastError();
          throw backend_error(
              std::string("streamsafe preload: creating the private stream failed: ") +
              cudaGetErrorString(e));
        }
        s.private_stream.store(stream);
      }
      std::unique_ptr<device_backend> inner;
      if (opts.backend == backend_kind::expandable) {
        inner = std::make_unique<cuda::expandable_backend>(device);
      } else {
        inner = std::make_unique<real_malloc_backend>(device);
      }
      return std::make_unique<watching_backend>(
          std::move(inner), reinterpret_cast<stream_handle>(s.private_stream.load()));
    };
    return p;
  }

  bool enabled_ = true;
  device_slot slots_[k_max_devices];
  std::mutex streams_mutex_;
  std::unordered_map<cudaStream_t, stream_info> streams_;
};

}  // namespace streamsafe::preload
