// cub example: CUB's device algorithms with their temporary storage from streamsafe.
//
// The same templated workload runs with cub::CachingDeviceAllocator and with
// streamsafe::cuda::cub_allocator (switching is a change of type), then Thrust and a
// cuda::mr::async_resource_ref take their memory from streamsafe::cuda::memory_resource:
//   1. cub::DeviceReduce::Sum and cub::DeviceRadixSort::SortKeys, input, output and temporary
//      storage allocated through the allocator and freed after each iteration, on two streams;
//   2. thrust::sort with thrust::cuda::par_nosync(streamsafe thrust_allocator).on(stream);
//   3. an allocation through cuda::mr::async_resource_ref<cuda::mr::device_accessible>.
// Every result is checked against the host. Prints the time per iteration of each allocator.
//   cub_example [--items N] [--iterations N]
// Exit status 0 when every check passed, 1 otherwise (2: no GPU).
#include <streamsafe/frontends/cub_allocator.hpp>
#include <streamsafe/frontends/memory_resource.hpp>

#include <thrust/device_ptr.h>
#include <thrust/execution_policy.h>
#include <thrust/sort.h>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_reduce.cuh>
#include <cub/util_allocator.cuh>

#include <cuda/memory_resource>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

int failures = 0;

#define CHECK(cond)                                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "CHECK failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                                     \
    }                                                                                 \
  } while (0)

