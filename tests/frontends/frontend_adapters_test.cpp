// Tests of the CUB-style adapter (cuda::cub_allocator) and the cuda::mr adapter
// (cuda::memory_resource) over simulated devices: CUB's return codes and semantics, the CCCL
// concepts (also proved by static_asserts in the header), type-erased use through
// cuda::mr::async_resource_ref, and the Thrust allocator. The examples in examples/cub run them
// on the GPU with CUB, Thrust and CCCL.
#include "support/sim_fixture.hpp"

#include <streamsafe/frontends/cub_allocator.hpp>
#include <streamsafe/frontends/memory_resource.hpp>
#include <streamsafe/sim/simulated_platform.hpp>

#include <catch2/catch.hpp>

#include <stdexcept>

namespace {

using streamsafe::options;
using streamsafe::stream_handle;
using streamsafe::cuda::allocator;
using streamsafe::cuda::cub_allocator;
using streamsafe::cuda::memory_resource;
using streamsafe::cuda::simulated_platform;
using streamsafe::test::MiB;

cudaStream_t as_stream(stream_handle s) { return reinterpret_cast<cudaStream_t>(s); }

struct env {
  simulated_platform platform{2};
  allocator alloc{options{}, platform.make_platform()};
  env() { simulated_platform::set_current_device(0); }
};

}  // namespace

TEST_CASE("The CUB-style adapter allocates and frees with CUB's signatures and return codes",
          "[adapters]") {
  env e;
  cub_allocator cub(e.alloc);
  void* p = nullptr;
  REQUIRE(cub.DeviceAllocate(&p, 1000) == cudaSuccess);
  REQUIRE(p != nullptr);
  REQUIRE(cub.DeviceFree(p) == cudaSuccess);
  void* q = nullptr;
  REQUIRE(cub.DeviceAllocate(&q, 1000, nullptr) == cudaSuccess);
  CHECK(q == p);  // reused at once on the same stream
  void* on1 = nullptr;
  REQUIRE(cub.DeviceAllocate(1, &on1, 4 * MiB) == cudaSuccess);
  CHECK(e.alloc.owner_device(on1) == 1);
  CHECK(cub.DeviceFree(0, on1) == cudaSuccess);  // the owner is found from the pointer
  CHECK(e.alloc.stats(1).allocated_bytes.current == 0);
  REQUIRE(cub.DeviceFree(q) == cudaSuccess);

  void* zero = nullptr;
  CHECK(cub.DeviceAllocate(&zero, 0) == cudaSuccess);  // CUB's smallest bin: a valid block
  CHECK(zero != nullptr);
  CHECK(cub.DeviceFree(zero) == cudaSuccess);

  CHECK(cub.DeviceFree(nullptr) == cudaSuccess);
  CHECK(cub.DeviceFree(q) == cudaErrorInvalidValue);  // double free
  int host = 0;
  CHECK(cub.DeviceFree(&host) == cudaErrorInvalidValue);
  CHECK(cub.DeviceAllocate(5, &p, 16) == cudaErrorInvalidDevice);
  CHECK(p == nullptr);
  CHECK(cub.DeviceAllocate(nullptr, 16) == cudaErrorInvalidValue);
  CHECK(cub.DeviceAllocate(&p, std::size_t{1} << 45) == cudaErrorMemoryAllocation);
  CHECK(cub.FreeAllCached() == cudaSuccess);
  CHECK(e.alloc.stats(0).reserved_bytes.current == 0);
  CHECK(e.alloc.stats(1).reserved_bytes.current == 0);
}

TEST_CASE(
    "A block freed through the CUB-style adapter is reused on another stream only after its "
    "stream's work",
    "[adapters]") {
  env e;
  auto& dev = e.platform.device(0);
  const stream_handle s1 = dev.create_stream();
  const stream_handle s2 = dev.create_stream();
  cub_allocator cub(e.alloc);
  void* p = nullptr;
  REQUIRE(cub.DeviceAllocate(0, &p, 64 * MiB, as_stream(s1)) == cudaSuccess);
  const auto hold = dev.hold(s1);
  dev.launch(s1, 5, {streamsafe::test::writes(p, 64 * MiB, 0x01)});
  REQUIRE(cub.DeviceFree(p) == cudaSuccess);
  void* q = nullptr;
  REQUIRE(cub.DeviceAllocate(0, &q, 64 * MiB, as_stream(s2)) == cudaSuccess);
  dev.launch(s2, 5, {streamsafe::test::writes(q, 64 * MiB, 0x02)});
  dev.open(hold);
  dev.run_until_idle();
  CHECK(dev.fault_count() == 0);  // q is other memory, or s2 waited for s1
  REQUIRE(cub.DeviceFree(q) == cudaSuccess);
}

