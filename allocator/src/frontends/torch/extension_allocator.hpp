// streamsafe: the PyTorch extension's types (internal to libstreamsafe_torch_ext.so):
// torch_allocator, PyTorch's CUDA allocator interface (c10::cuda::CUDACachingAllocator::
// CUDAAllocator) over streamsafe::cuda::allocator, and limited_backend, the device backend
// wrapper that enforces set_per_process_memory_fraction and reports segment events to the
// memory history. Member functions are defined here and in torch_history.cpp (alloc/free trace
// entries), torch_snapshot.cpp (snapshot()), torch_pools.cpp (CUDA graph pools); the C entry
// points that Python calls are in torch_extension.cpp.
//
//
// Installed by streamsafe_torch_ext_install() (Python: streamsafe.torch.install()), it becomes
// c10::cuda::CUDACachingAllocator::allocator and c10::GetAllocator(kCUDA): every tensor
// allocation, torch.cuda.empty_cache(), Tensor.record_stream, memory_stats(), _snapshot(),
// set_per_process_memory_fraction, CUDA graph pools and torch.accelerator.* reach streamsafe.
// docs/pytorch.md lists what each call does and what is refused (with a c10::Error that names
// it): torch.cuda.MemPool allocation outside a graph capture (use_mem_pool), CUDA IPC, the
// checkpointing of graph pools that torch.compile's cudagraph trees use.
//
// Written for one PyTorch interface: 2.11 (checked at compile time here and against
// torch.__version__ at install time by the Python package).
//
// Thread safety: every member may be called from any thread. The streamsafe allocator has its
// own locks; the graph-pool table, the history and the observers each have one leaf mutex,
// never held across a call into streamsafe.
// streamsafe headers.
#pragma once
#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <torch/headeronly/version.h>

#include "core/format.hpp"

#include <streamsafe/core/errors.hpp>
#include <streamsafe/core/options.hpp>
#include <streamsafe/core/snapshot.hpp>
#include <streamsafe/core/statistics.hpp>
#include <streamsafe/frontends/allocator.hpp>

#include "limited_backend.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#if !(TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 11)
#error \
    "streamsafe's CUDAAllocator is written for PyTorch 2.11's interface (c10/cuda/CUDACachingAllocator.h)"
#endif

namespace streamsafe::torch_ext {

namespace cca = c10::cuda::CUDACachingAllocator;
namespace cda = c10::CachingDeviceAllocator;
using c10::MempoolId_t;

constexpr int max_devices = streamsafe::cuda::allocator::max_devices;
constexpr std::size_t aggregate = static_cast<std::size_t>(
    c10::CachingAllocator::StatType::AGGREGATE);

inline std::uint64_t now_us() {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
}

inline std::string format_bytes(std::size_t bytes) {
  return streamsafe::detail::human_bytes(static_cast<std::int64_t>(bytes));
}

class torch_allocator;

void raw_delete_fn(void* ptr);  // torch_extension.cpp

class torch_allocator final : public cca::CUDAAllocator {
 public:
  torch_allocator(streamsafe::options opts, std::string conf)
      : options_(opts), conf_(std::move(conf)) {
    for (auto& l : limit_bytes_) l.store(0);
    fractions_.fill(1.0);
    streamsafe::cuda::platform p = streamsafe::cuda::platform::cuda();
    auto inner = p.make_backend;
    p.make_backend =
        [inner, this](int device, const streamsafe::options& o) -> std::unique_ptr<device_backend> {
      return std::make_unique<limited_backend>(
          inner(device, o), &limit_bytes_[static_cast<std::size_t>(device)], this);
    };
    ss_ = std::make_unique<streamsafe::cuda::allocator>(opts, std::move(p));
  }

  streamsafe::cuda::allocator& core() { return *ss_; }

