// The stream lock under a monitoring thread: scenarios 1 and 3 (same-stream 512 B pair; 4 KiB
// pairs, one thread per stream) while another thread calls stats() every millisecond, as a
// training loop's logger or a metrics exporter does. stats() takes every stream lock, so this
// is what a monitor costs the hot path. docs/benchmarks.md ("The stream lock") has the H200
// figures with which a lock biased toward the stream's thread was measured and dropped.
// Only streamsafe runs here: the baselines have no stream lock to compare.
// Time: host wall-clock per pair (real_time). Counter: ns_per_pair, stats_calls (the monitor's).
#ifdef STREAMSAFE_BENCH_SIM
#include "sim_allocators.hpp"
#else
#include "allocators.hpp"
#endif

#include <atomic>
#include <chrono>
#include <thread>

namespace streamsafe_bench {
namespace {

// Calls a->events_recorded() (one stats() call) every millisecond until stopped.
template <class A>
class stats_monitor {
 public:
  explicit stats_monitor(A* a)
      : thread_([this, a] {
          while (!stop_.load(std::memory_order_relaxed)) {
            benchmark::DoNotOptimize(a->events_recorded());
            calls_.fetch_add(1, std::memory_order_relaxed);
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
        }) {}
  ~stats_monitor() {
    stop_.store(true);
    thread_.join();
  }
  stats_monitor(const stats_monitor&) = delete;
  stats_monitor& operator=(const stats_monitor&) = delete;
  std::int64_t calls() const { return calls_.load(); }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<std::int64_t> calls_{0};
  std::thread thread_;
};

template <class A>
void monitored_pair(benchmark::State& state, tag<A>) {
  A* a = get_or_skip<A>(state);
  if (a == nullptr) return;
  constexpr std::size_t bytes = 512;
  try {
    const auto s = A::stream(stream_role::main);
    a->deallocate(a->allocate(bytes, s), s);
    stats_monitor<A> monitor(a);
    loop_clock clock;
    clock.start();
    for (auto _ : state) {
      void* p = a->allocate(bytes, s);
      benchmark::DoNotOptimize(static_cast<const void*>(p));
      a->deallocate(p, s);
    }
    clock.stop();
    set_rate_counters(state, clock, "ns_per_pair");
    state.counters["stats_calls"] = static_cast<double>(monitor.calls());
    A::synchronize(s);
  } catch (const std::exception& e) {
    skip_with(state, A::name(), e);
  }
}

// One monitor for all the threads of a run: thread 0 owns it (Google Benchmark runs the threads
// of one benchmark together, each calling this function).
template <class A>
void monitored_threads_own_stream(benchmark::State& state, tag<A>) {
  A* a = get_or_skip<A>(state);
  if (a == nullptr) return;
  constexpr std::size_t bytes = 4096;
  try {
    const auto s = A::stream(stream_role::thread, state.thread_index());
    a->deallocate(a->allocate(bytes, s), s);
    std::unique_ptr<stats_monitor<A>> monitor;
    if (state.thread_index() == 0) monitor = std::make_unique<stats_monitor<A>>(a);
    loop_clock clock;
    const benchmark::IterationCount n = state.max_iterations;
    while (state.KeepRunningBatch(n)) {
      clock.start();
      for (benchmark::IterationCount i = 0; i < n; ++i) {
        void* p = a->allocate(bytes, s);
        benchmark::DoNotOptimize(static_cast<const void*>(p));
        a->deallocate(p, s);
      }
      clock.stop();
    }
    state.SetItemsProcessed(state.iterations());
    set_rate_counters(state, clock, "ns_per_pair");
    if (monitor) state.counters["stats_calls"] = static_cast<double>(monitor->calls());
    A::synchronize(s);
  } catch (const std::exception& e) {
    skip_with(state, A::name(), e);
  }
}

void monitored_thread_counts(benchmark::internal::Benchmark* b) {
  b->Threads(1)->Threads(8)->UseRealTime();
}

#ifdef STREAMSAFE_BENCH_SIM
BENCHMARK_CAPTURE(monitored_pair, sim_streamsafe_expandable, tag<sim_streamsafe_expandable>{})
    ->UseRealTime();
BENCHMARK_CAPTURE(monitored_threads_own_stream, sim_streamsafe_expandable,
                  tag<sim_streamsafe_expandable>{})
    ->Apply(monitored_thread_counts);
#else
BENCHMARK_CAPTURE(monitored_pair, streamsafe_expandable, tag<streamsafe_expandable>{})
    ->UseRealTime();
BENCHMARK_CAPTURE(monitored_pair, streamsafe_cuda_malloc, tag<streamsafe_cuda_malloc>{})
    ->UseRealTime();
BENCHMARK_CAPTURE(monitored_threads_own_stream, streamsafe_expandable, tag<streamsafe_expandable>{})
    ->Apply(monitored_thread_counts);
#endif

}  // namespace
}  // namespace streamsafe_bench
