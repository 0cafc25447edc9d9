// Case K11 on a real GPU, for both CUDA backends: a stream captures a CUDA graph (global
// capture mode) whose body allocates, frees, reuses a freed block and grows the cache while
// launching kernels; another thread, and the capturing thread itself, call empty_cache and
// reclaim and allocate eagerly on another stream during the capture. The capture must stay
// valid (cudaStreamEndCapture succeeds: the allocator made no releasing, synchronising or
// event-query call), and the instantiated graph replays several times with exact results while
// eager work on another stream runs beside it. Every host wait is bounded.
#include "support/gpu.hpp"

#include <streamsafe/backends/cuda_malloc_backend.hpp>
#include <streamsafe/backends/expandable_backend.hpp>
#include <streamsafe/core/caching_allocator.hpp>
#include <streamsafe/kernels/optimizers.hpp>

#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

using namespace streamsafe;

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

#define GRAPH_CUDA_OK(call)                                             \
  do {                                                                  \
    const cudaError_t graph_cuda_ok_result = (call);                    \
    INFO(#call << ": " << cudaGetErrorName(graph_cuda_ok_result) << " " \
               << cudaGetErrorString(graph_cuda_ok_result));            \
    REQUIRE(graph_cuda_ok_result == cudaSuccess);                       \
  } while (0)

stream_handle h(cudaStream_t s) { return reinterpret_cast<stream_handle>(s); }

// Waits for the stream with a deadline (no hang): false when it did not finish in time.
bool wait_bounded(cudaStream_t s, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    const cudaError_t r = cudaStreamQuery(s);
    if (r == cudaSuccess) return true;
    if (r != cudaErrorNotReady) {
      FAIL("cudaStreamQuery: " << cudaGetErrorName(r) << " " << cudaGetErrorString(r));
    }
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

std::unique_ptr<device_backend> make_backend(backend_kind kind) {
  if (kind == backend_kind::expandable) return std::make_unique<cuda::expandable_backend>(0);
  return std::make_unique<cuda::cuda_malloc_backend>(0);
}

}  // namespace

