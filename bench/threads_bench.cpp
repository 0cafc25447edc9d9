// Scenario 3: threads. 1, 2, 4, 8 and 16 threads each run same-stream 4 KiB allocate + free
// pairs, (a) each thread on its own stream (threads_own_stream), (b) all on one shared stream
// (threads_shared_stream).
//
// Streams come from the environment's pool (one per thread index, created once and kept, so an
// allocator's per-stream pools stay warm from run to run). Each thread makes one warm-up pair
// before the timed loop. Time: wall clock (UseRealTime); real_time is then the inverse of the
// total throughput. Counters: Mpairs_per_s, million pairs per second of all threads together
// (each thread's own rate, summed; items_per_second is Google Benchmark's equivalent), and
// ns_per_pair, a thread's wall-clock per pair averaged over the threads. The target: 8 threads
// on 8 streams reach at least 6x the one-thread throughput.
#ifdef STREAMSAFE_BENCH_SIM
#include "sim_allocators.hpp"
#else
#include "allocators.hpp"
#endif

namespace streamsafe_bench {
namespace {

inline constexpr std::size_t k_thread_pair_bytes = 4096;

template <class A>
void thread_pairs(benchmark::State& state, bool shared_stream) {
  A* a = get_or_skip<A>(state);
  if (a == nullptr) return;
  try {
    const auto s = shared_stream ? A::stream(stream_role::shared)
                                 : A::stream(stream_role::thread, state.thread_index());
    a->deallocate(a->allocate(k_thread_pair_bytes, s), s);
    loop_clock clock;
    // One batch of all the iterations between Google Benchmark's start and finish barriers, timed
    // inside them: each thread's clock covers its own pairs only, not the wait for the other
    // threads to be created or to finish. Mpairs_per_s (the sum of the threads' own rates) is then
    // the total throughput of threads that run independently.
    const benchmark::IterationCount n = state.max_iterations;
    while (state.KeepRunningBatch(n)) {
      clock.start();
      for (benchmark::IterationCount i = 0; i < n; ++i) {
        void* p = a->allocate(k_thread_pair_bytes, s);
        // The const overload (an input-only asm operand): Debian's Google Benchmark 1.7.1
        // read-write overload ("+m,r") let GCC hand CUB's DeviceFree a clobbered pointer.
        benchmark::DoNotOptimize(static_cast<const void*>(p));
        a->deallocate(p, s);
      }
      clock.stop();
    }
    state.SetItemsProcessed(state.iterations());
    set_rate_counters(state, clock, "ns_per_pair");
    A::synchronize(s);
  } catch (const std::exception& e) {
    skip_with(state, A::name(), e);
  }
}

template <class A>
void threads_own_stream(benchmark::State& state, tag<A>) {
  thread_pairs<A>(state, false);
}

template <class A>
void threads_shared_stream(benchmark::State& state, tag<A>) {
  thread_pairs<A>(state, true);
}

void thread_counts(benchmark::internal::Benchmark* b) {
  b->Threads(1)->Threads(2)->Threads(4)->Threads(8)->Threads(16)->UseRealTime();
}

#ifdef STREAMSAFE_BENCH_SIM
BENCHMARK_CAPTURE(threads_own_stream, sim_streamsafe_cuda_malloc, tag<sim_streamsafe_cuda_malloc>{})
    ->Apply(thread_counts);
BENCHMARK_CAPTURE(threads_own_stream, sim_streamsafe_expandable, tag<sim_streamsafe_expandable>{})
    ->Apply(thread_counts);
BENCHMARK_CAPTURE(threads_shared_stream, sim_streamsafe_cuda_malloc,
                  tag<sim_streamsafe_cuda_malloc>{})
    ->Apply(thread_counts);
BENCHMARK_CAPTURE(threads_shared_stream, sim_streamsafe_expandable,
                  tag<sim_streamsafe_expandable>{})
    ->Apply(thread_counts);
#else
BENCHMARK_CAPTURE(threads_own_stream, streamsafe_cuda_malloc, tag<streamsafe_cuda_malloc>{})
    ->Apply(thread_counts);
BENCHMARK_CAPTURE(threads_own_stream, streamsafe_expandable, tag<streamsafe_expandable>{})
    ->Apply(thread_counts);
BENCHMARK_CAPTURE(threads_own_stream, cuda_malloc, tag<cuda_malloc_adapter>{})
    ->Apply(thread_counts);
BENCHMARK_CAPTURE(threads_own_stream, cuda_malloc_async, tag<cuda_malloc_async_adapter>{})
    ->Apply(thread_counts);
BENCHMARK_CAPTURE(threads_own_stream, cub, tag<cub_adapter>{})->Apply(thread_counts);
#if STREAMSAFE_BENCH_HAVE_C10
BENCHMARK_CAPTURE(threads_own_stream, pytorch_c10, tag<pytorch_c10_adapter>{})
    ->Apply(thread_counts);
#endif
BENCHMARK_CAPTURE(threads_shared_stream, streamsafe_cuda_malloc, tag<streamsafe_cuda_malloc>{})
    ->Apply(thread_counts);
BENCHMARK_CAPTURE(threads_shared_stream, streamsafe_expandable, tag<streamsafe_expandable>{})
    ->Apply(thread_counts);
BENCHMARK_CAPTURE(threads_shared_stream, cuda_malloc, tag<cuda_malloc_adapter>{})
    ->Apply(thread_counts);
BENCHMARK_CAPTURE(threads_shared_stream, cuda_malloc_async, tag<cuda_malloc_async_adapter>{})
    ->Apply(thread_counts);
BENCHMARK_CAPTURE(threads_shared_stream, cub, tag<cub_adapter>{})->Apply(thread_counts);
#if STREAMSAFE_BENCH_HAVE_C10
BENCHMARK_CAPTURE(threads_shared_stream, pytorch_c10, tag<pytorch_c10_adapter>{})
    ->Apply(thread_counts);
#endif
#endif

}  // namespace
}  // namespace streamsafe_bench
