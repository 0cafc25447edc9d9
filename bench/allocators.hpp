// streamsafe benchmarks: one adapter per allocator, all of the same shape (bench_common.hpp), so
// that every scenario body runs unchanged against each of them on the same GPU, in one binary.
//
//   streamsafe_cuda_malloc   streamsafe::caching_allocator over cuda_malloc_backend
//   streamsafe_expandable    streamsafe::caching_allocator over expandable_backend (VMM)
//   cuda_malloc              cudaMalloc / cudaFree (no cache)
//   cuda_malloc_async        cudaMallocAsync / cudaFreeAsync on the device's default pool, release
//                            threshold set to the maximum (the pool keeps everything)
//   cub                      cub::CachingDeviceAllocator (CCCL), power-of-two bins 512 B..1 GiB,
//                            no cap on cached bytes (its default caches only up to 2 MiB blocks
//                            and 6 MB in total, which no deep-learning workload would keep)
//   pytorch_c10              c10::cuda::CUDACachingAllocator (raw_alloc_with_stream /
//                            raw_delete), only when CMake found PyTorch (STREAMSAFE_BENCH_HAVE_C10)
//
// Every adapter serves device 0 and is created on first use and never destroyed (no teardown
// inside a measurement, no ordering problem with the CUDA runtime's own exit handlers).
//
// Cross-stream operations (scenario 4), native where the allocator has them, otherwise what a
// user of that allocator writes by hand:
//   allocate_owned(n, s) / deallocate_owned(p, s)   a block whose cross-stream use is recorded
//                                                    (PyTorch: a DataPtr, the Tensor path)
//   record_stream(p, alloc_s, use_s)                 p is used on use_s; later reuse on alloc_s
//   must
//                                                    wait for that use
//   deallocate_on(p, alloc_s, last_use_s)            stream-ordered free: the last use is on
//   last_use_s
// Emulation (cub, and cuda_malloc_async's record_stream): cudaEventRecord(e, use_s) +
// cudaStreamWaitEvent(alloc_s, e), then the free. cudaFree needs nothing: it synchronises.
#pragma once

#include "bench_common.hpp"

#include <streamsafe/backends/cuda_malloc_backend.hpp>
#include <streamsafe/backends/expandable_backend.hpp>
#include <streamsafe/backends/gpu.hpp>
#include <streamsafe/core/caching_allocator.hpp>

#include <cuda_runtime_api.h>
#include <cub/util_allocator.cuh>

#if STREAMSAFE_BENCH_HAVE_C10
#include "c10_baseline.hpp"
#endif

#include <array>
#include <atomic>
#include <cstdint>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace streamsafe_bench {

[[noreturn]] inline void throw_cuda(cudaError_t status, const char* call) {
  (void)cudaGetLastError();
  throw std::runtime_error(std::string(call) + " failed: " + cudaGetErrorName(status) + " (" +
                           cudaGetErrorString(status) + ")");
}

