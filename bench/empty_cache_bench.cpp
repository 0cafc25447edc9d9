// Scenario 5: empty_cache (GPU suite only), with nothing pending, and with an unrelated 50 ms
// kernel pending on a stream that no allocator has ever seen.
//
// Each iteration (untimed part): allocate 8 x 32 MiB and 32 x 256 KiB on the allocation stream
// and free them (the caching allocators now hold 264 MiB in cache; for cuda_malloc the blocks
// stay allocated), then optionally:
//   fenced_ms     a kernel of that length on the allocation stream, which every release fence
//                 covers (the allocator saw that stream);
//   unrelated_ms  a kernel of that length on the "unrelated" stream, which no allocator saw,
//                 bracketed by timing events.
// Timed part (manual time, host wall clock): the release.
//   streamsafe_*_wait         empty_cache(wait): waits on exactly the fence events
//   streamsafe_*_defer        empty_cache(defer): releases what is safe, queues the rest
//   streamsafe_*_device_sync  cudaDeviceSynchronize() then empty_cache(wait): the usual
//                             "torch.cuda.synchronize(); torch.cuda.empty_cache()" approach
//   cuda_malloc               cudaFree of the blocks (no cache: this is its release)
//   cuda_malloc_async         cudaMemPoolTrimTo(pool, 0)
//   cub                       FreeAllCached()
//   pytorch_c10               emptyCache()
// Afterwards (untimed) both streams are drained and streamsafe's deferred queue finished, so each
// iteration starts alike. Counters: unrelated_done_at_return (fraction of iterations in which the
// unrelated kernel had already finished when the release returned: 1 means the release waited
// for it), unrelated_kernel_ms (its GPU time, from CUDA events), released_MiB and deferred_MiB
// (streamsafe: bytes released by the call, bytes it left queued). Targets: with the unrelated
// kernel pending, defer mode returns within 1 ms; wait mode waits only for the fenced stream.
#ifndef STREAMSAFE_BENCH_SIM
#include "allocators.hpp"

#include <streamsafe/kernels/optimizers.hpp>

#include <chrono>
#include <type_traits>
#include <vector>

namespace streamsafe_bench {
namespace {

enum class release_mode { wait, defer, device_sync, native };

template <class A>
inline constexpr bool is_streamsafe_v = std::is_same_v<A, streamsafe_cuda_malloc> ||
                                        std::is_same_v<A, streamsafe_expandable>;

struct timing_events {
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  timing_events() {
    STREAMSAFE_BENCH_CUDA(cudaEventCreate(&start));
    STREAMSAFE_BENCH_CUDA(cudaEventCreate(&stop));
  }
  ~timing_events() {
    (void)cudaEventDestroy(start);
    (void)cudaEventDestroy(stop);
  }
  timing_events(const timing_events&) = delete;
  timing_events& operator=(const timing_events&) = delete;
};

std::vector<std::size_t> cache_fill_sizes() {
  std::vector<std::size_t> sizes(8, std::size_t{32} << 20);
  sizes.insert(sizes.end(), 32, std::size_t{256} << 10);
  return sizes;
}

void spin(cudaStream_t s, double ms) {
  STREAMSAFE_BENCH_CUDA(streamsafe::kernels::launch_spin(s, ms));
}

template <class A>
void empty_cache(benchmark::State& state, tag<A>, release_mode mode) {
  A* a = get_or_skip<A>(state);
  if (a == nullptr) return;
  const auto unrelated_ms = static_cast<double>(state.range(0));
  const auto fenced_ms = static_cast<double>(state.range(1));
  try {
    const cudaStream_t s = A::stream(stream_role::main);
    const cudaStream_t u = A::stream(stream_role::unrelated);
    const std::vector<std::size_t> sizes = cache_fill_sizes();
    timing_events unrelated;
    std::vector<void*> blocks;
    double done_at_return = 0, unrelated_gpu_ms = 0, released_bytes = 0, deferred_bytes = 0;
    for (auto _ : state) {
      blocks.clear();
      for (std::size_t n : sizes) blocks.push_back(a->allocate(n, s));
      if constexpr (A::caches) {
        for (void* p : blocks) a->deallocate(p, s);
      }
      if (fenced_ms > 0) spin(s, fenced_ms);
      if (unrelated_ms > 0) {
        STREAMSAFE_BENCH_CUDA(cudaEventRecord(unrelated.start, u));
        spin(u, unrelated_ms);
        STREAMSAFE_BENCH_CUDA(cudaEventRecord(unrelated.stop, u));
      }

      const auto t0 = std::chrono::steady_clock::now();
      std::size_t released = 0;
      if constexpr (is_streamsafe_v<A>) {
        streamsafe::caching_allocator& alloc = a->allocator();
        switch (mode) {
          case release_mode::defer:
            released = alloc.empty_cache(streamsafe::empty_cache_mode::defer);
            break;
          case release_mode::device_sync:
            STREAMSAFE_BENCH_CUDA(cudaDeviceSynchronize());
            released = alloc.empty_cache(streamsafe::empty_cache_mode::wait);
            break;
          default: released = alloc.empty_cache(streamsafe::empty_cache_mode::wait); break;
        }
      } else if constexpr (A::caches) {
        a->release_cached();
      } else {
        for (void* p : blocks) a->deallocate(p, s);
      }
      const auto t1 = std::chrono::steady_clock::now();
      state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());

      if (unrelated_ms > 0) {
        const cudaError_t q = cudaEventQuery(unrelated.stop);
        if (q != cudaSuccess && q != cudaErrorNotReady) throw_cuda(q, "cudaEventQuery");
        done_at_return += q == cudaSuccess ? 1 : 0;
      }
      released_bytes += static_cast<double>(released);
      if constexpr (is_streamsafe_v<A>) {
        deferred_bytes += static_cast<double>(a->allocator().pending_release_bytes());
      }
      A::synchronize(u);
      A::synchronize(s);
      if (unrelated_ms > 0) {
        float ms = 0;
        STREAMSAFE_BENCH_CUDA(cudaEventElapsedTime(&ms, unrelated.start, unrelated.stop));
        unrelated_gpu_ms += ms;
      }
      if constexpr (is_streamsafe_v<A>) {
        a->allocator().empty_cache(streamsafe::empty_cache_mode::wait);  // finish the queue
      }
    }
    const auto n = static_cast<double>(state.iterations());
    if (n > 0 && unrelated_ms > 0) {
      state.counters["unrelated_done_at_return"] = done_at_return / n;
      state.counters["unrelated_kernel_ms"] = unrelated_gpu_ms / n;
    }
    if (n > 0 && is_streamsafe_v<A>) {
      state.counters["released_MiB"] = released_bytes / n / k_mib;
      state.counters["deferred_MiB"] = deferred_bytes / n / k_mib;
    }
  } catch (const std::exception& e) {
    skip_with(state, A::name(), e);
  }
}

// {unrelated_ms, fenced_ms}: nothing pending; the unrelated 50 ms kernel; the unrelated kernel
// and a 5 ms kernel on the fenced (allocation) stream. Five iterations each: an iteration with
// the unrelated kernel costs its 50 ms of wall time whatever the release costs.
void empty_cache_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"unrelated_ms", "fenced_ms"})
      ->Args({0, 0})
      ->Args({50, 0})
      ->Args({50, 5})
      ->Iterations(5)
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
}

