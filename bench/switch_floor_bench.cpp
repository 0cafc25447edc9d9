// The floor of a sleep/wake switch (GPU suite only): the driver calls that giving N bytes of a
// process's device memory back and taking them again are made of, timed alone, with no
// allocator, so that pause and resume figures can be read against the least they could cost.
//
//  switch_floor/vmm/handle_mib:H/total_gib:G   cuMemCreate of G GiB in handles of H MiB,
//                                              cuMemMap of each, one cuMemSetAccess over the
//                                              whole range (the driver's cost is per mapping
//                                              whichever way, docs/observability.md), the range
//                                              written once (untimed), then one cuMemUnmap over
//                                              the range and cuMemRelease of each handle.
//                                              Counters: each call's total ms per round
//                                              (create_ms ... release_ms), in_ms (create + map +
//                                              access: memory coming back), out_ms (unmap +
//                                              release: memory leaving), us_per_handle (in and
//                                              out together), handles. Iteration time: in + out.
//  switch_floor/copy/dir:D/total_mib:M         one copy of M MiB between device memory and pinned
//                                              host memory (cudaHostAlloc) on a non-blocking
//                                              side stream, timed from the enqueue to the
//                                              stream's completion; D is d2h (offload), h2d
//                                              (restore) or both (M each way at once, on two
//                                              streams: one side leaving while the other
//                                              comes back). Counter GiB_per_s (per direction).
//  switch_floor/pin/total_mib:M                cudaHostAlloc + cudaFreeHost of M MiB: what a
//                                              first offload pays to pin its backup. Counter
//                                              GiB_per_s.
// docs/sleep.md ("The floor") gives the table and what it says a switch of N GiB can cost.
#ifndef STREAMSAFE_BENCH_SIM
#include "allocators.hpp"

#include <streamsafe/backends/driver_api.hpp>

#include <chrono>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace streamsafe_bench {
namespace {

namespace drv = streamsafe::cuda::driver;
using clock_type = std::chrono::steady_clock;

void check_cu(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS)
    throw std::runtime_error(std::string(what) + " failed: " + drv::error_name(r));
}