#define CUDA_OK(call)                                                      \
  do {                                                                     \
    const cudaError_t e_ = (call);                                         \
    if (e_ != cudaSuccess) {                                               \
      std::fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #call, \
                   cudaGetErrorString(e_));                                \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

struct workload {
  std::vector<std::uint32_t> keys;
  std::vector<std::uint32_t> sorted;
  unsigned long long sum = 0;
};

workload make_workload(std::size_t items) {
  workload w;
  std::mt19937 rng(42);
  w.keys.resize(items);
  for (auto& k : w.keys) k = static_cast<std::uint32_t>(rng());
  w.sorted = w.keys;
  std::sort(w.sorted.begin(), w.sorted.end());
  for (auto k : w.keys) w.sum += k;
  return w;
}

// One iteration on `stream`: everything through `alloc`, which has CUB's interface.
template <class Allocator>
void iteration(Allocator& alloc, const workload& w, cudaStream_t stream, bool check) {
  const std::size_t n = w.keys.size();
  std::uint32_t *d_keys = nullptr, *d_sorted = nullptr;
  unsigned long long *d_values = nullptr, *d_sum = nullptr;
  CUDA_OK(
      alloc.DeviceAllocate(reinterpret_cast<void**>(&d_keys), n * sizeof(std::uint32_t), stream));
  CUDA_OK(
      alloc.DeviceAllocate(reinterpret_cast<void**>(&d_sorted), n * sizeof(std::uint32_t), stream));
  CUDA_OK(alloc.DeviceAllocate(reinterpret_cast<void**>(&d_values), n * sizeof(unsigned long long),
                               stream));
  CUDA_OK(
      alloc.DeviceAllocate(reinterpret_cast<void**>(&d_sum), sizeof(unsigned long long), stream));
  CUDA_OK(cudaMemcpyAsync(d_keys, w.keys.data(), n * sizeof(std::uint32_t), cudaMemcpyHostToDevice,
                          stream));

  // Sum (as 64-bit values, to avoid wrap-around).
  thrust::device_ptr<std::uint32_t> keys_ptr(d_keys);
  thrust::device_ptr<unsigned long long> values_ptr(d_values);
  thrust::copy(thrust::cuda::par_nosync.on(stream), keys_ptr, keys_ptr + n, values_ptr);
  std::size_t temp_bytes = 0;
  CUDA_OK(
      cub::DeviceReduce::Sum(nullptr, temp_bytes, d_values, d_sum, static_cast<int>(n), stream));
  void* temp = nullptr;
  CUDA_OK(alloc.DeviceAllocate(&temp, temp_bytes, stream));
  CUDA_OK(cub::DeviceReduce::Sum(temp, temp_bytes, d_values, d_sum, static_cast<int>(n), stream));
  CUDA_OK(alloc.DeviceFree(temp));

  // Sort.
  temp_bytes = 0;
  CUDA_OK(cub::DeviceRadixSort::SortKeys(nullptr, temp_bytes, d_keys, d_sorted, static_cast<int>(n),
                                         0, 32, stream));
  CUDA_OK(alloc.DeviceAllocate(&temp, temp_bytes, stream));
  CUDA_OK(cub::DeviceRadixSort::SortKeys(temp, temp_bytes, d_keys, d_sorted, static_cast<int>(n), 0,
                                         32, stream));
  CUDA_OK(alloc.DeviceFree(temp));

  if (check) {
    unsigned long long sum = 0;
    std::vector<std::uint32_t> sorted(n);
    CUDA_OK(cudaMemcpyAsync(&sum, d_sum, sizeof sum, cudaMemcpyDeviceToHost, stream));
    CUDA_OK(cudaMemcpyAsync(sorted.data(), d_sorted, n * sizeof(std::uint32_t),
                            cudaMemcpyDeviceToHost, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    CHECK(sum == w.sum);
    CHECK(sorted == w.sorted);
  }
  CUDA_OK(alloc.DeviceFree(d_keys));
  CUDA_OK(alloc.DeviceFree(d_sorted));
  CUDA_OK(alloc.DeviceFree(d_values));
  CUDA_OK(alloc.DeviceFree(d_sum));
}

// Runs `iterations` iterations alternating between two streams; returns microseconds per
// iteration (host time including the final synchronisation).
template <class Allocator>
double run(const char* name, Allocator& alloc, const workload& w, int iterations, cudaStream_t s1,
           cudaStream_t s2) {
  iteration(alloc, w, s1, true);  // warm-up and check
  iteration(alloc, w, s2, true);
  CUDA_OK(cudaDeviceSynchronize());
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) iteration(alloc, w, i % 2 ? s2 : s1, i + 1 == iterations);
  CUDA_OK(cudaDeviceSynchronize());
  const double us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() /
      iterations;
  std::printf("  %-34s %9.1f us per iteration\n", name, us);
  return us;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t items = std::size_t{1} << 20;
  int iterations = 200;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--items")) items = std::strtoull(argv[i + 1], nullptr, 10);
    else if (!std::strcmp(argv[i], "--iterations")) iterations = std::atoi(argv[i + 1]);
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("cub example: no GPU present, nothing to run\n");
    return 2;
  }
  const workload w = make_workload(items);
  cudaStream_t s1, s2;
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  std::printf("cub example: %zu keys, %d iterations, two streams\n", items, iterations);

  {
    cub::CachingDeviceAllocator cub_alloc;  // CUB's defaults (6 MiB cache, 2 MiB largest bin)
    run("cub::CachingDeviceAllocator", cub_alloc, w, iterations, s1, s2);
  }
  {
    cub::CachingDeviceAllocator cub_alloc(2, 6, 30, cub::CachingDeviceAllocator::INVALID_SIZE);
    run("cub::CachingDeviceAllocator (bins)", cub_alloc, w, iterations, s1, s2);
  }
  {
    streamsafe::cuda::cub_allocator ss_alloc;  // the only change: the type
    run("streamsafe::cuda::cub_allocator", ss_alloc, w, iterations, s1, s2);
    const auto st = streamsafe::cuda::allocator::instance().stats(0);
    std::printf(
        "    streamsafe: %llu driver allocations, %llu events, %llu stream waits, peak reserved "
        "%.1f MiB\n",
        static_cast<unsigned long long>(st.num_device_alloc),
        static_cast<unsigned long long>(st.events_recorded),
        static_cast<unsigned long long>(st.stream_waits), st.reserved_bytes.peak / 1048576.0);
  }

  // Thrust: temporary storage of thrust::sort from streamsafe, stream-ordered on s1.
  {
    streamsafe::cuda::memory_resource mr;
    streamsafe::cuda::thrust_allocator<char> alloc(mr, s1);
    std::uint32_t* d = static_cast<std::uint32_t*>(
        mr.allocate_async(items * sizeof(std::uint32_t), 256, s1));
    CUDA_OK(cudaMemcpyAsync(d, w.keys.data(), items * sizeof(std::uint32_t), cudaMemcpyHostToDevice,
                            s1));
    thrust::device_ptr<std::uint32_t> p(d);
    thrust::sort(thrust::cuda::par_nosync(alloc).on(s1), p, p + items);
    std::vector<std::uint32_t> sorted(items);
    CUDA_OK(cudaMemcpyAsync(sorted.data(), d, items * sizeof(std::uint32_t), cudaMemcpyDeviceToHost,
                            s1));
    CUDA_OK(cudaStreamSynchronize(s1));
    CHECK(sorted == w.sorted);
    mr.deallocate_async(d, items * sizeof(std::uint32_t), 256, s1);
    std::printf("  thrust::sort with streamsafe temporary storage: %s\n",
                sorted == w.sorted ? "sorted" : "WRONG");
  }

  // cuda::mr: a type-erased async resource reference, as CCCL APIs take it.
  {
    streamsafe::cuda::memory_resource mr;
    cuda::mr::async_resource_ref<cuda::mr::device_accessible> ref{mr};
    void* p = ref.allocate_async(1 << 20, 256, cuda::stream_ref{s2});
    CUDA_OK(cudaMemsetAsync(p, 0x7F, 1 << 20, s2));
    unsigned char byte = 0;
    CUDA_OK(cudaMemcpyAsync(&byte, static_cast<char*>(p) + 12345, 1, cudaMemcpyDeviceToHost, s2));
    CUDA_OK(cudaStreamSynchronize(s2));
    CHECK(byte == 0x7F);
    ref.deallocate_async(p, 1 << 20, 256, cuda::stream_ref{s2});
    std::printf("  cuda::mr::async_resource_ref allocation: %s\n", byte == 0x7F ? "ok" : "WRONG");
  }

  streamsafe::cuda::allocator::instance().notify_stream_destroyed(s1);
  streamsafe::cuda::allocator::instance().notify_stream_destroyed(s2);
  CUDA_OK(cudaStreamDestroy(s1));
  CUDA_OK(cudaStreamDestroy(s2));
  std::printf(failures == 0 ? "cub example: all checks passed\n" : "cub example: checks FAILED\n");
  return failures == 0 ? 0 : 1;
}