BENCHMARK_CAPTURE(empty_cache, streamsafe_cuda_malloc_wait, tag<streamsafe_cuda_malloc>{},
                  release_mode::wait)
    ->Apply(empty_cache_args);
BENCHMARK_CAPTURE(empty_cache, streamsafe_cuda_malloc_defer, tag<streamsafe_cuda_malloc>{},
                  release_mode::defer)
    ->Apply(empty_cache_args);
BENCHMARK_CAPTURE(empty_cache, streamsafe_cuda_malloc_device_sync, tag<streamsafe_cuda_malloc>{},
                  release_mode::device_sync)
    ->Apply(empty_cache_args);
BENCHMARK_CAPTURE(empty_cache, streamsafe_expandable_wait, tag<streamsafe_expandable>{},
                  release_mode::wait)
    ->Apply(empty_cache_args);
BENCHMARK_CAPTURE(empty_cache, streamsafe_expandable_defer, tag<streamsafe_expandable>{},
                  release_mode::defer)
    ->Apply(empty_cache_args);
BENCHMARK_CAPTURE(empty_cache, streamsafe_expandable_device_sync, tag<streamsafe_expandable>{},
                  release_mode::device_sync)
    ->Apply(empty_cache_args);
BENCHMARK_CAPTURE(empty_cache, cuda_malloc, tag<cuda_malloc_adapter>{}, release_mode::native)
    ->Apply(empty_cache_args);
BENCHMARK_CAPTURE(empty_cache, cuda_malloc_async, tag<cuda_malloc_async_adapter>{},
                  release_mode::native)
    ->Apply(empty_cache_args);
BENCHMARK_CAPTURE(empty_cache, cub, tag<cub_adapter>{}, release_mode::native)
    ->Apply(empty_cache_args);
#if STREAMSAFE_BENCH_HAVE_C10
BENCHMARK_CAPTURE(empty_cache, pytorch_c10, tag<pytorch_c10_adapter>{}, release_mode::native)
    ->Apply(empty_cache_args);
#endif

}  // namespace
}  // namespace streamsafe_bench
#endif  // STREAMSAFE_BENCH_SIM