  // ---- c10::Allocator ------------------------------------------------------------------
  c10::DataPtr allocate(size_t n) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    const c10::Device where(c10::DeviceType::CUDA, device);
    if (n == 0) return {nullptr, nullptr, &raw_delete_fn, where};
    void* p = malloc(n, device, c10::cuda::getCurrentCUDAStream(device).stream());
    return {p, p, &raw_delete_fn, where};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete_fn; }
  void copy_data(void* dest, const void* src, std::size_t count) const final {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // ---- c10::DeviceAllocator ------------------------------------------------------------
  bool initialized() override { return true; }
  void emptyCache(MempoolId_t /*mempool_id*/) override {
    // Every pool: streamsafe releases what is cached and free, behind its fence (wait or
    // defer as configured); a graph's private pool only once the graph is released.
    guarded("empty_cache", [&] { ss_->empty_cache(); });
  }
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (!ptr.get() || ptr.get_deleter() != &raw_delete_fn) return;  // not ours (from_blob, ...)
    guarded("record_stream", [&] { ss_->record_stream(ptr.get(), stream.stream()); });
  }
  cda::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_device(device);
    cda::DeviceStats out;
    const streamsafe::statistics s = ss_->stats(device);
    streamsafe::statistics base;
    {
      std::lock_guard<std::mutex> lock(base_mu_);
      base = stats_base_[static_cast<std::size_t>(device)];
    }
    auto put = [](c10::CachingAllocator::StatArray& a, const streamsafe::stat& v,
                  const streamsafe::stat& b) {
      auto& d = a[aggregate];
      d.current = v.current;
      d.peak = v.peak;
      d.allocated = v.allocated - b.allocated;
      d.freed = v.freed - b.freed;
    };
    put(out.allocation, s.allocation, base.allocation);
    put(out.segment, s.segment, base.segment);
    put(out.active, s.active, base.active);
    put(out.allocated_bytes, s.allocated_bytes, base.allocated_bytes);
    put(out.reserved_bytes, s.reserved_bytes, base.reserved_bytes);
    put(out.active_bytes, s.active_bytes, base.active_bytes);
    put(out.inactive_split_bytes, s.inactive_split_bytes, base.inactive_split_bytes);
    put(out.requested_bytes, s.requested_bytes, base.requested_bytes);
    out.num_alloc_retries = static_cast<int64_t>(s.num_alloc_retries - base.num_alloc_retries);
    out.num_ooms = static_cast<int64_t>(s.num_ooms - base.num_ooms);
    out.num_sync_all_streams = static_cast<int64_t>(s.num_sync_all_streams -
                                                    base.num_sync_all_streams);
    out.num_device_alloc = static_cast<int64_t>(s.num_device_alloc - base.num_device_alloc);
    out.num_device_free = static_cast<int64_t>(s.num_device_free - base.num_device_free);
    out.max_split_size = options_.max_split_size_bytes != 0
                             ? static_cast<int64_t>(options_.max_split_size_bytes)
                             : std::numeric_limits<int64_t>::max();
    return out;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_device(device);
    const streamsafe::statistics s = ss_->stats(device);
    std::lock_guard<std::mutex> lock(base_mu_);
    stats_base_[static_cast<std::size_t>(device)] = s;
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    check_device(device);
    if (streamsafe::caching_allocator* a = ss_->find_device_allocator(device))
      a->reset_peak_stats();
  }

  // ---- CUDAAllocator -------------------------------------------------------------------
  void* raw_alloc(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    const c10::DeviceIndex device = c10::cuda::current_device();
    return malloc(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) return nullptr;
    return malloc(nbytes, c10::cuda::current_device(), stream);
  }
  void raw_delete(void* ptr) override { free(ptr); }
  void init(int /*device_count*/) override {}
  double getMemoryFraction(c10::DeviceIndex device) override {
    check_device(device);
    std::lock_guard<std::mutex> lock(base_mu_);
    return fractions_[static_cast<std::size_t>(device)];
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    check_device(device);
    TORCH_CHECK(fraction >= 0 && fraction <= 1, "streamsafe: invalid fraction ", fraction,
                ", it must be in [0, 1]");
    std::size_t free_bytes = 0, total_bytes = 0;
    {
      c10::cuda::CUDAGuard guard(device);
      C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    }
    // fraction 1 = no cap beyond the device; 0 would refuse every growth (PyTorch: the same).
    const std::size_t limit = fraction >= 1.0
                                  ? 0
                                  : std::max<std::size_t>(
                                        1, static_cast<std::size_t>(
                                               fraction * static_cast<double>(total_bytes)));
    limit_bytes_[static_cast<std::size_t>(device)].store(limit);
    std::lock_guard<std::mutex> lock(base_mu_);
    fractions_[static_cast<std::size_t>(device)] = fraction;
  }
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex /*device*/) override {
    return {};  // streamsafe's expandable segments are not PyTorch's; nothing to pre-create
  }
  void enable(bool value) override {
    TORCH_CHECK(value,
                "streamsafe: disabling the caching allocator (enable(false)) is not supported");
  }
  bool isEnabled() const override { return true; }
  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    check_device(device);
    std::size_t largest = 0;
    if (streamsafe::caching_allocator* a = ss_->find_device_allocator(device))
      largest = a->largest_free_block_bytes();
    if (largest == 0) {  // as PyTorch: nothing cached, report what the device has free
      std::size_t free_bytes = 0, total_bytes = 0;
      c10::cuda::CUDAGuard guard(device);
      C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
      largest = free_bytes;
    }
    *largestBlock = largest;
  }
  void* getBaseAllocation(void* ptr, size_t* size) override {
    const int device = ss_->owner_device(ptr);
    TORCH_CHECK(device >= 0, "streamsafe: getBaseAllocation: ", ptr,
                " is not a block streamsafe handed out");
    const streamsafe::memory_snapshot snap = ss_->device_allocator(device).snapshot();
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    for (const auto& seg : snap.segments) {
      if (p >= seg.address && p < seg.address + seg.size_bytes) {
        if (size) *size = seg.size_bytes;
        return reinterpret_cast<void*>(seg.address);
      }
    }
    TORCH_CHECK(false, "streamsafe: getBaseAllocation: no segment holds ", ptr);
    return nullptr;  // not reached: TORCH_CHECK(false) throws
  }
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    recordStream(ptr, c10::cuda::CUDAStream(stream));
  }

  cca::SnapshotInfo snapshot(MempoolId_t mempool_id, bool include_traces) override;

  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override;
  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) override;
  void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) override;
  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto it = pools_.find(mempool_id);
    return it == pools_.end() ? 0 : it->second.use_count;
  }
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    TORCH_CHECK(!allocator || allocator.get() == this,
                "streamsafe: torch.cuda.MemPool with its own allocator (",
                allocator ? allocator->name() : "", ") is not supported");
    std::lock_guard<std::mutex> lock(pools_mu_);
    pool_state& pool = pools_[mempool_id];
    pool.device = device;
    ++pool.use_count;
  }
  // MemPool(use_on_oom=True) / MemPool(no_split=True): refused by name; ~MemPool resets
  // use_on_oom to false, which is what streamsafe does anyway.
  void setUseOnOOM(c10::DeviceIndex /*device*/, MempoolId_t /*mempool_id*/,
                   bool use_on_oom) override {
    TORCH_CHECK(!use_on_oom, "streamsafe: MemPool(use_on_oom=True) is not supported");
  }
  void setNoSplit(c10::DeviceIndex /*device*/, MempoolId_t /*mempool_id*/) override {
    TORCH_CHECK(false, "streamsafe: MemPool(no_split=True) is not supported");
  }
  bool checkPoolLiveAllocations(
      c10::DeviceIndex /*device*/, MempoolId_t /*mempool_id*/,
      const std::unordered_set<void*>& /*expected_live_allocations*/) override {
    TORCH_CHECK(false,
                "streamsafe: checking a CUDA graph pool's live allocations "
                "(checkPoolLiveAllocations, used by "
                "torch.compile mode=\"reduce-overhead\" cudagraph trees) is not supported by the "
                "streamsafe allocator");
  }
  cca::ShareableHandle shareIpcHandle(void* /*ptr*/) override {
    TORCH_CHECK(
        false,
        "streamsafe: CUDA IPC of tensors (shareIpcHandle, torch.multiprocessing sharing of CUDA "
        "tensors) is not supported by the streamsafe allocator");
  }
  std::shared_ptr<void> getIpcDevPtr(std::string /*handle*/) override {
    TORCH_CHECK(
        false,
        "streamsafe: CUDA IPC of tensors (getIpcDevPtr, opening a CUDA tensor shared by another "
        "process) is not supported by the streamsafe allocator");
  }
  bool isHistoryEnabled() override { return history_enabled_.load(); }
  void recordHistory(bool enabled, cda::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, cda::RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) override {
    std::lock_guard<std::mutex> lock(history_mu_);
    recorder_ = context_recorder;
    when_ = enabled ? when : cda::RecordContext::NEVER;
    max_entries_ = std::max<std::size_t>(alloc_trace_max_entries, 1);
    skip_.clear();
    for (const auto& a : skip_actions) skip_.insert(cda::parseTraceEntryAction(a));
    if (clearHistory) {
      for (auto& t : traces_) t.clear();
    }
    if (!enabled) live_.clear();
    history_enabled_.store(enabled);
  }
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(observers_mu_);
    oom_observers_.push_back(std::move(observer));
  }
  void attachAllocatorTraceTracker(cda::AllocatorTraceTracker tracker) override {
    std::lock_guard<std::mutex> lock(observers_mu_);
    trace_trackers_.push_back(std::move(tracker));
    has_trackers_.store(true);
  }
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    const cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
      return;
    }
    C10_CUDA_CHECK(err);
  }
  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dstDevice == srcDevice)
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex /*device*/,
                                                          MempoolId_t /*id*/) override {
    TORCH_CHECK(
        false,
        "streamsafe: checkpointing a CUDA graph pool (getCheckpointState, used by torch.compile "
        "mode=\"reduce-overhead\" cudagraph trees) is not supported by the streamsafe allocator");
  }
  cca::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex /*device*/, std::shared_ptr<cca::AllocatorState> /*pps*/) override {
    TORCH_CHECK(
        false,
        "streamsafe: restoring a CUDA graph pool (setCheckpointPoolState, used by torch.compile "
        "mode=\"reduce-overhead\" cudagraph trees) is not supported by the streamsafe allocator");
  }
  std::string name() override { return "streamsafe"; }

  // ---- used by limited_backend and the C entry points ----------------------------------
  void note_segment(cda::TraceEntry::Action action, int device, void* addr,
                    std::size_t size) noexcept {
    if (!history_enabled_.load(std::memory_order_relaxed) &&
        !has_trackers_.load(std::memory_order_relaxed))
      return;
    try {
      emit(cda::TraceEntry(action, static_cast<c10::DeviceIndex>(device),
                           reinterpret_cast<std::uintptr_t>(addr), size, nullptr, {0, 0},
                           c10::getApproximateTime()));
    } catch (...) {
    }
  }
  const std::string& conf() const { return conf_; }

 private:
  struct pool_state {
    int device = 0;
    int use_count = 0;
    std::vector<std::uint64_t> graphs;  // streamsafe graph ids captured into this pool
  };
  struct capture_state {
    MempoolId_t pool;
    int device;
    cudaStream_t stream;
    std::uint64_t graph;
  };
  struct live_block {
    std::shared_ptr<c10::GatheredContext> context;
    std::size_t requested = 0;
    int device = 0;
    cudaStream_t stream = nullptr;
  };

  void check_device(c10::DeviceIndex device) const {
    TORCH_CHECK(device >= 0 && device < ss_->device_count(), "streamsafe: invalid device index ",
                static_cast<int>(device), " (", ss_->device_count(), " devices)");
  }

  template <class F>
  void guarded(const char* what, F&& f) {
    try {
      f();
    } catch (const c10::Error&) {
      throw;
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "streamsafe: ", what, ": ", e.what());
    }
  }

  void* malloc(std::size_t n, c10::DeviceIndex device, cudaStream_t stream) {
    void* p = nullptr;
    try {
      p = ss_->allocate(n, device, stream);
    } catch (const streamsafe::out_of_memory& e) {
      out_of_memory(n, device, stream, e.what());
    } catch (const std::bad_alloc& e) {
      out_of_memory(n, device, stream, e.what());
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "streamsafe: allocation of ", n, " bytes on device ",
                  static_cast<int>(device), " failed: ", e.what());
    }
    if (history_enabled_.load(std::memory_order_relaxed) ||
        has_trackers_.load(std::memory_order_relaxed))
      note_alloc(p, n, device, stream);
    return p;
  }

  [[noreturn]] void out_of_memory(std::size_t n, c10::DeviceIndex device, cudaStream_t stream,
                                  const char* what) {
    std::size_t free_bytes = 0, total_bytes = 0;
    {
      c10::cuda::CUDAGuard guard(device);
      if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) (void)cudaGetLastError();
    }
    const streamsafe::statistics s = ss_->stats(device);
    if (history_enabled_.load() || has_trackers_.load()) {
      emit(cda::TraceEntry(cda::TraceEntry::OOM, device, free_bytes, n, stream, {0, 0},
                           c10::getApproximateTime()));
    }
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> lock(observers_mu_);
      observers = oom_observers_;
    }
    for (auto& o : observers)
      o(device, static_cast<size_t>(s.allocated_bytes.current), total_bytes, free_bytes);
    c10::reportOutOfMemoryToProfiler(
        static_cast<int64_t>(n), static_cast<size_t>(s.allocated_bytes.current),
        static_cast<size_t>(s.reserved_bytes.current), c10::Device(c10::DeviceType::CUDA, device));
    const std::size_t limit = limit_bytes_[static_cast<std::size_t>(device)].load();
    TORCH_CHECK_WITH(
        OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ", format_bytes(n),
        ". GPU ", static_cast<int>(device), " has a total capacity of ", format_bytes(total_bytes),
        " of which ", format_bytes(free_bytes), " is free. streamsafe has ",
        format_bytes(static_cast<std::size_t>(s.allocated_bytes.current)), " allocated and ",
        format_bytes(static_cast<std::size_t>(s.reserved_bytes.current)), " reserved",
        limit ? " (per-process memory limit " + format_bytes(limit) + ")" : std::string(),
        ". streamsafe: ", what);
  }

 public:
  void free(void* ptr) {
    if (!ptr) return;
    if (history_enabled_.load(std::memory_order_relaxed) ||
        has_trackers_.load(std::memory_order_relaxed))
      note_free(ptr);
    try {
      ss_->deallocate(ptr);
    } catch (const std::exception& e) {
      streamsafe::cuda::log_error(e.what());
      TORCH_WARN("streamsafe: free of ", ptr, " failed: ", e.what());
    }
  }

 private:
  void note_alloc(void* p, std::size_t n, int device, cudaStream_t stream);  // torch_history.cpp
  void note_free(void* p);
  // Trace trackers get the entry as PyTorch's allocator gives it (approximate clock); the
  // history keeps it with time_.t_ in microseconds since the epoch, as snapshot() returns it.
  void emit(cda::TraceEntry te);

  streamsafe::options options_;
  std::string conf_;
  std::unique_ptr<streamsafe::cuda::allocator> ss_;
  std::array<std::atomic<std::size_t>, max_devices> limit_bytes_;

  std::mutex base_mu_;  // guards stats_base_ and fractions_
  std::array<streamsafe::statistics, max_devices> stats_base_{};
  std::array<double, max_devices> fractions_{};

  std::mutex pools_mu_;
  std::map<MempoolId_t, pool_state> pools_;
  std::vector<capture_state> captures_;

  std::mutex observers_mu_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
  std::vector<cda::AllocatorTraceTracker> trace_trackers_;
  std::atomic<bool> has_trackers_{false};

  std::mutex history_mu_;
  std::atomic<bool> history_enabled_{false};
  cda::CreateContextFn recorder_ = nullptr;
  cda::RecordContext when_ = cda::RecordContext::NEVER;
  std::size_t max_entries_ = 1;
  std::set<cda::TraceEntry::Action> skip_;
  std::array<std::deque<cda::TraceEntry>, max_devices> traces_;
  std::unordered_map<void*, live_block> live_;
};

extern torch_allocator* g_allocator;  // set once by install; never destroyed (torch_extension.cpp)

}  // namespace streamsafe::torch_ext
