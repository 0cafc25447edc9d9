// streamsafe benchmarks: what every scenario shares, with no CUDA header (the simulated-device
// suite includes it too).
//
//  * tag<A>: passes an allocator adapter type through BENCHMARK_CAPTURE, which needs a plain
//    identifier for the benchmark function: `BENCHMARK_CAPTURE(same_stream_pair, cub,
//    tag<cub_adapter>{})` calls the function template same_stream_pair(state, tag<cub_adapter>).
//  * stream roles: which stream of an environment's pool a scenario uses (allocators see the
//    same stream handles in every scenario, so per-stream pools stay warm).
//  * the random operation table of scenario 2 (fixed seed: every allocator replays exactly the
//    same sizes and the same choices).
//  * counters: ns_per_pair / ns_per_op and Mpairs_per_s from a steady clock around the timed loop,
//    and the per-pair event and stream-wait counts, which bench/plot.py reads back.
//
// The adapter shape (bench/allocators.hpp for the GPU, bench/sim_allocators.hpp for the simulated
// device), which every scenario body is written against:
//   using stream_type = ...;                         cudaStream_t or streamsafe::stream_handle
//   static const char* name();
//   static stream_type stream(stream_role role, int index = 0);
//   static void synchronize(stream_type s);          waits for the stream (cudaStreamSynchronize)
//   static A& get();                                 process-wide instance, created on first use
//                                                    (throws std::exception when unavailable)
//   void* allocate(std::size_t bytes, stream_type s);
//   void deallocate(void* p, stream_type s);         last use on s, the allocation stream
//   std::int64_t events_recorded() const;            events the allocator recorded (-1: unknown)
//   std::int64_t stream_waits() const;               stream waits it issued (-1: unknown)
//   void release_cached();                           empty_cache or its equivalent
//   void reset_peak_reserved();
//   std::int64_t peak_reserved_bytes();              since reset_peak_reserved (-1: unknown)
//   std::int64_t reserved_bytes();                   now (-1: unknown)
#pragma once

#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <random>
#include <string>
#include <vector>

namespace streamsafe_bench {

template <class A>
struct tag {
  using type = A;
};

// The streams a scenario uses. Every environment keeps one pool of streams, created on first use
// and never destroyed (an allocator keeps per-stream state; destroying a stream it has seen would
// need notify_stream_destroyed).
enum class stream_role {
  main,       // scenarios 1, 2, 4 (allocation stream), 5 (allocation stream), 6
  thread,     // scenario 3: one per benchmark thread (index = thread index)
  shared,     // scenario 3: the one stream all threads share
  other,      // scenario 4: the stream of the cross-stream use / the stream-ordered free
  unrelated,  // scenario 5: runs the unrelated kernel; never given to an allocator
};

inline constexpr int k_max_threads = 64;

// Pool slot of a role (thread streams take slots 1..k_max_threads).
inline int stream_slot(stream_role role, int index) {
  switch (role) {
    case stream_role::main: return 0;
    case stream_role::thread: return 1 + (index % k_max_threads);
    case stream_role::shared: return k_max_threads + 1;
    case stream_role::other: return k_max_threads + 2;
    case stream_role::unrelated: return k_max_threads + 3;
  }
  return 0;
}
inline constexpr int k_stream_slots = k_max_threads + 4;

// ---- scenario 2: random allocations (RMM's random_allocations style) -------------------------

struct random_op {
  std::uint32_t size_bytes;  // log-uniform in [256 B, 1 MiB]
  std::uint32_t pick;        // which live allocation to free: pick % live
  bool allocate;             // coin flip; the live count is kept in [0.9 N, 1.1 N]
};

inline constexpr std::size_t k_random_ops = std::size_t{1} << 16;  // a power of two (cycled)
inline constexpr double k_random_min_bytes = 256.0;
inline constexpr double k_random_max_bytes = 1024.0 * 1024.0;

inline const std::vector<random_op>& random_ops() {
  static const std::vector<random_op> ops = [] {
    std::vector<random_op> v(k_random_ops);
    std::mt19937_64 rng(20240611);
    std::uniform_real_distribution<double> log_size(std::log(k_random_min_bytes),
                                                    std::log(k_random_max_bytes));
    std::uniform_int_distribution<std::uint32_t> pick;
    std::bernoulli_distribution coin(0.5);
    for (random_op& op : v) {
      op.size_bytes = static_cast<std::uint32_t>(std::exp(log_size(rng)));
      op.pick = pick(rng);
      op.allocate = coin(rng);
    }
    return v;
  }();
  return ops;
}

// ---- counters ---------------------------------------------------------------------------------

// Host wall-clock of a timed loop, read around `for (auto _ : state)`, for counters that Google
// Benchmark's rate counters would print with misleading units.
class loop_clock {
 public:
  void start() { t0_ = std::chrono::steady_clock::now(); }
  void stop() { t1_ = std::chrono::steady_clock::now(); }
  double ns() const { return std::chrono::duration<double, std::nano>(t1_ - t0_).count(); }

 private:
  std::chrono::steady_clock::time_point t0_{}, t1_{};
};

// ns_per_<what> (this thread's wall-clock per item; averaged over threads) and Mpairs_per_s
// (million items per second; summed over threads, so the total throughput).
inline void set_rate_counters(benchmark::State& state, const loop_clock& clock, const char* ns_name,
                              bool throughput = true) {
  const auto items = static_cast<double>(state.iterations());
  const double ns = clock.ns();
  if (items <= 0 || ns <= 0) return;
  state.counters[ns_name] = benchmark::Counter(ns / items, benchmark::Counter::kAvgThreads);
  if (throughput) state.counters["Mpairs_per_s"] = items / ns * 1e3;
}

// Sets per-iteration averages of the allocator's event records and stream waits since the given
// starting values, when the allocator reports them.
template <class A>
void set_event_counters(benchmark::State& state, const A& a, std::int64_t events_before,
                        std::int64_t waits_before, double pairs) {
  if (pairs <= 0) return;
  const std::int64_t events = a.events_recorded();
  if (events >= 0 && events_before >= 0) {
    state.counters["events_per_pair"] = static_cast<double>(events - events_before) / pairs;
  }
  const std::int64_t waits = a.stream_waits();
  if (waits >= 0 && waits_before >= 0) {
    state.counters["stream_waits_per_pair"] = static_cast<double>(waits - waits_before) / pairs;
  }
}

// The adapter's process-wide instance, or nullptr after SkipWithError naming why it is missing.
template <class A>
A* get_or_skip(benchmark::State& state) {
  try {
    return &A::get();
  } catch (const std::exception& e) {
    const std::string message = std::string(A::name()) + " unavailable: " + e.what();
    state.SkipWithError(message.c_str());
  }
  return nullptr;
}

inline void skip_with(benchmark::State& state, const char* what, const std::exception& e) {
  const std::string message = std::string(what) + ": " + e.what();
  state.SkipWithError(message.c_str());
}

inline constexpr double k_mib = 1024.0 * 1024.0;
inline constexpr double k_gib = 1024.0 * 1024.0 * 1024.0;

}  // namespace streamsafe_bench
