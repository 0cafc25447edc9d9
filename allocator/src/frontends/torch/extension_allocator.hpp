// streamsafe: the PyTorch extension's types (internal to libstreamsafe_torch_ext.so):
// torch_allocator, PyTorch's CUDA allocator interface (c10::cuda::CUDACachingAllocator::
// CUDAAllocator) over streamsafe::cuda::allocator, and limited_backend, the device backend
// wrapper that enforces set_per_process_memory_fraction and reports segment events to the
// memory history. Member functions are defined here and in torch_history.cpp (alloc/free trace
// entries), torch_snapshot.cpp (snapshot()), torch_pools.cpp (CUDA graph pools),
// torch_checkpoint.cpp (graph pools' checkpoints, for cudagraph trees), torch_oom.cpp (the
// out-of-memory error), torch_settings.cpp (PyTorch's allocator settings); the C entry
// points that Python calls are in torch_extension.cpp.
//
//
// Installed by streamsafe_torch_ext_install() (Python: streamsafe.torch.install()), it becomes
// c10::cuda::CUDACachingAllocator::allocator and c10::GetAllocator(kCUDA): every tensor
// allocation, torch.cuda.empty_cache(), Tensor.record_stream, memory_stats(), _snapshot(),
// set_per_process_memory_fraction, CUDA graph pools and torch.accelerator.* reach streamsafe.
// docs/pytorch.md lists what each call does and what is refused (with a c10::Error that names
// it), e.g. MemPool(no_split=True).
// torch_mempool.cpp routes torch.cuda.use_mem_pool (MemPool outside a capture) and MemPools with
// their own allocator; torch_ipc.cpp shares tensors between processes (CUDA IPC).
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

#include "core/common/format.hpp"

#include <streamsafe/core/errors.hpp>
#include <streamsafe/core/ipc.hpp>
#include <streamsafe/core/options.hpp>
#include <streamsafe/core/sleep.hpp>
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
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
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
constexpr std::size_t small_pool_type = static_cast<std::size_t>(
    c10::CachingAllocator::StatType::SMALL_POOL);
constexpr std::size_t large_pool_type = static_cast<std::size_t>(
    c10::CachingAllocator::StatType::LARGE_POOL);

inline std::uint64_t now_us() {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
}

// A MemPool's memory outside captures is the streamsafe tag "torch.mempool.<a>.<b>".
constexpr const char* k_pool_tag_prefix = "torch.mempool.";
inline std::string pool_tag(MempoolId_t id) {
  return k_pool_tag_prefix + std::to_string(id.first) + "." + std::to_string(id.second);
}
// The pool id of a MemPool tag, or {0, 0} for any other tag.
inline MempoolId_t pool_of_tag(const std::string& tag) {
  const std::string prefix = k_pool_tag_prefix;
  if (tag.compare(0, prefix.size(), prefix) != 0) return {0, 0};
  const std::size_t dot = tag.find('.', prefix.size());
  if (dot == std::string::npos) return {0, 0};
  try {
    using id_t = MempoolId_t::first_type;
    return {static_cast<id_t>(std::stoull(tag.substr(prefix.size(), dot - prefix.size()))),
            static_cast<id_t>(std::stoull(tag.substr(dot + 1)))};
  } catch (const std::exception&) {
    return {0, 0};
  }
}

// A byte count as PyTorch's out-of-memory message writes it (torch_oom.cpp): "512 bytes" up to
// 1 KiB, then KiB, MiB and GiB (never a larger unit) with two decimals.
std::string torch_format_size(std::uint64_t bytes);
// PyTorch's allocator settings ("key:value,...") as streamsafe options ("key:value,...");
// throws c10::Error naming a key streamsafe does not support (torch_settings.cpp).
std::string torch_settings_to_options(const std::string& torch_conf);

class torch_allocator;

void raw_delete_fn(void* ptr);  // torch_extension.cpp

