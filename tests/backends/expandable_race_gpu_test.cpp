// The unmap race on a real GPU, with the expandable (VMM) backend: a kernel on another stream
// writes a block behind a spin; the host frees the block without record_stream and calls
// empty_cache. Under the allocation_stream scope the unmap runs under the pending write (an
// illegal memory access, in a child process since it poisons the context); under the default
// scope empty_cache waits for exactly that stream, or defers.
#include "support/gpu.hpp"

#include <streamsafe/backends/expandable_backend.hpp>
#include <streamsafe/core/caching_allocator.hpp>
#include <streamsafe/kernels/optimizers.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

using namespace streamsafe;

namespace {

constexpr std::size_t k_bytes = std::size_t{256} << 20;

std::string run_child(const std::string& args) {
  const char* from_env = std::getenv("STREAMSAFE_RACE_REPRO");
  const std::string path = from_env && *from_env ? from_env : STREAMSAFE_RACE_REPRO_PATH;
  const std::string cmd = "'" + path + "' " + args + " 2>&1";
  std::string out;
  if (FILE* pipe = popen(cmd.c_str(), "r")) {
    char buf[4096];
    while (std::fgets(buf, sizeof buf, pipe)) out += buf;
    pclose(pipe);
  }
  return out;
}

struct gpu_env {
  cuda::expandable_backend backend{0};
  cudaStream_t s = nullptr, t = nullptr;
  gpu_env() {
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking) == cudaSuccess);
  }
  ~gpu_env() {
    cudaStreamDestroy(s);
    cudaStreamDestroy(t);
  }
  static stream_handle h(cudaStream_t x) { return reinterpret_cast<stream_handle>(x); }
  // t waits for s, spins `ms`, then writes p: the write is pending for about `ms`.
  void pending_write_on_t(caching_allocator& alloc, void* p, double ms) {
    cudaEvent_t e;
    REQUIRE(cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess);
    REQUIRE(cudaEventRecord(e, s) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(t, e, 0) == cudaSuccess);
    REQUIRE(kernels::launch_spin(t, ms) == cudaSuccess);
    REQUIRE(kernels::launch_fill(p, k_bytes, 0x5a, t) == cudaSuccess);
    cudaEventDestroy(e);
    (void)alloc;
  }
};

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_CASE("On the GPU the allocation_stream scope unmaps under a pending kernel and faults",
          "[gpu][core][race]") {
  STREAMSAFE_REQUIRE_GPU();
  const std::string out = run_child(
      "--child signsgd_per_parameter pytorch --params 256 --shard-floats 4194304 --steps 2");
  INFO(out);
  CHECK(out.find("RESULT|0|") != std::string::npos);
  CHECK(out.find("illegal memory access") != std::string::npos);
}

TEST_CASE("On the GPU streamsafe's default release never faults the pending kernel",
          "[gpu][core][race]") {
  STREAMSAFE_REQUIRE_GPU();
  const std::string out = run_child(
      "--child signsgd_per_parameter streamsafe --params 256 --shard-floats 4194304 --steps 2");
  INFO(out);
  CHECK(out.find("RESULT|1|2|") != std::string::npos);
}

TEST_CASE("On the GPU empty_cache waits for exactly the stream that still uses the memory",
          "[gpu][core][race]") {
  STREAMSAFE_REQUIRE_GPU();
  gpu_env env;
  options o;
  o.backend = backend_kind::expandable;
  caching_allocator alloc(env.backend, o);
  cudaStream_t unrelated;
  REQUIRE(cudaStreamCreateWithFlags(&unrelated, cudaStreamNonBlocking) == cudaSuccess);
  void* seen_on_t = alloc.allocate(512, gpu_env::h(env.t));  // t is a stream the allocator has seen
  void* p = alloc.allocate(k_bytes, gpu_env::h(env.s));
  // Load the kernels' module before the unrelated kernel runs (lazy loading would wait for it).
  REQUIRE(kernels::launch_fill(p, 512, 0, env.s) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(env.s) == cudaSuccess);
  REQUIRE(kernels::launch_spin(unrelated, 1000) ==
          cudaSuccess);  // 1 s on a stream the allocator never saw
  env.pending_write_on_t(alloc, p, 100);
  alloc.deallocate(p);  // no record_stream, as FSDP2
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(alloc.empty_cache() >= k_bytes);
  const double waited = ms_since(t0);
  const auto st = alloc.stats();
  WARN("empty_cache took " << waited << " ms, of which fence waits " << st.fence_wait_ns / 1e6
                           << " ms (" << st.fence_waits << " events), released "
                           << st.bytes_released << " bytes");
  CHECK(waited > 50);   // waited for the write on t
  CHECK(waited < 900);  // but not for the unrelated kernel
  CHECK(cudaStreamSynchronize(env.t) == cudaSuccess);
  CHECK(alloc.stats().num_sync_all_streams == 0);
  alloc.deallocate(seen_on_t);
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
  cudaStreamDestroy(unrelated);
}

TEST_CASE("On the GPU empty_cache in defer mode returns at once and reclaim finishes the release",
          "[gpu][core][race]") {
  STREAMSAFE_REQUIRE_GPU();
  gpu_env env;
  options o;
  o.backend = backend_kind::expandable;
  o.empty_cache = empty_cache_mode::defer;
  caching_allocator alloc(env.backend, o);
  void* seen_on_t = alloc.allocate(512, gpu_env::h(env.t));
  void* p = alloc.allocate(k_bytes, gpu_env::h(env.s));
  env.pending_write_on_t(alloc, p, 100);
  alloc.deallocate(p);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(alloc.empty_cache() == 0);
  CHECK(ms_since(t0) < 10);
  CHECK(alloc.pending_release_bytes() >= k_bytes);
  CHECK(alloc.stats().releases_deferred == 1);
  CHECK(cudaStreamSynchronize(env.t) == cudaSuccess);
  CHECK(alloc.reclaim() >= k_bytes);
  CHECK(alloc.pending_release_bytes() == 0);
  alloc.deallocate(seen_on_t);
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
}
