// Scenario 0 (GPU suite only): the CUDA runtime calls that any stream-aware allocator's
// cross-stream path is made of, timed alone, so that scenario 4's figures can be read against
// the floor that no allocator can go under.
//
//  driver_floor/get_device             cudaGetDevice (what a device guard costs when the device
//                                      is already current)
//  driver_floor/event_record           cudaEventRecord on an idle stream
//  driver_floor/event_record_query     cudaEventRecord on stream B, then cudaEventQuery (what
//                                      record_stream + free + a later allocation's check costs)
//  driver_floor/event_record_wait      cudaEventRecord on stream B, then cudaStreamWaitEvent on
//                                      stream A (the hand-written pattern, and streamsafe's reuse
//                                      of a block whose other-stream use is still pending)
//  driver_floor/event_query_done       cudaEventQuery of an event that completed long ago
//  driver_floor/cu_*                   the same through the driver API (cuEventRecord,
//                                      cuEventQuery, cuStreamWaitEvent)
// No kernel runs. Time: host wall-clock per call or pair (real_time), counter ns_per_pair.
#ifndef STREAMSAFE_BENCH_SIM
#include "allocators.hpp"

#include <stdexcept>
#include <string>
#include <utility>

namespace streamsafe_bench {
namespace {

template <class Body>
void driver_floor(benchmark::State& state, Body body) {
  try {
    gpu_env::require();
    const cudaStream_t a = gpu_env::stream(stream_role::main);
    const cudaStream_t b = gpu_env::stream(stream_role::other);
    cudaEvent_t event = nullptr;
    STREAMSAFE_BENCH_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    STREAMSAFE_BENCH_CUDA(cudaEventRecord(event, b));
    STREAMSAFE_BENCH_CUDA(cudaEventSynchronize(event));
    loop_clock clock;
    clock.start();
    for (auto _ : state) body(a, b, event);
    clock.stop();
    set_rate_counters(state, clock, "ns_per_pair");
    gpu_env::synchronize(a);
    gpu_env::synchronize(b);
    (void)cudaGetLastError();  // cudaEventQuery's "not ready" must not leak into the next benchmark
    STREAMSAFE_BENCH_CUDA(cudaEventDestroy(event));
  } catch (const std::exception& e) {
    skip_with(state, "driver_floor", e);
  }
}

void get_device(benchmark::State& state) {
  driver_floor(state, [](cudaStream_t, cudaStream_t, cudaEvent_t) {
    int device = -1;
    benchmark::DoNotOptimize(cudaGetDevice(&device));
  });
}

void event_record(benchmark::State& state) {
  driver_floor(state, [](cudaStream_t, cudaStream_t b, cudaEvent_t e) {
    benchmark::DoNotOptimize(cudaEventRecord(e, b));
  });
}

void event_record_query(benchmark::State& state) {
  driver_floor(state, [](cudaStream_t, cudaStream_t b, cudaEvent_t e) {
    benchmark::DoNotOptimize(cudaEventRecord(e, b));
    benchmark::DoNotOptimize(cudaEventQuery(e));
  });
}

void event_record_wait(benchmark::State& state) {
  driver_floor(state, [](cudaStream_t a, cudaStream_t b, cudaEvent_t e) {
    benchmark::DoNotOptimize(cudaEventRecord(e, b));
    benchmark::DoNotOptimize(cudaStreamWaitEvent(a, e, 0));
  });
}

// The same calls through the driver API (entry points from the runtime, no libcuda link).
struct driver_calls {
  using record_fn = int (*)(cudaEvent_t, cudaStream_t);
  using query_fn = int (*)(cudaEvent_t);
  using wait_fn = int (*)(cudaStream_t, cudaEvent_t, unsigned int);
  record_fn record = nullptr;
  query_fn query = nullptr;
  wait_fn wait = nullptr;

  static const driver_calls& get() {
    static const driver_calls calls = [] {
      driver_calls c;
      c.record = reinterpret_cast<record_fn>(entry("cuEventRecord"));
      c.query = reinterpret_cast<query_fn>(entry("cuEventQuery"));
      c.wait = reinterpret_cast<wait_fn>(entry("cuStreamWaitEvent"));
      return c;
    }();
    return calls;
  }
  static void* entry(const char* name) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    STREAMSAFE_BENCH_CUDA(
        cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess)
      throw std::runtime_error(std::string(name) + " not found");
    return fn;
  }
};

void cu_event_record_query(benchmark::State& state) {
  const driver_calls& cu = driver_calls::get();
  driver_floor(state, [&cu](cudaStream_t, cudaStream_t b, cudaEvent_t e) {
    benchmark::DoNotOptimize(cu.record(e, b));
    benchmark::DoNotOptimize(cu.query(e));
  });
}

void cu_event_record_wait(benchmark::State& state) {
  const driver_calls& cu = driver_calls::get();
  driver_floor(state, [&cu](cudaStream_t a, cudaStream_t b, cudaEvent_t e) {
    benchmark::DoNotOptimize(cu.record(e, b));
    benchmark::DoNotOptimize(cu.wait(a, e, 0));
  });
}

void cu_event_query_done(benchmark::State& state) {
  const driver_calls& cu = driver_calls::get();
  driver_floor(state, [&cu](cudaStream_t, cudaStream_t, cudaEvent_t e) {
    benchmark::DoNotOptimize(cu.query(e));
  });
}

void event_query_done(benchmark::State& state) {
  driver_floor(state, [](cudaStream_t, cudaStream_t, cudaEvent_t e) {
    benchmark::DoNotOptimize(cudaEventQuery(e));
  });
}

const bool registered = [] {
  const std::pair<const char*, void (*)(benchmark::State&)> floors[] = {
      {"driver_floor/get_device", get_device},
      {"driver_floor/event_record", event_record},
      {"driver_floor/event_record_query", event_record_query},
      {"driver_floor/event_record_wait", event_record_wait},
      {"driver_floor/event_query_done", event_query_done},
      {"driver_floor/cu_event_record_query", cu_event_record_query},
      {"driver_floor/cu_event_record_wait", cu_event_record_wait},
      {"driver_floor/cu_event_query_done", cu_event_query_done},
  };
  for (const auto& [name, fn] : floors) benchmark::RegisterBenchmark(name, fn)->UseRealTime();
  return true;
}();
}  // namespace
}  // namespace streamsafe_bench
#endif  // STREAMSAFE_BENCH_SIM
