// loop: a plain CUDA C++ program (nothing of streamsafe in it) that allocates and frees device
// memory in a loop, built with the shared CUDA runtime (-cudart shared) so that
// libstreamsafe_preload.so can serve its cudaMalloc/cudaFree under LD_PRELOAD.
//
//   loop [--iterations N] [--streams S] [--async-every K]
//
// 1. The cudaFree contract: x is freed while a 100 ms kernel on another stream still reads it;
//    memory allocated right after and written at once on a second stream must not corrupt that
//    read (the real cudaFree synchronises; the interposer must not reuse x before the read ends).
// 2. The loop: iteration i takes a (uint32, n_i words) and b (uint64, n_i words) with cudaMalloc
//    (every K-th iteration with cudaMallocAsync on its stream), fills a, computes
//    b = 3a + i, adds sum(b) into a device checksum, and frees both at once, while the kernels
//    may still run, on S non-blocking streams in turn; n_i runs over 1 Ki .. 8 Mi words.
// Prints the checksum and the expected one (closed form on the host), the loop's time and the
// number of cudaMalloc calls (each a driver allocation without the interposer), and, when the
// interposer is loaded, its statistics. Exit status 0 when the results are right.
#include <cuda_runtime.h>

#include <dlfcn.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CUDA_OK(call)                                                      \
  do {                                                                     \
    const cudaError_t e_ = (call);                                         \
    if (e_ != cudaSuccess) {                                               \
      std::fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #call, \
                   cudaGetErrorString(e_));                                \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

namespace {

__global__ void spin_kernel(unsigned long long nanoseconds) {
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < nanoseconds);
}

__global__ void fill_kernel(std::uint32_t* a, std::size_t n, std::uint32_t c) {
  for (std::size_t j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) {
    a[j] = c + static_cast<std::uint32_t>(j);
  }
}

__global__ void transform_kernel(const std::uint32_t* a, std::uint64_t* b, std::size_t n,
                                 std::uint64_t i) {
  for (std::size_t j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) {
    b[j] = 3ull * a[j] + i;
  }
}

__global__ void sum_kernel(const std::uint64_t* b, std::size_t n, unsigned long long* sum) {
  __shared__ unsigned long long partial[256];
  unsigned long long local = 0;
  for (std::size_t j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x)
    local += b[j];
  partial[threadIdx.x] = local;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(sum, partial[0]);
}

__global__ void count_ones_kernel(const std::uint32_t* x, std::size_t n,
                                  unsigned long long* count) {
  unsigned long long local = 0;
  for (std::size_t j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x)
    local += x[j] == 1u;
  atomicAdd(count, local);
}

int blocks_for(std::size_t n) { return static_cast<int>(n / 256 < 1024 ? (n + 255) / 256 : 1024); }

// The interposer's statistics, when it is loaded.
void print_preload_stats() {
  using stats_fn = int (*)(int, char*, std::size_t);
  auto fn = reinterpret_cast<stats_fn>(dlsym(RTLD_DEFAULT, "streamsafe_preload_stats_json"));
  if (!fn) {
    std::printf("interposer: not loaded (every cudaMalloc above was a driver allocation)\n");
    return;
  }
  char buf[4096];
  if (fn(0, buf, sizeof buf) > 0) std::printf("interposer: %s\n", buf);
}

}  // namespace

