// Tests of cuda::allocator, the multi-device front end, on the real device: it serves, routes
// and empties the cache; a block freed while another device is current returns to its own
// device (K7); per-thread-stream blocks keep their order. The host tests over simulated devices
// are in frontend_allocator_test.cpp.
#include "support/gpu.hpp"
#include "support/sim_fixture.hpp"

#include <streamsafe/core/errors.hpp>
#include <streamsafe/frontends/allocator.hpp>
#include <streamsafe/kernels/optimizers.hpp>

#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>

#include <thread>
#include <vector>

namespace {

using streamsafe::invalid_pointer;
using streamsafe::cuda::allocator;
using streamsafe::test::MiB;

}  // namespace

TEST_CASE("On the GPU, the front end serves, routes and empties the cache", "[gpu][frontend]") {
  STREAMSAFE_REQUIRE_GPU();
  allocator alloc;
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  void* p = alloc.allocate(8 * MiB, s);
  CHECK(alloc.owner_device(p) == 0);
  REQUIRE(streamsafe::kernels::launch_fill(p, 8 * MiB, 0x3C, s) == cudaSuccess);
  std::vector<unsigned char> host(8 * MiB);
  REQUIRE(cudaMemcpyAsync(host.data(), p, host.size(), cudaMemcpyDeviceToHost, s) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  CHECK(host.front() == 0x3C);
  CHECK(host.back() == 0x3C);
  alloc.deallocate(p, s);
  CHECK(alloc.empty_cache() >= 8 * MiB);
  CHECK(alloc.stats(0).reserved_bytes.current == 0);
  alloc.notify_stream_destroyed(s);
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
  CHECK_THROWS_AS(alloc.deallocate(p), invalid_pointer);
}

TEST_CASE(
    "On the GPU, a block freed while another device is current returns to its own device (K7)",
    "[gpu][multigpu][frontend][cases][K7]") {
  STREAMSAFE_REQUIRE_GPUS(2);
  allocator alloc;
  void* p = alloc.allocate(MiB, 1, nullptr);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  alloc.deallocate(p);
  CHECK(alloc.stats(1).allocated_bytes.current == 0);
  void* q = alloc.allocate(MiB, 1, nullptr);
  CHECK(q == p);
  alloc.deallocate(q);
  int current = -1;
  REQUIRE(cudaGetDevice(&current) == cudaSuccess);
  CHECK(current == 0);  // the front end restored the current device
}

TEST_CASE(
    "On the GPU, a per-thread-stream block is not handed to another thread's stream while "
    "its work is pending",
    "[gpu][frontend]") {
  STREAMSAFE_REQUIRE_GPU();
  allocator alloc;
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  constexpr std::size_t bytes = 64 * MiB;  // a whole segment: B can only reuse A's block
  // Catch2 assertions are not thread-safe: the threads only note their CUDA results.
  void* first = nullptr;
  void* second = nullptr;
  cudaError_t a_result = cudaSuccess, b_result = cudaSuccess;
  auto note = [](cudaError_t& into, cudaError_t e) {
    if (into == cudaSuccess) into = e;
  };
  std::thread a([&] {
    note(a_result, cudaSetDevice(0));
    first = alloc.allocate(bytes, cudaStreamPerThread);
    note(a_result, streamsafe::kernels::launch_spin(cudaStreamPerThread, 200.0));
    note(a_result, streamsafe::kernels::launch_fill(first, bytes, 0xAA, cudaStreamPerThread));
    alloc.deallocate(first);  // host free on the thread whose per-thread stream used it
  });
  a.join();
  std::thread b([&] {
    note(b_result, cudaSetDevice(0));
    second = alloc.allocate(bytes, cudaStreamPerThread);
    note(b_result, streamsafe::kernels::launch_fill(second, bytes, 0xBB, cudaStreamPerThread));
    note(b_result, cudaStreamSynchronize(cudaStreamPerThread));
  });
  b.join();
  REQUIRE(a_result == cudaSuccess);
  REQUIRE(b_result == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  unsigned char value = 0;
  REQUIRE(cudaMemcpy(&value, second, 1, cudaMemcpyDeviceToHost) == cudaSuccess);
  INFO("second block " << (second == first ? "reuses" : "differs from") << " the first");
  CHECK(value == 0xBB);  // B's write came after A's (or B got other memory)
  alloc.deallocate(second, cudaStreamLegacy);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(alloc.empty_cache() > 0);
}