#define STREAMSAFE_BENCH_CUDA(call)                                    \
  do {                                                                 \
    const cudaError_t streamsafe_bench_status_ = (call);               \
    if (streamsafe_bench_status_ != cudaSuccess) {                     \
      ::streamsafe_bench::throw_cuda(streamsafe_bench_status_, #call); \
    }                                                                  \
  } while (0)

// Device 0 and its stream pool (non-blocking streams, created once, never destroyed).
struct gpu_env {
  static bool available() {
    static const bool present = streamsafe::cuda::device_count() > 0;
    return present;
  }

  static void require() {
    if (!available())
      throw std::runtime_error("no CUDA device (streamsafe::cuda::device_count() == 0)");
  }

  static cudaStream_t stream(stream_role role, int index = 0) {
    static std::array<std::atomic<cudaStream_t>, k_stream_slots> slots{};
    static std::mutex create_mutex;
    std::atomic<cudaStream_t>& slot = slots[static_cast<std::size_t>(stream_slot(role, index))];
    cudaStream_t s = slot.load(std::memory_order_acquire);
    if (s != nullptr) return s;
    std::lock_guard<std::mutex> lock(create_mutex);
    s = slot.load(std::memory_order_relaxed);
    if (s == nullptr) {
      require();
      STREAMSAFE_BENCH_CUDA(cudaSetDevice(0));
      STREAMSAFE_BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      slot.store(s, std::memory_order_release);
    }
    return s;
  }

  static void synchronize(cudaStream_t s) { STREAMSAFE_BENCH_CUDA(cudaStreamSynchronize(s)); }

  // This thread's event for the hand-written cross-stream pattern (never destroyed).
  static cudaEvent_t emulation_event() {
    thread_local cudaEvent_t event = nullptr;
    if (event == nullptr)
      STREAMSAFE_BENCH_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return event;
  }

  // What users of allocators without record_stream write: later work on alloc_stream waits for
  // the work queued so far on use_stream.
  static void order_after(cudaStream_t alloc_stream, cudaStream_t use_stream) {
    const cudaEvent_t event = emulation_event();
    STREAMSAFE_BENCH_CUDA(cudaEventRecord(event, use_stream));
    STREAMSAFE_BENCH_CUDA(cudaStreamWaitEvent(alloc_stream, event, 0));
  }
};

inline streamsafe::stream_handle to_handle(cudaStream_t s) {
  return reinterpret_cast<streamsafe::stream_handle>(s);
}

// ---- streamsafe ---------------------------------------------------------------------------------

// Reuse = all_streams: options::reuse_fence:all_streams, with a second stream (stream_role::other)
// known to the allocator, so that each reuse fence records one event.
template <streamsafe::backend_kind Kind,
          streamsafe::reuse_fence_scope Reuse = streamsafe::reuse_fence_scope::allocation_stream>
class streamsafe_adapter {
 public:
  using stream_type = cudaStream_t;
  using backend_type = std::conditional_t<Kind == streamsafe::backend_kind::expandable,
                                          streamsafe::cuda::expandable_backend,
                                          streamsafe::cuda::cuda_malloc_backend>;
  static constexpr bool caches = true;
  static constexpr const char* cross_stream_method = "native record_stream / deallocate(p, stream)";

  static const char* name() {
    if (Reuse == streamsafe::reuse_fence_scope::all_streams) {
      return Kind == streamsafe::backend_kind::expandable ? "streamsafe_expandable_reuse_fence"
                                                          : "streamsafe_cuda_malloc_reuse_fence";
    }
    return Kind == streamsafe::backend_kind::expandable ? "streamsafe_expandable"
                                                        : "streamsafe_cuda_malloc";
  }
  static stream_type stream(stream_role role, int index = 0) {
    return gpu_env::stream(role, index);
  }
  static void synchronize(stream_type s) { gpu_env::synchronize(s); }
  static streamsafe_adapter& get() {
    static streamsafe_adapter* a = [] {
      gpu_env::require();
      return new streamsafe_adapter();
    }();
    return *a;
  }

  void* allocate(std::size_t bytes, stream_type s) { return alloc_.allocate(bytes, to_handle(s)); }
  // The host free: the last use is on the allocation stream.
  void deallocate(void* p, stream_type) { alloc_.deallocate(p); }

  void* allocate_owned(std::size_t bytes, stream_type s) { return allocate(bytes, s); }
  void record_stream(void* p, stream_type, stream_type use) {
    alloc_.record_stream(p, to_handle(use));
  }
  void deallocate_owned(void* p, stream_type) { alloc_.deallocate(p); }
  void deallocate_on(void* p, stream_type, stream_type last_use) {
    alloc_.deallocate(p, to_handle(last_use));
  }

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

  streamsafe::caching_allocator& allocator() { return alloc_; }

 private:
  streamsafe_adapter() : backend_(0), alloc_(backend_, make_options()) {
    if (Reuse == streamsafe::reuse_fence_scope::all_streams) {
      alloc_.deallocate(
          alloc_.allocate(512, to_handle(stream(stream_role::other))));  // a second known stream
    }
  }
  static streamsafe::options make_options() {
    streamsafe::options o;  // the defaults: release fence all_streams, empty_cache wait
    o.backend = Kind;
    o.reuse_fence = Reuse;
    return o;
  }

  backend_type backend_;
  streamsafe::caching_allocator alloc_;
};

using streamsafe_cuda_malloc = streamsafe_adapter<streamsafe::backend_kind::cuda_malloc>;
using streamsafe_expandable = streamsafe_adapter<streamsafe::backend_kind::expandable>;
using streamsafe_cuda_malloc_reuse_fence = streamsafe_adapter<
    streamsafe::backend_kind::cuda_malloc, streamsafe::reuse_fence_scope::all_streams>;

// ---- cudaMalloc / cudaFree ---------------------------------------------------------------------

class cuda_malloc_adapter {
 public:
  using stream_type = cudaStream_t;
  static constexpr bool caches = false;
  static constexpr const char* cross_stream_method =
      "none needed: cudaFree synchronises the device";

  static const char* name() { return "cuda_malloc"; }
  static stream_type stream(stream_role role, int index = 0) {
    return gpu_env::stream(role, index);
  }
  static void synchronize(stream_type s) { gpu_env::synchronize(s); }
  static cuda_malloc_adapter& get() {
    static cuda_malloc_adapter* a = [] {
      gpu_env::require();
      return new cuda_malloc_adapter();
    }();
    return *a;
  }

  void* allocate(std::size_t bytes, stream_type) {
    void* p = nullptr;
    STREAMSAFE_BENCH_CUDA(cudaMalloc(&p, bytes));
    return p;
  }
  void deallocate(void* p, stream_type) { STREAMSAFE_BENCH_CUDA(cudaFree(p)); }

  void* allocate_owned(std::size_t bytes, stream_type s) { return allocate(bytes, s); }
  void record_stream(void*, stream_type, stream_type) {}
  void deallocate_owned(void* p, stream_type s) { deallocate(p, s); }
  void deallocate_on(void* p, stream_type s, stream_type) { deallocate(p, s); }

  std::int64_t events_recorded() const { return -1; }
  std::int64_t stream_waits() const { return -1; }
  void release_cached() {}
  void reset_peak_reserved() {}
  std::int64_t peak_reserved_bytes() { return -1; }
  std::int64_t reserved_bytes() { return -1; }
};

// ---- cudaMallocAsync, default pool, release threshold = max ------------------------------------

class cuda_malloc_async_adapter {
 public:
  using stream_type = cudaStream_t;
  static constexpr bool caches = true;
  static constexpr const char* cross_stream_method =
      "record_stream emulated (event + stream wait); cudaFreeAsync on the other stream";

  static const char* name() { return "cuda_malloc_async"; }
  static stream_type stream(stream_role role, int index = 0) {
    return gpu_env::stream(role, index);
  }
  static void synchronize(stream_type s) { gpu_env::synchronize(s); }
  static cuda_malloc_async_adapter& get() {
    static cuda_malloc_async_adapter* a = [] {
      gpu_env::require();
      return new cuda_malloc_async_adapter();
    }();
    return *a;
  }

  void* allocate(std::size_t bytes, stream_type s) {
    void* p = nullptr;
    STREAMSAFE_BENCH_CUDA(cudaMallocAsync(&p, bytes, s));
    return p;
  }
  void deallocate(void* p, stream_type s) { STREAMSAFE_BENCH_CUDA(cudaFreeAsync(p, s)); }

  void* allocate_owned(std::size_t bytes, stream_type s) { return allocate(bytes, s); }
  void record_stream(void*, stream_type alloc_s, stream_type use_s) {
    gpu_env::order_after(alloc_s, use_s);
  }
  void deallocate_owned(void* p, stream_type s) { deallocate(p, s); }
  void deallocate_on(void* p, stream_type, stream_type last_use) { deallocate(p, last_use); }

  std::int64_t events_recorded() const { return -1; }
  std::int64_t stream_waits() const { return -1; }
  void release_cached() { STREAMSAFE_BENCH_CUDA(cudaMemPoolTrimTo(pool_, 0)); }
  void reset_peak_reserved() {
    std::uint64_t zero = 0;
    STREAMSAFE_BENCH_CUDA(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero));
  }
  std::int64_t peak_reserved_bytes() { return attribute(cudaMemPoolAttrReservedMemHigh); }
  std::int64_t reserved_bytes() { return attribute(cudaMemPoolAttrReservedMemCurrent); }

 private:
  cuda_malloc_async_adapter() {
    STREAMSAFE_BENCH_CUDA(cudaSetDevice(0));
    STREAMSAFE_BENCH_CUDA(cudaDeviceGetDefaultMemPool(&pool_, 0));
    std::uint64_t threshold = std::numeric_limits<std::uint64_t>::max();
    STREAMSAFE_BENCH_CUDA(
        cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold));
  }
  std::int64_t attribute(cudaMemPoolAttr attr) {
    std::uint64_t value = 0;
    STREAMSAFE_BENCH_CUDA(cudaMemPoolGetAttribute(pool_, attr, &value));
    return static_cast<std::int64_t>(value);
  }

  cudaMemPool_t pool_ = nullptr;
};