int main(int argc, char** argv) {
  int iterations = 2000, streams = 4, async_every = 4;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--iterations")) iterations = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--streams")) streams = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--async-every")) async_every = std::atoi(argv[i + 1]);
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("loop: no GPU present, nothing to run\n");
    return 2;
  }
  std::vector<cudaStream_t> s(static_cast<std::size_t>(streams > 0 ? streams : 1));
  for (auto& st : s) CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  unsigned long long* d_sum = nullptr;
  CUDA_OK(cudaMalloc(&d_sum, 2 * sizeof(unsigned long long)));
  CUDA_OK(cudaMemset(d_sum, 0, 2 * sizeof(unsigned long long)));

  // 1. The cudaFree contract.
  {
    const std::size_t n = std::size_t{16} << 20;  // 64 MiB of uint32
    std::uint32_t* x = nullptr;
    CUDA_OK(cudaMalloc(&x, n * sizeof(std::uint32_t)));
    const std::vector<std::uint32_t> ones(n, 1u);
    CUDA_OK(
        cudaMemcpyAsync(x, ones.data(), n * sizeof(std::uint32_t), cudaMemcpyHostToDevice, s[0]));
    spin_kernel<<<1, 1, 0, s[0]>>>(100ull * 1000 * 1000);
    count_ones_kernel<<<1024, 256, 0, s[0]>>>(x, n, d_sum + 1);
    CUDA_OK(cudaFree(x));  // the read above may still be running
    std::uint32_t* y = nullptr;
    CUDA_OK(cudaMalloc(&y, n * sizeof(std::uint32_t)));
    CUDA_OK(cudaMemsetAsync(y, 0, n * sizeof(std::uint32_t), s.size() > 1 ? s[1] : s[0]));
    CUDA_OK(cudaDeviceSynchronize());
    unsigned long long ones_seen = 0;
    CUDA_OK(cudaMemcpy(&ones_seen, d_sum + 1, sizeof ones_seen, cudaMemcpyDeviceToHost));
    const bool ok = ones_seen == n;
    std::printf(
        "contract: memory freed under a pending read was %s: read saw %llu of %zu ones: %s\n",
        y == x ? "reused after the read" : "not reused", ones_seen, n, ok ? "ok" : "CORRUPTED");
    CUDA_OK(cudaFree(y));
    if (!ok) return 1;
  }

  // 2. The loop.
  unsigned long long expected = 0;
  std::uint64_t mallocs = 0, async_mallocs = 0;
  CUDA_OK(cudaDeviceSynchronize());
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) {
    const std::size_t n = std::size_t{1024} << (i % 14);  // 4 KiB .. 32 MiB of uint32
    const std::uint32_t c = static_cast<std::uint32_t>(i % 1000);
    cudaStream_t st = s[static_cast<std::size_t>(i) % s.size()];
    const bool async = async_every > 0 && i % async_every == async_every - 1;
    std::uint32_t* a = nullptr;
    std::uint64_t* b = nullptr;
    if (async) {
      CUDA_OK(cudaMallocAsync(&a, n * sizeof(std::uint32_t), st));
      CUDA_OK(cudaMallocAsync(&b, n * sizeof(std::uint64_t), st));
      async_mallocs += 2;
    } else {
      CUDA_OK(cudaMalloc(&a, n * sizeof(std::uint32_t)));
      CUDA_OK(cudaMalloc(&b, n * sizeof(std::uint64_t)));
      mallocs += 2;
    }
    fill_kernel<<<blocks_for(n), 256, 0, st>>>(a, n, c);
    transform_kernel<<<blocks_for(n), 256, 0, st>>>(a, b, n, static_cast<std::uint64_t>(i));
    sum_kernel<<<blocks_for(n), 256, 0, st>>>(b, n, d_sum);
    CUDA_OK(cudaGetLastError());
    if (async) {
      CUDA_OK(cudaFreeAsync(a, st));
      CUDA_OK(cudaFreeAsync(b, st));
    } else {
      CUDA_OK(cudaFree(a));
      CUDA_OK(cudaFree(b));
    }
    // sum_j (3 (c + j) + i) for j < n
    const unsigned long long nn = n;
    expected += 3ull * (nn * c + nn * (nn - 1) / 2) + nn * static_cast<unsigned long long>(i);
  }
  CUDA_OK(cudaDeviceSynchronize());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  unsigned long long checksum = 0;
  CUDA_OK(cudaMemcpy(&checksum, d_sum, sizeof checksum, cudaMemcpyDeviceToHost));
  std::printf("checksum: %llu (expected %llu): %s\n", checksum, expected,
              checksum == expected ? "ok" : "WRONG");
  std::printf(
      "loop: %d iterations on %zu streams, %llu cudaMalloc + %llu cudaMallocAsync calls, %.3f s "
      "(%.1f us per iteration)\n",
      iterations, s.size(), static_cast<unsigned long long>(mallocs),
      static_cast<unsigned long long>(async_mallocs), seconds, seconds * 1e6 / iterations);
  print_preload_stats();
  CUDA_OK(cudaFree(d_sum));
  for (auto& st : s) CUDA_OK(cudaStreamDestroy(st));
  return checksum == expected ? 0 : 1;
}
