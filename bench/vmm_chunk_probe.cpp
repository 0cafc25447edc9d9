// vmm_chunk_probe: what the CUDA driver's virtual memory calls cost per chunk, by chunk size.
//
// The reference for expandable_chunk_mb and expandable_peak_chunk_mb (docs/observability.md,
// "Finer chunks"): for chunks of 2, 8 and 20 MiB it maps 2 GiB (cuMemCreate, cuMemMap,
// cuMemSetAccess per chunk), writes it, unmaps it (cuMemUnmap, cuMemRelease per chunk), three
// rounds each, and prints each call's mean host time per chunk and the total per GiB. A second
// variant sets access and unmaps with one call over all the chunks (as far as the driver takes
// one: it refuses a range that is not wholly mapped) to show whether the driver's cost is per
// call or per mapping. No allocator. Needs a GPU; GPU suite only.
#include <cuda.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

void check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* text = nullptr;
  cuGetErrorString(r, &text);
  std::fprintf(stderr, "vmm_chunk_probe: %s failed: %s\n", what, text ? text : "?");
  std::exit(1);
}

double micros(clock_type::time_point a, clock_type::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

}  // namespace

int main() {
  check(cuInit(0), "cuInit");
  CUdevice dev = 0;
  check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  CUcontext ctx = nullptr;
  check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  std::size_t gran = 0;
  check(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity");
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  constexpr std::size_t k_total = std::size_t{2} << 30;
  CUdeviceptr base = 0;
  check(cuMemAddressReserve(&base, k_total, 0, 0, 0), "cuMemAddressReserve");
  std::printf("granularity %zu KiB; 2 GiB mapped, written and unmapped per round\n", gran >> 10);
  for (const std::size_t chunk : {gran, 4 * gran, 10 * gran}) {
    const std::size_t n = k_total / chunk;
    const std::size_t bytes = n * chunk;  // whole chunks only
    for (const bool one_call : {false, true}) {
      for (int round = 0; round < 3; ++round) {
        std::vector<CUmemGenericAllocationHandle> handles(n);
        const auto t0 = clock_type::now();
        for (auto& h : handles) check(cuMemCreate(&h, chunk, &prop, 0), "cuMemCreate");
        const auto t1 = clock_type::now();
        for (std::size_t i = 0; i < n; ++i)
          check(cuMemMap(base + i * chunk, chunk, 0, handles[i], 0), "cuMemMap");
        const auto t2 = clock_type::now();
        if (one_call) {
          check(cuMemSetAccess(base, bytes, &access, 1), "cuMemSetAccess (all chunks)");
        } else {
          for (std::size_t i = 0; i < n; ++i)
            check(cuMemSetAccess(base + i * chunk, chunk, &access, 1), "cuMemSetAccess");
        }
        const auto t3 = clock_type::now();
        check(cuMemsetD8(base, 1, bytes), "cuMemsetD8");
        check(cuCtxSynchronize(), "cuCtxSynchronize");
        const auto t4 = clock_type::now();
        if (one_call) {
          check(cuMemUnmap(base, bytes), "cuMemUnmap (all chunks)");
        } else {
          for (std::size_t i = 0; i < n; ++i)
            check(cuMemUnmap(base + i * chunk, chunk), "cuMemUnmap");
        }
        const auto t5 = clock_type::now();
        for (auto h : handles) check(cuMemRelease(h), "cuMemRelease");
        const auto t6 = clock_type::now();
        const double per = 1.0 / static_cast<double>(n);
        const double total_ms = micros(t0, t3) / 1000.0 + micros(t4, t6) / 1000.0;
        std::printf(
            "chunk %2zu MiB x %4zu, %s: per chunk create %5.1f map %4.1f set access %5.1f unmap "
            "%5.1f release %5.1f us; %5.1f ms per GiB mapped and unmapped\n",
            chunk >> 20, n, one_call ? "access+unmap in one call" : "a call per chunk        ",
            micros(t0, t1) * per, micros(t1, t2) * per, micros(t2, t3) * per, micros(t4, t5) * per,
            micros(t5, t6) * per,
            total_ms / (static_cast<double>(bytes) / static_cast<double>(std::size_t{1} << 30)));
      }
    }
  }
  check(cuMemAddressFree(base, k_total), "cuMemAddressFree");
  return 0;
}