// ---- cub::CachingDeviceAllocator ---------------------------------------------------------------

class cub_adapter {
 public:
  using stream_type = cudaStream_t;
  static constexpr bool caches = true;
  static constexpr const char* cross_stream_method =
      "emulated: event + stream wait, then DeviceFree";

  static const char* name() { return "cub"; }
  static stream_type stream(stream_role role, int index = 0) {
    return gpu_env::stream(role, index);
  }
  static void synchronize(stream_type s) { gpu_env::synchronize(s); }
  static cub_adapter& get() {
    static cub_adapter* a = [] {
      gpu_env::require();
      STREAMSAFE_BENCH_CUDA(cudaSetDevice(0));
      return new cub_adapter();
    }();
    return *a;
  }

  void* allocate(std::size_t bytes, stream_type s) {
    void* p = nullptr;
    STREAMSAFE_BENCH_CUDA(alloc_.DeviceAllocate(&p, bytes, s));
    return p;
  }
  void deallocate(void* p, stream_type) { STREAMSAFE_BENCH_CUDA(alloc_.DeviceFree(p)); }

  void* allocate_owned(std::size_t bytes, stream_type s) { return allocate(bytes, s); }
  void record_stream(void*, stream_type alloc_s, stream_type use_s) {
    gpu_env::order_after(alloc_s, use_s);
  }
  void deallocate_owned(void* p, stream_type s) { deallocate(p, s); }
  void deallocate_on(void* p, stream_type alloc_s, stream_type last_use) {
    gpu_env::order_after(alloc_s, last_use);
    deallocate(p, alloc_s);
  }

