// Scenario 4: cross-stream use (GPU suite only).
//
//  record_stream_free   allocate on stream A, record a use on stream B (record_stream), free;
//                       the next iteration allocates on A again (the block is reused once the
//                       use on B is known to be finished, or A waits for it).
//  free_on_other_stream allocate on A, stream-ordered free whose last use is on B
//                       (deallocate(p, B)); the next iteration reuses on A.
// Allocators without these operations run what their users write by hand (allocators.hpp:
// event record on B + stream wait on A). No kernel runs: this measures the allocator's own cost.
// Time: host wall-clock per iteration (real_time). Counters: ns_per_pair, Mpairs_per_s,
// streamsafe's events_per_pair and
// stream_waits_per_pair; same_block_reused (fraction of iterations that got the previous block
// back: about 1 for streamsafe since the allocation whose free block would be split asks whether
// the pending block is done, one event query, as PyTorch's allocator; the batches of pending
// blocks still need one query each). The target: record_stream + free at most 1 us.
#ifndef STREAMSAFE_BENCH_SIM
#include "allocators.hpp"

namespace streamsafe_bench {
namespace {

inline constexpr std::size_t k_cross_stream_bytes = 64 << 10;

template <class A, class Body>
void cross_stream(benchmark::State& state, Body body) {
  A* a = get_or_skip<A>(state);
  if (a == nullptr) return;
  try {
    const auto s_alloc = A::stream(stream_role::main);
    const auto s_use = A::stream(stream_role::other);
    void* previous = body(*a, s_alloc, s_use);
    A::synchronize(s_use);
    A::synchronize(s_alloc);
    std::size_t reused = 0;
    const std::int64_t events_before = a->events_recorded();
    const std::int64_t waits_before = a->stream_waits();
    loop_clock clock;
    clock.start();
    for (auto _ : state) {
      void* p = body(*a, s_alloc, s_use);
      reused += p == previous ? 1 : 0;
      previous = p;
    }
    clock.stop();
    const auto pairs = static_cast<double>(state.iterations());
    set_rate_counters(state, clock, "ns_per_pair");
    state.counters["same_block_reused"] = pairs > 0 ? static_cast<double>(reused) / pairs : 0.0;
    set_event_counters(state, *a, events_before, waits_before, pairs);
    A::synchronize(s_use);
    A::synchronize(s_alloc);
  } catch (const std::exception& e) {
    skip_with(state, A::name(), e);
  }
}

template <class A>
void record_stream_free(benchmark::State& state, tag<A>) {
  cross_stream<A>(state, [](A& a, cudaStream_t s_alloc, cudaStream_t s_use) {
    void* p = a.allocate_owned(k_cross_stream_bytes, s_alloc);
    a.record_stream(p, s_alloc, s_use);
    a.deallocate_owned(p, s_alloc);
    return p;
  });
}

template <class A>
void free_on_other_stream(benchmark::State& state, tag<A>) {
  cross_stream<A>(state, [](A& a, cudaStream_t s_alloc, cudaStream_t s_use) {
    void* p = a.allocate_owned(k_cross_stream_bytes, s_alloc);
    a.deallocate_on(p, s_alloc, s_use);
    return p;
  });
}

void cross_stream_args(benchmark::internal::Benchmark* b) { b->UseRealTime(); }

BENCHMARK_CAPTURE(record_stream_free, streamsafe_cuda_malloc, tag<streamsafe_cuda_malloc>{})
    ->Apply(cross_stream_args);
BENCHMARK_CAPTURE(record_stream_free, streamsafe_expandable, tag<streamsafe_expandable>{})
    ->Apply(cross_stream_args);
BENCHMARK_CAPTURE(record_stream_free, cuda_malloc, tag<cuda_malloc_adapter>{})
    ->Apply(cross_stream_args);
BENCHMARK_CAPTURE(record_stream_free, cuda_malloc_async, tag<cuda_malloc_async_adapter>{})
    ->Apply(cross_stream_args);
BENCHMARK_CAPTURE(record_stream_free, cub, tag<cub_adapter>{})->Apply(cross_stream_args);
#if STREAMSAFE_BENCH_HAVE_C10
BENCHMARK_CAPTURE(record_stream_free, pytorch_c10, tag<pytorch_c10_adapter>{})
    ->Apply(cross_stream_args);
#endif

BENCHMARK_CAPTURE(free_on_other_stream, streamsafe_cuda_malloc, tag<streamsafe_cuda_malloc>{})
    ->Apply(cross_stream_args);
BENCHMARK_CAPTURE(free_on_other_stream, streamsafe_expandable, tag<streamsafe_expandable>{})
    ->Apply(cross_stream_args);
BENCHMARK_CAPTURE(free_on_other_stream, cuda_malloc, tag<cuda_malloc_adapter>{})
    ->Apply(cross_stream_args);
BENCHMARK_CAPTURE(free_on_other_stream, cuda_malloc_async, tag<cuda_malloc_async_adapter>{})
    ->Apply(cross_stream_args);
BENCHMARK_CAPTURE(free_on_other_stream, cub, tag<cub_adapter>{})->Apply(cross_stream_args);
#if STREAMSAFE_BENCH_HAVE_C10
BENCHMARK_CAPTURE(free_on_other_stream, pytorch_c10, tag<pytorch_c10_adapter>{})
    ->Apply(cross_stream_args);
#endif

}  // namespace
}  // namespace streamsafe_bench
#endif  // STREAMSAFE_BENCH_SIM