double seconds(clock_type::time_point a, clock_type::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

void vmm_round_trip(benchmark::State& state) {
  try {
    gpu_env::require();
    drv::load();
    STREAMSAFE_BENCH_CUDA(cudaSetDevice(0));
    STREAMSAFE_BENCH_CUDA(cudaFree(nullptr));  // the primary context before any cuMem*
    const std::size_t handle = static_cast<std::size_t>(state.range(0)) << 20;
    const std::size_t total = static_cast<std::size_t>(state.range(1)) << 30;
    const std::size_t n = total / handle;
    std::size_t free_bytes = 0, device_bytes = 0;
    STREAMSAFE_BENCH_CUDA(cudaMemGetInfo(&free_bytes, &device_bytes));
    if (total + (std::size_t{1} << 30) > free_bytes)
      throw std::runtime_error("needs " + std::to_string(state.range(1) + 1) + " GiB free");
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUdeviceptr base = 0;
    check_cu(drv::mem_address_reserve(&base, total, 0, 0, 0), "cuMemAddressReserve");
    const cudaStream_t s = gpu_env::stream(stream_role::main);
    double t_create = 0, t_map = 0, t_access = 0, t_unmap = 0, t_release = 0;
    std::vector<CUmemGenericAllocationHandle> handles(n);
    for (auto _ : state) {
      const auto t0 = clock_type::now();
      for (auto& h : handles) check_cu(drv::mem_create(&h, handle, &prop, 0), "cuMemCreate");
      const auto t1 = clock_type::now();
      for (std::size_t i = 0; i < n; ++i)
        check_cu(drv::mem_map(base + i * handle, handle, 0, handles[i], 0), "cuMemMap");
      const auto t2 = clock_type::now();
      check_cu(drv::mem_set_access(base, total, &access, 1), "cuMemSetAccess");
      const auto t3 = clock_type::now();
      STREAMSAFE_BENCH_CUDA(
          cudaMemsetAsync(reinterpret_cast<void*>(static_cast<std::uintptr_t>(base)), 1, total, s));
      gpu_env::synchronize(s);
      const auto t4 = clock_type::now();
      check_cu(drv::mem_unmap(base, total), "cuMemUnmap");
      const auto t5 = clock_type::now();
      for (auto h : handles) check_cu(drv::mem_release(h), "cuMemRelease");
      const auto t6 = clock_type::now();
      t_create += seconds(t0, t1);
      t_map += seconds(t1, t2);
      t_access += seconds(t2, t3);
      t_unmap += seconds(t4, t5);
      t_release += seconds(t5, t6);
      state.SetIterationTime(seconds(t0, t3) + seconds(t4, t6));
    }
    check_cu(drv::mem_address_free(base, total), "cuMemAddressFree");
    const double rounds = static_cast<double>(state.iterations());
    const auto ms = [&](double t) { return benchmark::Counter(t / rounds * 1e3); };
    state.counters["handles"] = static_cast<double>(n);
    state.counters["create_ms"] = ms(t_create);
    state.counters["map_ms"] = ms(t_map);
    state.counters["access_ms"] = ms(t_access);
    state.counters["unmap_ms"] = ms(t_unmap);
    state.counters["release_ms"] = ms(t_release);
    state.counters["in_ms"] = ms(t_create + t_map + t_access);
    state.counters["out_ms"] = ms(t_unmap + t_release);
    state.counters["us_per_handle"] = (t_create + t_map + t_access + t_unmap + t_release) / rounds /
                                      static_cast<double>(n) * 1e6;
  } catch (const std::exception& e) {
    skip_with(state, "switch_floor/vmm", e);
  }
}

// Pinned host memory of at least `bytes` (kept across benchmarks: pinning is slow).
void* pinned(std::size_t bytes) {
  static void* host = nullptr;
  static std::size_t have = 0;
  if (have < bytes) {
    if (host) STREAMSAFE_BENCH_CUDA(cudaFreeHost(host));
    host = nullptr;
    have = 0;
    STREAMSAFE_BENCH_CUDA(cudaHostAlloc(&host, bytes, cudaHostAllocDefault));
    have = bytes;
  }
  return host;
}

enum copy_dir : int { d2h = 0, h2d = 1, both = 2 };

void copy(benchmark::State& state) {
  try {
    gpu_env::require();
    STREAMSAFE_BENCH_CUDA(cudaSetDevice(0));
    const auto dir = static_cast<copy_dir>(state.range(0));
    const std::size_t bytes = static_cast<std::size_t>(state.range(1)) << 20;
    char* host = static_cast<char*>(pinned(2 * bytes));
    void* dev = nullptr;
    STREAMSAFE_BENCH_CUDA(cudaMalloc(&dev, 2 * bytes));
    char* d = static_cast<char*>(dev);
    const cudaStream_t a = gpu_env::stream(stream_role::other);
    const cudaStream_t b = gpu_env::stream(stream_role::unrelated);
    STREAMSAFE_BENCH_CUDA(cudaMemsetAsync(d, 1, 2 * bytes, a));
    gpu_env::synchronize(a);
    for (auto _ : state) {
      const auto t0 = clock_type::now();
      if (dir != h2d)
        STREAMSAFE_BENCH_CUDA(cudaMemcpyAsync(host, d, bytes, cudaMemcpyDeviceToHost, a));
      if (dir != d2h)
        STREAMSAFE_BENCH_CUDA(
            cudaMemcpyAsync(d + bytes, host + bytes, bytes, cudaMemcpyHostToDevice, b));
      gpu_env::synchronize(a);
      gpu_env::synchronize(b);
      state.SetIterationTime(seconds(t0, clock_type::now()));
    }
    STREAMSAFE_BENCH_CUDA(cudaFree(dev));
    state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
    state.counters["GiB_per_s"] = benchmark::Counter(
        static_cast<double>(bytes) / k_gib * static_cast<double>(state.iterations()),
        benchmark::Counter::kIsRate);
  } catch (const std::exception& e) {
    skip_with(state, "switch_floor/copy", e);
  }
}

void pin(benchmark::State& state) {
  try {
    gpu_env::require();
    STREAMSAFE_BENCH_CUDA(cudaSetDevice(0));
    const std::size_t bytes = static_cast<std::size_t>(state.range(0)) << 20;
    for (auto _ : state) {
      const auto t0 = clock_type::now();
      void* host = nullptr;
      STREAMSAFE_BENCH_CUDA(cudaHostAlloc(&host, bytes, cudaHostAllocDefault));
      STREAMSAFE_BENCH_CUDA(cudaFreeHost(host));
      state.SetIterationTime(seconds(t0, clock_type::now()));
    }
    state.counters["GiB_per_s"] = benchmark::Counter(
        static_cast<double>(bytes) / k_gib * static_cast<double>(state.iterations()),
        benchmark::Counter::kIsRate);
  } catch (const std::exception& e) {
    skip_with(state, "switch_floor/pin", e);
  }
}

const bool registered = [] {
  auto* vmm = benchmark::RegisterBenchmark("switch_floor/vmm", vmm_round_trip);
  vmm->ArgNames({"handle_mib", "total_gib"})->UseManualTime()->Unit(benchmark::kMillisecond);
  for (const long total_gib : {1L, 4L, 16L, 32L}) {
    for (const long handle_mib : {2L, 8L, 20L, 64L, 256L, 1024L, 2048L}) {
      if (handle_mib > total_gib * 1024) continue;
      if ((total_gib << 10) / handle_mib > 4096) continue;  // minutes of calls for no new fact
      vmm->Args({handle_mib, total_gib});
    }
  }
  vmm->Iterations(3);
  auto* cp = benchmark::RegisterBenchmark("switch_floor/copy", copy);
  cp->ArgNames({"dir", "total_mib"})->UseManualTime()->Unit(benchmark::kMillisecond);
  for (const long dir : {0L, 1L, 2L})
    for (const long mib : {64L, 1024L, 4096L}) cp->Args({dir, mib});
  cp->Iterations(5);
  benchmark::RegisterBenchmark("switch_floor/pin", pin)
      ->ArgNames({"total_mib"})
      ->Arg(1024)
      ->Iterations(2)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  return true;
}();

}  // namespace
}  // namespace streamsafe_bench
#endif  // STREAMSAFE_BENCH_SIM