TEST_CASE("SetMaxCachedBytes bounds what the CUB-style adapter leaves cached", "[adapters]") {
  env e;
  cub_allocator cub(e.alloc);
  void *a = nullptr, *b = nullptr;
  REQUIRE(cub.DeviceAllocate(&a, 40 * MiB) == cudaSuccess);
  REQUIRE(cub.DeviceAllocate(&b, 40 * MiB) == cudaSuccess);
  REQUIRE(cub.DeviceFree(a) == cudaSuccess);
  CHECK(e.alloc.stats(0).reserved_bytes.current ==
        static_cast<std::int64_t>(80 * MiB));  // unlimited

  REQUIRE(cub.SetMaxCachedBytes(8 * MiB) == cudaSuccess);
  CHECK(cub.max_cached_bytes == 8 * MiB);
  REQUIRE(cub.DeviceFree(b) == cudaSuccess);  // 80 MiB cached > 8 MiB: released
  CHECK(e.alloc.stats(0).reserved_bytes.current == 0);

  cub_allocator bins(8, 3, 7, 6 * MiB);  // CUB's binned constructor: max_cached_bytes kept
  CHECK(bins.max_cached_bytes == 6 * MiB);
  CHECK(bins.bin_growth == 8);
}

TEST_CASE("The cuda::mr adapter is an async resource and works through async_resource_ref",
          "[adapters]") {
  static_assert(cuda::mr::async_resource_with<memory_resource, cuda::mr::device_accessible>);
  env e;
  memory_resource mr(e.alloc);
  cuda::mr::async_resource_ref<cuda::mr::device_accessible> ref{mr};
  auto& dev = e.platform.device(0);
  const cudaStream_t s = as_stream(dev.create_stream());

  void* p = ref.allocate_async(3000, 256, cuda::stream_ref{s});
  CHECK(e.alloc.device_allocator(0).find_block(p).stream == reinterpret_cast<stream_handle>(s));
  ref.deallocate_async(p, 3000, 256, cuda::stream_ref{s});
  void* q = ref.allocate(100, 512);  // the synchronous pair: the legacy stream
  CHECK(e.alloc.device_allocator(0).find_block(q).stream == 0);
  ref.deallocate(q, 100, 512);
  CHECK(e.alloc.stats(0).allocated_bytes.current == 0);

  CHECK_THROWS_AS(mr.allocate(64, 1024), std::invalid_argument);
  CHECK_THROWS_AS(mr.allocate(64, 3), std::invalid_argument);
  mr.deallocate(&e, 8);  // a foreign pointer: logged and ignored (noexcept)

  memory_resource on1(e.alloc, 1);
  CHECK(mr != on1);
  CHECK(mr == memory_resource(e.alloc));
  void* r = on1.allocate_async(MiB, 512, cuda::stream_ref{cudaStreamLegacy});
  CHECK(e.alloc.owner_device(r) == 1);
  mr.deallocate_async(r, MiB, 512, cuda::stream_ref{cudaStreamLegacy});  // routed to device 1
  CHECK(e.alloc.stats(1).allocated_bytes.current == 0);
}

TEST_CASE("The Thrust allocator takes stream-ordered memory from the cuda::mr adapter",
          "[adapters]") {
  env e;
  auto& dev = e.platform.device(0);
  const cudaStream_t s = as_stream(dev.create_stream());
  streamsafe::cuda::thrust_allocator<char> alloc(memory_resource(e.alloc), s);
  char* p = alloc.allocate(5000);
  CHECK(e.alloc.device_allocator(0).find_block(p).stream == reinterpret_cast<stream_handle>(s));
  alloc.deallocate(p, 5000);
  streamsafe::cuda::thrust_allocator<double> rebound(alloc);
  CHECK(rebound.stream() == s);
  double* d = rebound.allocate(10);
  CHECK(reinterpret_cast<std::uintptr_t>(d) % 512 == 0);
  rebound.deallocate(d, 10);
  CHECK(e.alloc.stats(0).allocated_bytes.current == 0);
}
