// Scenario 1: a same-stream allocate + free pair, at 512 B, 64 KiB, 1 MiB and 64 MiB.
//
// The hot path of every caching allocator: the block goes back to the stream's pool and the
// next request of the same size takes it again. One warm-up pair before the timed loop, so the
// pool already holds a block of the size (cudaMalloc has no pool: every pair is a driver call).
// Time: host wall-clock per pair (real_time). Counters: ns_per_pair, Mpairs_per_s, and
// streamsafe's events_per_pair and stream_waits_per_pair (the target: 0 on this path).
// The *_reuse_fence rows: options::reuse_fence:all_streams with one other known stream, the
// cost of fencing host frees against every stream (one event per batch of frees).
#ifdef STREAMSAFE_BENCH_SIM
#include "sim_allocators.hpp"
#else
#include "allocators.hpp"
#endif

namespace streamsafe_bench {
namespace {

template <class A>
void same_stream_pair(benchmark::State& state, tag<A>) {
  A* a = get_or_skip<A>(state);
  if (a == nullptr) return;
  const auto bytes = static_cast<std::size_t>(state.range(0));
  try {
    const auto s = A::stream(stream_role::main);
    a->deallocate(a->allocate(bytes, s), s);
    const std::int64_t events_before = a->events_recorded();
    const std::int64_t waits_before = a->stream_waits();
    loop_clock clock;
    clock.start();
    for (auto _ : state) {
      void* p = a->allocate(bytes, s);
      // The const overload (an input-only asm operand): Debian's Google Benchmark 1.7.1 read-write
      // overload ("+m,r") let GCC hand CUB's DeviceFree a clobbered pointer in this loop.
      benchmark::DoNotOptimize(static_cast<const void*>(p));
      a->deallocate(p, s);
    }
    clock.stop();
    const auto pairs = static_cast<double>(state.iterations());
    set_rate_counters(state, clock, "ns_per_pair");
    set_event_counters(state, *a, events_before, waits_before, pairs);
    A::synchronize(s);
  } catch (const std::exception& e) {
    skip_with(state, A::name(), e);
  }
}

void pair_sizes(benchmark::internal::Benchmark* b) {
  b->ArgName("bytes")->Arg(512)->Arg(64 << 10)->Arg(1 << 20)->Arg(64 << 20)->UseRealTime();
}

#ifdef STREAMSAFE_BENCH_SIM
BENCHMARK_CAPTURE(same_stream_pair, sim_streamsafe_cuda_malloc, tag<sim_streamsafe_cuda_malloc>{})
    ->Apply(pair_sizes);
BENCHMARK_CAPTURE(same_stream_pair, sim_streamsafe_expandable, tag<sim_streamsafe_expandable>{})
    ->Apply(pair_sizes);
BENCHMARK_CAPTURE(same_stream_pair, sim_streamsafe_cuda_malloc_reuse_fence,
                  tag<sim_streamsafe_cuda_malloc_reuse_fence>{})
    ->Apply(pair_sizes);
BENCHMARK_CAPTURE(same_stream_pair, sim_streamsafe_expandable_reuse_fence,
                  tag<sim_streamsafe_expandable_reuse_fence>{})
    ->Apply(pair_sizes);
#else
BENCHMARK_CAPTURE(same_stream_pair, streamsafe_cuda_malloc, tag<streamsafe_cuda_malloc>{})
    ->Apply(pair_sizes);
BENCHMARK_CAPTURE(same_stream_pair, streamsafe_expandable, tag<streamsafe_expandable>{})
    ->Apply(pair_sizes);
BENCHMARK_CAPTURE(same_stream_pair, streamsafe_cuda_malloc_reuse_fence,
                  tag<streamsafe_cuda_malloc_reuse_fence>{})
    ->Apply(pair_sizes);
BENCHMARK_CAPTURE(same_stream_pair, cuda_malloc, tag<cuda_malloc_adapter>{})->Apply(pair_sizes);
BENCHMARK_CAPTURE(same_stream_pair, cuda_malloc_async, tag<cuda_malloc_async_adapter>{})
    ->Apply(pair_sizes);
BENCHMARK_CAPTURE(same_stream_pair, cub, tag<cub_adapter>{})->Apply(pair_sizes);
#if STREAMSAFE_BENCH_HAVE_C10
BENCHMARK_CAPTURE(same_stream_pair, pytorch_c10, tag<pytorch_c10_adapter>{})->Apply(pair_sizes);
#endif
#endif

}  // namespace
}  // namespace streamsafe_bench
