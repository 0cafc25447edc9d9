// Sleep and wake on the GPU (expandable_backend): a resumed tag is mapped in handles sized to it
// (expandable_tag_handle_mb), its contents come back after offload, and a pause gives its memory
// back to the driver as cudaMemGetInfo sees it. Each test skips itself, with a message, where
// there is no GPU; the simulated device's counterparts are in tests/core/sleep_test.cpp.
#include "support/gpu.hpp"

#include <streamsafe/backends/expandable_backend.hpp>
#include <streamsafe/core/caching_allocator.hpp>

#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace {

using namespace streamsafe;

constexpr std::size_t mib = std::size_t{1} << 20;

std::size_t free_device_bytes() {
  std::size_t free_bytes = 0, total = 0;
  REQUIRE(cudaMemGetInfo(&free_bytes, &total) == cudaSuccess);
  return free_bytes;
}

std::uint8_t last_byte(const void* block, std::size_t bytes) {
  std::uint8_t v = 0;
  REQUIRE(cudaMemcpy(&v, static_cast<const std::uint8_t*>(block) + bytes - 1, 1,
                     cudaMemcpyDeviceToHost) == cudaSuccess);
  return v;
}

}  // namespace

TEST_CASE("On the GPU a resumed tag is mapped in a few handles and its memory goes back whole",
          "[gpu][core][sleep]") {
  STREAMSAFE_REQUIRE_GPU();
  const pause_mode mode = GENERATE(pause_mode::discard, pause_mode::offload);
  CAPTURE(static_cast<int>(mode));
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  cuda::expandable_backend be(0);
  options o;
  o.backend = backend_kind::expandable;
  o.empty_cache = empty_cache_mode::wait;
  o.release_worker = release_worker_mode::off;
  o.expandable_tag_handle_bytes = 512 * mib;
  caching_allocator alloc(be, o);
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  const auto sh = reinterpret_cast<stream_handle>(s);
  constexpr std::size_t block = 25 * mib;
  std::vector<void*> w;
  {
    tag_scope scope("weights");
    for (int i = 0; i < 40; ++i) w.push_back(alloc.allocate(block, sh));
  }
  for (std::size_t i = 0; i < w.size(); ++i)
    REQUIRE(cudaMemsetAsync(w[i], static_cast<int>(i + 1), block, s) == cudaSuccess);
  for (std::size_t i = 30; i < w.size(); ++i) alloc.deallocate(w[i]);  // 250 MiB of free cache
  const std::size_t tag_bytes = alloc.tag_status("weights").reserved_bytes;
  REQUIRE(tag_bytes >= 1000 * mib);
  for (int cycle = 0; cycle < 3; ++cycle) {
    CAPTURE(cycle);
    const std::size_t before = free_device_bytes();
    alloc.pause("weights", mode);
    const std::size_t after = free_device_bytes();
    // The whole tag is back with the driver (cudaMemGetInfo; at least 99.5% of it).
    CHECK(static_cast<double>(after) - static_cast<double>(before) >=
          0.995 * static_cast<double>(tag_bytes));
    CHECK(alloc.tag_status("weights").phase == tag_phase::paused);
    alloc.resume("weights", sh);
    // 750 MiB holding live blocks in two handles of up to 512 MiB, the free 250 MiB in one.
    CHECK(be.mapped_chunk_count() == 3);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    if (mode == pause_mode::offload) {
      for (std::size_t i = 0; i < 30; ++i) CHECK(last_byte(w[i], block) == i + 1);
    }
  }
  CHECK(alloc.empty_cache("weights") == 250 * mib);  // the free handle, whole
  for (std::size_t i = 0; i < 30; ++i) alloc.deallocate(w[i]);
  CHECK(alloc.empty_cache("weights") == 750 * mib);
  CHECK(be.mapped_chunk_count() == 0);
  // The allocator is told before the stream goes: its destructor must not record on a
  // destroyed stream (a handle the driver has freed).
  alloc.notify_stream_destroyed(sh);
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}