  std::int64_t events_recorded() const { return -1; }
  std::int64_t stream_waits() const { return -1; }
  void release_cached() { STREAMSAFE_BENCH_CUDA(alloc_.FreeAllCached()); }
  void reset_peak_reserved() {}
  std::int64_t peak_reserved_bytes() { return -1; }  // not kept: replay tracks reserved_bytes()
  std::int64_t reserved_bytes() {
    std::lock_guard<std::mutex> lock(alloc_.mutex);
    const auto it = alloc_.cached_bytes.find(0);
    if (it == alloc_.cached_bytes.end()) return 0;
    return static_cast<std::int64_t>(it->second.free + it->second.live);
  }

 private:
  // bin_growth 2, min_bin 9 (512 B), max_bin 30 (1 GiB), no cap on cached bytes, skip cleanup.
  cub_adapter() : alloc_(2u, 9u, 30u, cub::CachingDeviceAllocator::INVALID_SIZE, true) {}

  cub::CachingDeviceAllocator alloc_;
};

// ---- PyTorch c10
// ---------------------------------------------------------------------------------

#if STREAMSAFE_BENCH_HAVE_C10
class pytorch_c10_adapter {
 public:
  using stream_type = cudaStream_t;
  static constexpr bool caches = true;
  static constexpr const char* cross_stream_method =
      "native recordStream on a DataPtr (Tensor path)";

  static const char* name() { return "pytorch_c10"; }
  static stream_type stream(stream_role role, int index = 0) {
    return gpu_env::stream(role, index);
  }
  static void synchronize(stream_type s) { gpu_env::synchronize(s); }
  static pytorch_c10_adapter& get() {
    static pytorch_c10_adapter* a = [] {
      gpu_env::require();
      STREAMSAFE_BENCH_CUDA(cudaSetDevice(0));
      char why[512] = {};
      if (!c10_baseline::initialize(why, sizeof why)) throw std::runtime_error(why);
      return new pytorch_c10_adapter();
    }();
    return *a;
  }

  void* allocate(std::size_t bytes, stream_type s) { return c10_baseline::allocate(bytes, s); }
  void deallocate(void* p, stream_type) { c10_baseline::deallocate(p); }

  void* allocate_owned(std::size_t bytes, stream_type s) {
    return c10_baseline::allocate_owned(bytes, s);
  }
  void record_stream(void* p, stream_type, stream_type use) { c10_baseline::record_stream(p, use); }
  void deallocate_owned(void* p, stream_type) { c10_baseline::deallocate_owned(p); }
  // PyTorch has no stream-ordered free: the idiom is record_stream on the last stream, then free.
  void deallocate_on(void* p, stream_type, stream_type last_use) {
    c10_baseline::record_stream(p, last_use);
    c10_baseline::deallocate_owned(p);
  }

  std::int64_t events_recorded() const { return -1; }
  std::int64_t stream_waits() const { return -1; }
  void release_cached() { c10_baseline::empty_cache(); }
  void reset_peak_reserved() { c10_baseline::reset_peak_reserved(); }
  std::int64_t peak_reserved_bytes() { return c10_baseline::peak_reserved_bytes(); }
  std::int64_t reserved_bytes() { return c10_baseline::reserved_bytes(); }
};
#endif

}  // namespace streamsafe_bench