class torch_allocator final : public cca::CUDAAllocator {
 public:
  torch_allocator(streamsafe::options opts, std::string conf)
      : options_(opts), conf_(std::move(conf)) {
    for (auto& l : limit_bytes_) l.store(0);
    for (auto& b : backed_bytes_) b.store(0);
    fractions_.fill(1.0);
    streamsafe::cuda::platform p = streamsafe::cuda::platform::cuda();
    auto inner = p.make_backend;
    p.make_backend =
        [inner, this](int device, const streamsafe::options& o) -> std::unique_ptr<device_backend> {
      return std::make_unique<limited_backend>(
          inner(device, o), &limit_bytes_[static_cast<std::size_t>(device)],
          &backed_bytes_[static_cast<std::size_t>(device)], this);
    };
    ss_ = std::make_unique<streamsafe::cuda::allocator>(opts, std::move(p));
  }

  streamsafe::cuda::allocator& core() { return *ss_; }
  // The device's bytes backed by memory in every streamsafe allocator of the extension (the main
  // one and each MemPool's), what set_per_process_memory_fraction caps, and that cap (0 = none).
  std::size_t backed_bytes(int device) const {
    return backed_bytes_.at(static_cast<std::size_t>(device)).load();
  }
  std::size_t limit_bytes(int device) const {
    return limit_bytes_.at(static_cast<std::size_t>(device)).load();
  }
  int pool_instances() const { return n_instances_.load(std::memory_order_acquire); }

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
  // torch_mempool.cpp: {0, 0} releases the cache of every pool not in use (PyTorch: a live
  // MemPool keeps its cache); a pool's id releases that pool's cache only.
  void emptyCache(MempoolId_t mempool_id) override;
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (!ptr.get() || ptr.get_deleter() != &raw_delete_fn) return;  // not ours (from_blob, ...)
    if (n_instances_.load(std::memory_order_acquire) != 0) {
      if (std::shared_ptr<pool_instance> inst = instance_of(ptr.get())) {
        guarded("record_stream", [&] { inst->alloc->record_stream(ptr.get(), stream.stream()); });
        return;
      }
    }
    guarded("record_stream", [&] { ss_->record_stream(ptr.get(), stream.stream()); });
  }
  cda::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_device(device);
    cda::DeviceStats out;
    const streamsafe::statistics s = device_stats(device);
    streamsafe::statistics base;
    {
      std::lock_guard<std::mutex> lock(base_mu_);
      base = stats_base_[static_cast<std::size_t>(device)];
    }
    // PyTorch's StatType order: AGGREGATE, SMALL_POOL, LARGE_POOL (streamsafe's pool kinds,
    // with the same 1 MiB boundary).
    using kind = streamsafe::pool_statistics;
    const std::pair<const kind*, const kind*> kinds[] = {
        {&s, &base}, {&s.small_pool, &base.small_pool}, {&s.large_pool, &base.large_pool}};
    constexpr std::size_t type_of[] = {aggregate, small_pool_type, large_pool_type};
    for (std::size_t k = 0; k < 3; ++k) {
      const auto [v, b] = kinds[k];
      auto put = [&](c10::CachingAllocator::StatArray& a, streamsafe::stat kind::*field) {
        auto& d = a[type_of[k]];
        d.current = (v->*field).current;
        d.peak = (v->*field).peak;
        d.allocated = (v->*field).allocated - (b->*field).allocated;
        d.freed = (v->*field).freed - (b->*field).freed;
      };
      put(out.allocation, &kind::allocation);
      put(out.segment, &kind::segment);
      put(out.active, &kind::active);
      put(out.allocated_bytes, &kind::allocated_bytes);
      put(out.reserved_bytes, &kind::reserved_bytes);
      put(out.active_bytes, &kind::active_bytes);
      put(out.inactive_split_bytes, &kind::inactive_split_bytes);
      put(out.requested_bytes, &kind::requested_bytes);
    }
    out.num_alloc_retries = static_cast<int64_t>(s.num_alloc_retries - base.num_alloc_retries);
    out.num_ooms = static_cast<int64_t>(s.num_ooms - base.num_ooms);
    out.num_sync_all_streams = static_cast<int64_t>(s.num_sync_all_streams -
                                                    base.num_sync_all_streams);
    out.num_device_alloc = static_cast<int64_t>(s.num_device_alloc - base.num_device_alloc);
    out.num_device_free = static_cast<int64_t>(s.num_device_free - base.num_device_free);
    const std::size_t max_split = ss_->config().max_split_size_bytes;  // as last set
    out.max_split_size = max_split != 0 ? static_cast<int64_t>(max_split)
                                        : std::numeric_limits<int64_t>::max();
    return out;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_device(device);
    const streamsafe::statistics s = device_stats(device);
    std::lock_guard<std::mutex> lock(base_mu_);
    stats_base_[static_cast<std::size_t>(device)] = s;
  }
  // The new peak starts from the memory held once every release whose fence has completed is
  // done (device_stats, torch_mempool.cpp); memory still behind a fence stays reserved and may
  // lower the current value below the new peak later.
  void resetPeakStats(c10::DeviceIndex device) override {
    check_device(device);
    auto reset = [&](streamsafe::caching_allocator* a) {
      if (!a) return;
      finish_ready_releases(a, "reset_peak_memory_stats");
      a->reset_peak_stats();
    };
    reset(ss_->find_device_allocator(device));
    for (const std::shared_ptr<pool_instance>& inst : instances())
      reset(inst->alloc->find_device_allocator(device));
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
  // torch.cuda.memory._set_allocator_settings / caching_allocator_enable(False): new
  // allocations go straight to cudaMalloc / cudaFree (each free synchronises the device, as
  // cudaFree does); blocks already handed out are freed to streamsafe as before.
  void enable(bool value) override { enabled_.store(value); }
  bool isEnabled() const override { return enabled_.load(); }
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
  int getPoolUseCount(c10::DeviceIndex /*device*/, MempoolId_t mempool_id) override {
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto it = pools_.find(mempool_id);
    return it == pools_.end() ? 0 : it->second.use_count;
  }
  // torch_mempool.cpp: a MemPool (with or without its own allocator) and its settings.
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override;
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id, bool use_on_oom) override;
  void setNoSplit(c10::DeviceIndex device, MempoolId_t mempool_id) override;
  bool checkPoolLiveAllocations(
      c10::DeviceIndex device, MempoolId_t mempool_id,
      const std::unordered_set<void*>& expected_live_allocations) override;
  // torch_ipc.cpp: CUDA IPC of tensors over streamsafe's export / import.
  cca::ShareableHandle shareIpcHandle(void* ptr) override;
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override;
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
    if (!enabled || clearHistory) {  // PyTorch: turning the history off drops it too
      for (auto& t : traces_) t.clear();
      annotations_.clear();
    }
    if (!enabled) {
      live_.clear();
      release_context_.reset();
      has_release_context_.store(false);
    }
    history_enabled_.store(enabled);
  }
  // torch_history.cpp: record_function annotations (snapshot()["external_annotations"]), the
  // compile context of torch.compile's regions and torch.cuda.memory._set_memory_metadata, each
  // stamped on the trace entries as PyTorch's allocator does.
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override;
  void pushCompileContext(std::string& md) override;
  void popCompileContext() override;
  void setUserMetadata(const std::string& metadata) override;
  std::string getUserMetadata() override;
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
  // torch_checkpoint.cpp: a CUDA graph pool's checkpoint (cudagraph trees).
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          MempoolId_t id) override;
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> pps) override;
  std::string name() override { return "streamsafe"; }

  // ---- used by limited_backend and the C entry points ----------------------------------
  void note_segment(cda::TraceEntry::Action action, int device, void* addr,
                    std::size_t size) noexcept {
    if (!history_enabled_.load(std::memory_order_relaxed) &&
        !has_trackers_.load(std::memory_order_relaxed))
      return;
    try {
      cda::TraceEntry te(action, static_cast<c10::DeviceIndex>(device),
                         reinterpret_cast<std::uintptr_t>(addr), size, nullptr, {0, 0},
                         c10::getApproximateTime());
      // Memory released behind a fence may go back on the release worker's thread after the
      // caller moved on: its events carry the metadata in force when empty_cache was asked.
      const bool release = action == cda::TraceEntry::SEGMENT_FREE ||
                           action == cda::TraceEntry::SEGMENT_UNMAP;
      // Memory an allocation brings in carries that allocation's stack (PyTorch's allocator).
      const alloc_context* ctx = segment_context_scope::current();
      if (!release && ctx && ctx->when >= cda::RecordContext::ALLOC) te.context_ = ctx->stack;
      emit(std::move(te), release);
    } catch (...) {
    }
  }
  const std::string& conf() const { return conf_; }
  // torch.cuda.memory._set_allocator_settings after install (torch_settings.cpp).
  void apply_torch_settings(const std::string& torch_conf);
  // PyTorch's allocator settings as PyTorch last read them (the environment's string at install,
  // then each _set_allocator_settings call's): the snapshot's allocator_settings report it under
  // PyTorch's key, as PyTorch's allocator does (torch_settings.cpp).
  void set_torch_settings_text(std::string torch_conf);
  std::string torch_settings_text();

 private:
  // A MemPool with its own allocator (a CUDAPluggableAllocator): a streamsafe allocator of its
  // own whose segments come from that allocator (torch_mempool.cpp). Alive while the pool is
  // used or holds memory; it keeps PyTorch's allocator object alive as long.
  struct pool_instance {
    MempoolId_t id{0, 0};
    int device = 0;
    std::shared_ptr<cca::CUDAAllocator> allocator;
    std::unique_ptr<streamsafe::cuda::allocator> alloc;
    bool in_use = true;  // false once the pool's last user let go (releasePool)
  };
  struct pool_state {
    int device = 0;
    int use_count = 0;
    std::vector<std::uint64_t> graphs;              // streamsafe graph ids captured into this pool
    std::shared_ptr<cca::CUDAAllocator> allocator;  // MemPool(allocator=...)
    std::shared_ptr<pool_instance> instance;        // created with the pool when allocator is set
    bool use_on_oom = false;
  };
  // An allocation route outside a capture (use_mem_pool, beginAllocateCurrentThreadToPool /
  // CurrentStreamToPool): the filter PyTorch gave picks the allocations; the innermost wins.
  struct pool_route {
    MempoolId_t pool{0, 0};
    int device = 0;
    std::function<bool(cudaStream_t)> filter;
    streamsafe::tag_id tag = 0;
    std::shared_ptr<pool_instance> instance;
    std::uint64_t graph_route = 0;  // a route into a CUDA graph's private pool (core's id)
  };
  struct pool_route_choice {
    streamsafe::tag_id tag = 0;
    std::shared_ptr<pool_instance> instance;
    MempoolId_t pool{0, 0};
    bool matched = false;  // the allocation belongs to `pool`
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
    check_request_size(n);  // torch_oom.cpp
    if (!enabled_.load(std::memory_order_relaxed)) return uncached_malloc(n, device);
    // With the history on, the caller's stack is gathered once, before the allocation: the
    // segment_alloc / segment_map entries of memory this allocation brings in carry it, as in
    // PyTorch's allocator, and so does its alloc entry.
    const bool record = history_enabled_.load(std::memory_order_relaxed) ||
                        has_trackers_.load(std::memory_order_relaxed);
    alloc_context ctx;
    if (record) ctx = gather_alloc_context();  // torch_history.cpp
    segment_context_scope segment_context(record ? &ctx : nullptr);
    void* p = nullptr;
    if (n_routes_.load(std::memory_order_acquire) != 0 ||
        n_captures_.load(std::memory_order_acquire) != 0) {
      const pool_route_choice r = pick_route(device, stream);  // torch_mempool.cpp
      if (r.instance) {
        p = instance_malloc(*r.instance, n, device, stream);
      } else if (r.tag != 0) {
        streamsafe::tag_scope scope(r.tag);  // the MemPool's memory: segments of its own
        p = core_malloc(n, device, stream);
      } else {
        p = core_malloc(n, device, stream);
      }
      if (r.matched) note_pool_live(p, r.pool, device);
    } else {
      p = core_malloc(n, device, stream);
    }
    if (record) note_alloc(p, n, device, stream, ctx);
    if (c10::memoryProfilingEnabled()) report_to_profiler(p, static_cast<std::int64_t>(n), device);
    if (has_dropped_contexts_.load(std::memory_order_relaxed)) drain_dropped_contexts();
    return p;
  }
  void* core_malloc(std::size_t n, c10::DeviceIndex device, cudaStream_t stream) {
    void* p = nullptr;
    std::string oom;
    try {
      p = ss_->allocate(n, device, stream);
    } catch (const std::bad_alloc& e) {  // streamsafe::out_of_memory is a std::bad_alloc
      oom = e.what();
    } catch (const c10::Error&) {
      throw;
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "streamsafe: allocation of ", n, " bytes on device ",
                  static_cast<int>(device), " failed: ", e.what());
    }
    if (!p) {
      p = use_on_oom_malloc(n, device, stream);  // MemPool(use_on_oom=True): torch_mempool.cpp
      if (!p) out_of_memory(n, device, stream, oom.c_str());
    }
    return p;
  }

  std::uint64_t graph_of_pool(c10::DeviceIndex device, MempoolId_t mempool_id);  // checkpoint.cpp
  // torch_mempool.cpp
  pool_route_choice pick_route(int device, cudaStream_t stream);
  void note_pool_live(void* p, MempoolId_t pool, int device);
  void forget_pool_live(void* p);
  void* instance_malloc(pool_instance& inst, std::size_t n, c10::DeviceIndex device,
                        cudaStream_t stream);
  // The main allocator's cache on `device` back to the driver, waited for; true when the
  // device's bytes backed by memory went down.
  bool release_main_cache(c10::DeviceIndex device);
  void* use_on_oom_malloc(std::size_t n, c10::DeviceIndex device, cudaStream_t stream);
  std::shared_ptr<pool_instance> instance_of(void* ptr);
  std::vector<std::shared_ptr<pool_instance>> instances();
  std::shared_ptr<pool_instance> make_instance(MempoolId_t id, int device,
                                               std::shared_ptr<cca::CUDAAllocator> allocator);
  // Statistics of the device summed over the main allocator and each MemPool's. Releases that
  // empty_cache() queued (defer mode) and whose fences have completed are finished first, on the
  // calling thread and never waiting on a fence, so that reserved read right after an
  // empty_cache() on an idle device is what stays held, as after PyTorch's synchronous
  // empty_cache(). Memory behind a pending fence is still reserved (it is still mapped).
  streamsafe::statistics device_stats(c10::DeviceIndex device);
  // a->reclaim() (null: nothing), which also gives back what blocks that an empty_cache(defer)
  // found pending other streams' work held, once those uses completed. A failed release is a
  // warning (the memory stays queued and counted), never an error of the read.
  void finish_ready_releases(streamsafe::caching_allocator* a, const char* what);
  // caching_allocator_enable(False): cudaMalloc / cudaFree pass-through (torch_mempool.cpp).
  void* uncached_malloc(std::size_t n, c10::DeviceIndex device);
  bool uncached_free(void* ptr);
  // torch_ipc.cpp: the producer's exports of a block end when PyTorch frees it.
  void end_exports(void* ptr);
  void release_ipc_import(void* ptr, int device) noexcept;

  // torch_oom.cpp: PyTorch's OutOfMemoryError, PyTorch's message followed by streamsafe's
  // account of the device's memory; the OOM trace entry, observers and profiler report first.
  static void check_request_size(std::size_t n);
  [[noreturn]] void out_of_memory(std::size_t n, c10::DeviceIndex device, cudaStream_t stream,
                                  const char* what);

 public:
  void free(void* ptr) {
    if (!ptr) return;
    if (n_uncached_.load(std::memory_order_acquire) != 0 && uncached_free(ptr)) return;
    if (history_enabled_.load(std::memory_order_relaxed) ||
        has_trackers_.load(std::memory_order_relaxed))
      note_free(ptr);
    if (c10::memoryProfilingEnabled()) report_free_to_profiler(ptr);
    if (n_pool_live_.load(std::memory_order_acquire) != 0) forget_pool_live(ptr);
    try {
      if (n_exported_.load(std::memory_order_acquire) != 0) end_exports(ptr);  // torch_ipc.cpp
      if (n_instances_.load(std::memory_order_acquire) != 0) {
        if (std::shared_ptr<pool_instance> inst = instance_of(ptr)) {
          inst->alloc->deallocate(ptr);
          return;
        }
      }
      ss_->deallocate(ptr);
    } catch (const std::exception& e) {
      streamsafe::cuda::log_error(e.what());
      TORCH_WARN("streamsafe: free of ", ptr, " failed: ", e.what());
    }
    if (has_dropped_contexts_.load(std::memory_order_relaxed)) drain_dropped_contexts();
  }

 private:
  // torch_history.cpp: the stack PyTorch's recorder gathers for an allocation (none when the
  // history records no context) and when the trace entries carry it.
  struct alloc_context {
    std::shared_ptr<c10::GatheredContext> stack;
    cda::RecordContext when = cda::RecordContext::NEVER;
  };
  alloc_context gather_alloc_context();
  // The allocation context of this thread's malloc in progress, for the segment events it causes
  // (note_segment); nested scopes restore the outer one. A null context leaves the thread's
  // state alone (no history: the allocation path touches no thread-local).
  class segment_context_scope {
   public:
    explicit segment_context_scope(const alloc_context* c) noexcept;
    ~segment_context_scope();
    segment_context_scope(const segment_context_scope&) = delete;
    segment_context_scope& operator=(const segment_context_scope&) = delete;
    static const alloc_context* current() noexcept;

   private:
    static thread_local const alloc_context* current_;
    const alloc_context* outer_ = nullptr;
    bool set_ = false;
  };
  void note_alloc(void* p, std::size_t n, int device, cudaStream_t stream,
                  const alloc_context& ctx);
  void note_alloc(void* p, std::size_t n, int device, cudaStream_t stream) {
    note_alloc(p, n, device, stream, gather_alloc_context());
  }
  void note_free(void* p);
  // emptyCache (torch_mempool.cpp): the metadata and, with context="all", the Python stack that
  // the segment events of the releases it asks for carry, even when the release worker gives the
  // memory back after the call returned.
  void note_release_request();
  // Drops the release stack once no release is queued or in flight on any device.
  void forget_release_context_when_done();
  // The main allocator's and each MemPool allocator's queued releases go back now, so that a
  // snapshot shows what empty_cache asked for as given back: those whose fences have completed
  // (never waiting) and, while the memory history is recorded, every one (the host waits on
  // their fences, as PyTorch's synchronous empty_cache would have), so that the trace holds the
  // segment_free / segment_unmap entries of each empty_cache before it (torch_snapshot.cpp).
  void finish_releases_for_snapshot(MempoolId_t mempool_id);
  // Trace trackers get the entry as PyTorch's allocator gives it (approximate clock); the
  // history keeps it with time_.t_ in microseconds since the epoch, as snapshot() returns it.
  // Stamps the compile context and the user metadata (release_metadata_ for a release event, and
  // release_context_ as its stack).
  void emit(cda::TraceEntry te, bool release_event = false);
  // torch.profiler's memory records (profile_memory=True), as PyTorch's allocator reports them.
  void report_to_profiler(void* p, std::int64_t signed_size, int device);
  void report_free_to_profiler(void* p);

  streamsafe::options options_;
  std::string conf_;
  std::unique_ptr<streamsafe::cuda::allocator> ss_;
  std::array<std::atomic<std::size_t>, max_devices> limit_bytes_;

  std::mutex base_mu_;  // guards stats_base_ and fractions_
  std::array<streamsafe::statistics, max_devices> stats_base_{};
  std::array<double, max_devices> fractions_{};

  std::array<std::atomic<std::size_t>, max_devices> backed_bytes_;  // every instance's segments

  std::mutex settings_mu_;        // one _set_allocator_settings at a time (torch_settings.cpp)
  std::mutex torch_settings_mu_;  // a leaf: guards torch_settings_
  std::string torch_settings_;    // PyTorch's settings string as PyTorch last read it
  std::atomic<bool> backend_warned_{false};  // the one warning that the backend stays
  std::mutex pools_mu_;                      // guards pools_, captures_, routes_, instances_
  std::map<MempoolId_t, pool_state> pools_;
  std::vector<capture_state> captures_;
  std::vector<pool_route> routes_;
  std::vector<std::shared_ptr<pool_instance>> instances_;
  std::atomic<int> n_routes_{0};     // routes_.size(), read without the lock
  std::atomic<int> n_instances_{0};  // instances_.size(), read without the lock
  std::atomic<int> n_captures_{0};   // captures_.size(), read without the lock
  // The live blocks allocated into a pool (a route, a capture): ptr -> (pool, device).
  std::unordered_map<void*, std::pair<MempoolId_t, int>> pool_live_;
  std::atomic<int> n_pool_live_{0};

  std::atomic<bool> enabled_{true};
  std::mutex uncached_mu_;
  std::unordered_map<void*, int> uncached_;  // caching_allocator_enable(False): ptr -> device
  std::atomic<int> n_uncached_{0};

  // CUDA IPC (torch_ipc.cpp). Producer: the exports of each block, ended when PyTorch frees it
  // (PyTorch frees a sent block only once every consumer has let go). Consumer: open imports by
  // the producer's block, so that a block received twice is mapped once.
  std::mutex ipc_mu_;  // a leaf: guards ipc_exports_ and ipc_imports_
  std::unordered_map<void*, std::vector<streamsafe::ipc_handle>> ipc_exports_;
  std::atomic<int> n_exported_{0};
  std::map<std::tuple<std::int64_t, std::uint64_t, int>, std::weak_ptr<void>> ipc_imports_;
  std::mutex ipc_import_mu_;  // serialises getIpcDevPtr's imports (held across the import)

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
  std::deque<decltype(cca::SnapshotInfo::external_annotations)::value_type> annotations_;
  std::vector<std::string> compile_context_;  // torch.compile regions entered, innermost last
  std::string user_metadata_;                 // _set_memory_metadata
  std::string release_metadata_;  // user_metadata_ at the last emptyCache (see note_segment)
  // With context="all": the Python stack of the last emptyCache, on the segment_free / unmap
  // entries of the releases it asked for (PyTorch: the releasing call's stack), until none of
  // them is outstanding (torch_history.cpp).
  std::shared_ptr<c10::GatheredContext> release_context_;
  std::atomic<bool> has_release_context_{false};
  std::unordered_map<void*, live_block> live_;
  // Python stacks that a trace entry let go of in emit(), kept until a PyTorch thread that holds
  // none of our locks drops them (drain_dropped_contexts): destroying one takes the GIL, and the
  // release worker's thread (or any thread inside a streamsafe call) must never wait for it.
  std::vector<std::shared_ptr<c10::GatheredContext>> dropped_contexts_;  // under history_mu_
  std::atomic<bool> has_dropped_contexts_{false};
  void drain_dropped_contexts();
};

extern torch_allocator* g_allocator;  // set once by install; never destroyed (torch_extension.cpp)

}  // namespace streamsafe::torch_ext
