// Scenario 6: replay of a PyTorch allocator trace (GPT-2 124 M, fused AdamW, 12 steps, one
// stream: ../shared/traces/gpt2_fixed_adamw.csv.gz; see trace.hpp for how the file is found).
//
// Only the program's own requests are replayed (alloc, free_requested), all on one stream, with
// no kernels. Per benchmark run:
//   1. cold replay (untimed by Google Benchmark, timed by a steady clock): the allocator's cache is
//      emptied and its peak statistics reset, then the whole trace runs once. Counters:
//      cold_ns_per_event (includes the driver calls that grow the cache), peak_reserved_GiB,
//      peak_allocated_GiB (from the trace itself: live requests rounded to 512 B) and
//      reserved_over_allocated (peak reserved / peak allocated; PyTorch reached 1.079 by default
//      and 1.005 with expandable segments on this run). Allocators that keep no peak statistic
//      (cub) get an extra untimed replay that reads their reserved bytes after every event.
//   2. timed loop: warm replays of the whole trace (blocks still live at the end of the trace are
//      freed with the timer paused). real_time is per replay; ns_per_event is the host time per
//      trace event, from a steady clock around each replay (the paused part excluded).
// cuda_malloc keeps no cache, so reserved equals allocated up to the driver's own rounding, which
// it does not report: it gets no ratio.
#ifdef STREAMSAFE_BENCH_SIM
#include "sim_allocators.hpp"
#else
#include "allocators.hpp"
#endif

#include "trace.hpp"

#include <algorithm>
#include <chrono>
#include <vector>

namespace streamsafe_bench {
namespace {

template <class A>
void replay_once(A& a, const trace& t, std::vector<void*>& slots, typename A::stream_type s) {
  for (const trace_op& op : t.ops) {
    if (op.allocate) {
      slots[op.slot] = a.allocate(op.size_bytes, s);
    } else {
      a.deallocate(slots[op.slot], s);
      slots[op.slot] = nullptr;
    }
  }
}

template <class A>
void free_leftovers(A& a, std::vector<void*>& slots, typename A::stream_type s) {
  for (void*& p : slots) {
    if (p != nullptr) {
      a.deallocate(p, s);
      p = nullptr;
    }
  }
}

template <class A>
void replay(benchmark::State& state, tag<A>) {
  const trace& t = load_trace();
  if (!t.ok()) {
    state.SkipWithError(t.error.c_str());
    return;
  }
  A* a = get_or_skip<A>(state);
  if (a == nullptr) return;
  std::vector<void*> slots(t.slots, nullptr);
  const auto s = A::stream(stream_role::main);
  const auto events = static_cast<double>(t.ops.size());
  try {
    // 1. cold replay: ratio and cold time.
    A::synchronize(s);
    a->release_cached();
    a->reset_peak_reserved();
    const auto t0 = std::chrono::steady_clock::now();
    replay_once(*a, t, slots, s);
    const auto t1 = std::chrono::steady_clock::now();
    std::int64_t peak_reserved = a->peak_reserved_bytes();
    free_leftovers(*a, slots, s);
    state.counters["cold_ns_per_event"] =
        std::chrono::duration<double, std::nano>(t1 - t0).count() / events;
    if (peak_reserved < 0 && a->reserved_bytes() >= 0) {
      A::synchronize(s);
      a->release_cached();
      for (const trace_op& op : t.ops) {
        if (op.allocate) {
          slots[op.slot] = a->allocate(op.size_bytes, s);
        } else {
          a->deallocate(slots[op.slot], s);
          slots[op.slot] = nullptr;
        }
        peak_reserved = std::max(peak_reserved, a->reserved_bytes());
      }
      free_leftovers(*a, slots, s);
    }
    if (peak_reserved > 0) {
      state.counters["peak_reserved_GiB"] = static_cast<double>(peak_reserved) / k_gib;
      state.counters["peak_allocated_GiB"] = static_cast<double>(t.peak_allocated_bytes) / k_gib;
      state.counters["reserved_over_allocated"] = static_cast<double>(peak_reserved) /
                                                  static_cast<double>(t.peak_allocated_bytes);
    }

    // 2. warm replays, timed.
    double replay_ns = 0;
    for (auto _ : state) {
      const auto r0 = std::chrono::steady_clock::now();
      replay_once(*a, t, slots, s);
      const auto r1 = std::chrono::steady_clock::now();
      replay_ns += std::chrono::duration<double, std::nano>(r1 - r0).count();
      state.PauseTiming();
      free_leftovers(*a, slots, s);
      state.ResumeTiming();
    }
    const auto replays = static_cast<double>(state.iterations());
    if (replays > 0) state.counters["ns_per_event"] = replay_ns / (replays * events);
    state.counters["events"] = events;
    A::synchronize(s);
    a->release_cached();  // leave the device's memory to the next allocator
  } catch (const std::exception& e) {
    skip_with(state, A::name(), e);
    try {
      free_leftovers(*a, slots, s);
      A::synchronize(s);
      a->release_cached();
    } catch (const std::exception&) {
    }
  }
}

void replay_args(benchmark::internal::Benchmark* b) {
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

#ifdef STREAMSAFE_BENCH_SIM
BENCHMARK_CAPTURE(replay, sim_streamsafe_cuda_malloc, tag<sim_streamsafe_cuda_malloc>{})
    ->Apply(replay_args);
BENCHMARK_CAPTURE(replay, sim_streamsafe_expandable, tag<sim_streamsafe_expandable>{})
    ->Apply(replay_args);
#else
BENCHMARK_CAPTURE(replay, streamsafe_cuda_malloc, tag<streamsafe_cuda_malloc>{})
    ->Apply(replay_args);
BENCHMARK_CAPTURE(replay, streamsafe_expandable, tag<streamsafe_expandable>{})->Apply(replay_args);
// cudaMalloc: ~13,000 driver allocations per replay (seconds); one timed replay is enough.
BENCHMARK_CAPTURE(replay, cuda_malloc, tag<cuda_malloc_adapter>{})
    ->Apply(replay_args)
    ->Iterations(1);
BENCHMARK_CAPTURE(replay, cuda_malloc_async, tag<cuda_malloc_async_adapter>{})->Apply(replay_args);
BENCHMARK_CAPTURE(replay, cub, tag<cub_adapter>{})->Apply(replay_args);
#if STREAMSAFE_BENCH_HAVE_C10
BENCHMARK_CAPTURE(replay, pytorch_c10, tag<pytorch_c10_adapter>{})->Apply(replay_args);
#endif
#endif

}  // namespace
}  // namespace streamsafe_bench
