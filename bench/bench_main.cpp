// streamsafe benchmarks: main() of streamsafe_bench (GPU) and streamsafe_bench_sim (simulated
// device). Google Benchmark's own main, plus the machine in the output's context (the JSON's
// "context" object): which device, driver and runtime, which baselines were built, which trace.
#ifdef STREAMSAFE_BENCH_SIM
#include "sim_allocators.hpp"
#else
#include "allocators.hpp"
#endif

#include "trace.hpp"

#include <cstdio>
#include <string>

#ifndef STREAMSAFE_BENCH_VERSION
#define STREAMSAFE_BENCH_VERSION "unknown"
#endif
#ifndef STREAMSAFE_BENCH_BUILD_TYPE
#define STREAMSAFE_BENCH_BUILD_TYPE "unknown"
#endif

namespace {

void add_context() {
  benchmark::AddCustomContext("streamsafe_version", STREAMSAFE_BENCH_VERSION);
  benchmark::AddCustomContext("streamsafe_build_type", STREAMSAFE_BENCH_BUILD_TYPE);
  benchmark::AddCustomContext("trace", streamsafe_bench::detail::resolve_trace_path());
#ifdef STREAMSAFE_BENCH_SIM
  benchmark::AddCustomContext("streamsafe_suite",
                              "simulated device (bookkeeping only, no CUDA call)");
  benchmark::AddCustomContext("device",
                              "streamsafe::sim::simulated_device (80 GiB, 2 MiB granularity)");
#else
  benchmark::AddCustomContext("streamsafe_suite", "gpu");
#if STREAMSAFE_BENCH_HAVE_C10
  benchmark::AddCustomContext("pytorch", streamsafe_bench::c10_baseline::torch_version());
#else
  benchmark::AddCustomContext("pytorch", "not built (STREAMSAFE_BENCH_TORCH found no PyTorch)");
#endif
  benchmark::AddCustomContext("cub_version", std::to_string(CUB_VERSION));
  int runtime = 0, driver = 0;
  (void)cudaRuntimeGetVersion(&runtime);
  (void)cudaDriverGetVersion(&driver);
  benchmark::AddCustomContext("cuda_runtime", std::to_string(runtime));
  benchmark::AddCustomContext("cuda_driver", std::to_string(driver));
  if (streamsafe_bench::gpu_env::available()) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
      benchmark::AddCustomContext("device", prop.name);
      benchmark::AddCustomContext(
          "device_memory_GiB",
          std::to_string(static_cast<double>(prop.totalGlobalMem) / streamsafe_bench::k_gib));
      benchmark::AddCustomContext("device_sm",
                                  std::to_string(prop.major) + "." + std::to_string(prop.minor));
      benchmark::AddCustomContext("device_multiprocessors",
                                  std::to_string(prop.multiProcessorCount));
    }
  } else {
    (void)cudaGetLastError();
    benchmark::AddCustomContext("device", "none: every benchmark is skipped");
    std::fprintf(stderr,
                 "streamsafe_bench: no CUDA device here; every benchmark will be skipped "
                 "(run streamsafe_bench_sim for the simulated device)\n");
  }
#endif
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  add_context();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