TEST_CASE(
    "K11 on the GPU: a graph that allocates, frees and launches kernels is captured while "
    "empty_cache runs, "
    "and replays exactly",
    "[gpu][core][graph][cases][K11]") {
  STREAMSAFE_REQUIRE_GPU();
  const backend_kind kind = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  INFO("backend " << (kind == backend_kind::expandable ? "expandable" : "cuda_malloc"));
  auto backend = make_backend(kind);
  options o;
  o.backend = kind;
  auto alloc = std::make_unique<caching_allocator>(*backend, o);

  cudaStream_t s = nullptr, t = nullptr;
  GRAPH_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  GRAPH_CUDA_OK(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking));
  unsigned long long* sum = nullptr;  // outside the allocator: the graph's only fixed input
  GRAPH_CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&sum), sizeof *sum));

  // Cached memory on both streams, which an empty_cache during the capture would release.
  for (std::size_t bytes : {2 * mib, 24 * mib, 96 * mib}) {
    void* p = alloc->allocate(bytes, h(t));
    GRAPH_CUDA_OK(kernels::launch_fill(p, bytes, 0x77, t));
    alloc->deallocate(p);
    void* q = alloc->allocate(bytes, h(s));
    GRAPH_CUDA_OK(kernels::launch_fill(q, bytes, 0x66, s));
    GRAPH_CUDA_OK(kernels::launch_read_sum(q, bytes, sum, s));
    GRAPH_CUDA_OK(kernels::launch_spin(s, 0.01));
    alloc->deallocate(q);
  }
  REQUIRE(wait_bounded(s, std::chrono::seconds(30)));
  REQUIRE(wait_bounded(t, std::chrono::seconds(30)));

  const std::uint64_t id = alloc->notify_capture_begin(h(s));
  GRAPH_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));

  std::atomic<bool> stop{false};
  std::atomic<int> rounds{0};
  std::atomic<bool> other_failed{false};
  std::string other_error;  // written by the other thread, read after the join
  std::thread other([&] {   // another thread: empty_cache, reclaim, eager work on t
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    try {
      while (!stop.load() && std::chrono::steady_clock::now() < deadline) {
        alloc->empty_cache();
        alloc->reclaim();
        void* p = alloc->allocate(4 * mib + static_cast<std::size_t>(rounds.load() % 4) * mib,
                                  h(t));
        if (kernels::launch_fill(p, 4 * mib, 0x55, t) != cudaSuccess) {
          other_error = "launch_fill on t failed";
          other_failed = true;
        }
        alloc->deallocate(p);
        ++rounds;
      }
    } catch (const std::exception& e) {
      other_error = e.what();
      other_failed = true;
    }
  });

  // The graph: a = 8 MiB of 1, freed; b (a's block, reused inside the capture) = 8 MiB of 2;
  // c = 64 MiB of 3 (growth during the capture); each summed into *sum.
  void* a = alloc->allocate(8 * mib, h(s));
  GRAPH_CUDA_OK(kernels::launch_fill(a, 8 * mib, 1, s));
  GRAPH_CUDA_OK(kernels::launch_read_sum(a, 8 * mib, sum, s));
  alloc->deallocate(a);
  alloc->empty_cache();  // the capturing thread too
  void* b = alloc->allocate(8 * mib, h(s));
  CHECK(b == a);
  GRAPH_CUDA_OK(kernels::launch_spin(s, 0.05));
  GRAPH_CUDA_OK(kernels::launch_fill(b, 8 * mib, 2, s));
  GRAPH_CUDA_OK(kernels::launch_read_sum(b, 8 * mib, sum, s));
  void* c = alloc->allocate(64 * mib, h(s));
  GRAPH_CUDA_OK(kernels::launch_fill(c, 64 * mib, 3, s));
  GRAPH_CUDA_OK(kernels::launch_read_sum(c, 64 * mib, sum, s));
  alloc->deallocate(b);
  alloc->deallocate(c);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (rounds.load() < 5 && !other_failed.load() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }

  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(s, &graph);
  CHECK(alloc->notify_capture_end(h(s)) == id);
  stop = true;
  other.join();
  INFO("other thread: " << other_error << ", rounds " << rounds.load());
  CHECK(other_error.empty());
  CHECK(rounds.load() >= 1);
  INFO("cudaStreamEndCapture: " << cudaGetErrorName(ended) << " " << cudaGetErrorString(ended));
  REQUIRE(ended == cudaSuccess);  // the capture stayed valid
  REQUIRE(graph != nullptr);

  cudaGraphExec_t exec = nullptr;
  GRAPH_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  const unsigned long long expected = 8 * mib * 1 + 8 * mib * 2 + 64 * mib * 3;
  for (int replay = 0; replay < 5; ++replay) {
    GRAPH_CUDA_OK(cudaMemsetAsync(sum, 0, sizeof *sum, s));
    GRAPH_CUDA_OK(cudaGraphLaunch(exec, s));
    // Eager work beside the replay: never on the graph's memory.
    void* p = alloc->allocate(8 * mib, h(t));
    void* q = alloc->allocate(64 * mib, h(t));
    CHECK(p != a);
    CHECK(p != c);
    CHECK(q != c);
    GRAPH_CUDA_OK(kernels::launch_fill(p, 8 * mib, 0xee, t));
    GRAPH_CUDA_OK(kernels::launch_fill(q, 64 * mib, 0xee, t));
    alloc->deallocate(p);
    alloc->deallocate(q);
    unsigned long long got = 0;
    GRAPH_CUDA_OK(cudaMemcpyAsync(&got, sum, sizeof got, cudaMemcpyDeviceToHost, s));
    REQUIRE(wait_bounded(s, std::chrono::seconds(30)));
    REQUIRE(wait_bounded(t, std::chrono::seconds(30)));
    INFO("replay " << replay);
    CHECK(got == expected);
  }
  alloc->check_invariants();

  GRAPH_CUDA_OK(cudaGraphExecDestroy(exec));
  GRAPH_CUDA_OK(cudaGraphDestroy(graph));
  alloc->notify_graph_released(id);
  const auto reserved = alloc->stats().reserved_bytes.current;
  alloc->empty_cache();
  CHECK(alloc->stats().reserved_bytes.current < reserved);  // the graph's pool went back too
  alloc->check_invariants();
  alloc->notify_stream_destroyed(h(s));
  alloc->notify_stream_destroyed(h(t));
  alloc.reset();
  GRAPH_CUDA_OK(cudaFree(sum));
  GRAPH_CUDA_OK(cudaStreamDestroy(s));
  GRAPH_CUDA_OK(cudaStreamDestroy(t));
}
