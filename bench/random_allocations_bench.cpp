// Scenario 2: random allocations in the style of RAPIDS RMM's random_allocations benchmark:
// random sizes and a random mix of allocate and free around N live allocations, N = 1,000 and
// N = 10,000, all on one stream.
//
// Before the timed loop N blocks are allocated (untimed). Each iteration is one operation from a
// fixed table (bench_common.hpp: 65,536 entries, fixed seed, cycled): an allocation of a size
// drawn log-uniformly from [256 B, 1 MiB], or the free of a randomly chosen live block; a coin
// decides, except that the live count is kept within [0.9 N, 1.1 N]. Every allocator sees the same
// sequence. Time: host wall-clock per operation (real_time, and counter ns_per_op). The target:
// the time per operation at 10,000 live within 2x of that at 1,000 live.
#ifdef STREAMSAFE_BENCH_SIM
#include "sim_allocators.hpp"
#else
#include "allocators.hpp"
#endif

#include <vector>

namespace streamsafe_bench {
namespace {

template <class A>
void random_allocations(benchmark::State& state, tag<A>) {
  A* a = get_or_skip<A>(state);
  if (a == nullptr) return;
  const auto live_target = static_cast<std::size_t>(state.range(0));
  const std::size_t low = live_target - live_target / 10;
  const std::size_t high = live_target + live_target / 10;
  const std::vector<random_op>& ops = random_ops();
  const std::size_t mask = ops.size() - 1;
  std::vector<void*> live;
  live.reserve(high + 1);
  const auto s = A::stream(stream_role::main);
  try {
    std::size_t k = 0;
    while (live.size() < live_target) live.push_back(a->allocate(ops[k++ & mask].size_bytes, s));
    std::size_t allocations = 0;
    const std::int64_t events_before = a->events_recorded();
    const std::int64_t waits_before = a->stream_waits();
    loop_clock clock;
    clock.start();
    for (auto _ : state) {
      const random_op& op = ops[k++ & mask];
      const bool allocate = live.size() <= low ? true : live.size() >= high ? false : op.allocate;
      if (allocate) {
        live.push_back(a->allocate(op.size_bytes, s));
        ++allocations;
      } else {
        const std::size_t victim = op.pick % live.size();
        a->deallocate(live[victim], s);
        live[victim] = live.back();
        live.pop_back();
      }
    }
    clock.stop();
    const auto n = static_cast<double>(state.iterations());
    set_rate_counters(state, clock, "ns_per_op", false);
    state.counters["alloc_fraction"] = n > 0 ? static_cast<double>(allocations) / n : 0.0;
    set_event_counters(state, *a, events_before, waits_before, n);
  } catch (const std::exception& e) {
    skip_with(state, A::name(), e);
  }
  try {
    for (void* p : live) a->deallocate(p, s);
    A::synchronize(s);
  } catch (const std::exception& e) {
    if (!state.error_occurred()) skip_with(state, A::name(), e);
  }
}

void live_counts(benchmark::internal::Benchmark* b) {
  b->ArgName("live")->Arg(1000)->Arg(10000)->UseRealTime();
}

#ifdef STREAMSAFE_BENCH_SIM
BENCHMARK_CAPTURE(random_allocations, sim_streamsafe_cuda_malloc, tag<sim_streamsafe_cuda_malloc>{})
    ->Apply(live_counts);
BENCHMARK_CAPTURE(random_allocations, sim_streamsafe_expandable, tag<sim_streamsafe_expandable>{})
    ->Apply(live_counts);
#else
BENCHMARK_CAPTURE(random_allocations, streamsafe_cuda_malloc, tag<streamsafe_cuda_malloc>{})
    ->Apply(live_counts);
BENCHMARK_CAPTURE(random_allocations, streamsafe_expandable, tag<streamsafe_expandable>{})
    ->Apply(live_counts);
// cudaMalloc costs ~80 us an operation and 10,000 live blocks take ~1 s to set up: a fixed count
// keeps it to one run instead of Google Benchmark's 4-5 runs of growing length.
BENCHMARK_CAPTURE(random_allocations, cuda_malloc, tag<cuda_malloc_adapter>{})
    ->Apply(live_counts)
    ->Iterations(2000);
BENCHMARK_CAPTURE(random_allocations, cuda_malloc_async, tag<cuda_malloc_async_adapter>{})
    ->Apply(live_counts);
BENCHMARK_CAPTURE(random_allocations, cub, tag<cub_adapter>{})->Apply(live_counts);
#if STREAMSAFE_BENCH_HAVE_C10
BENCHMARK_CAPTURE(random_allocations, pytorch_c10, tag<pytorch_c10_adapter>{})->Apply(live_counts);
#endif
#endif

}  // namespace
}  // namespace streamsafe_bench
