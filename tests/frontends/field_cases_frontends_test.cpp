// Case K17 (shared/cases/CASES.md), every cache keyed by device: the cuda::mr adapter and the
// C++ front end over two simulated devices.
#include "support/sim_fixture.hpp"

#include <streamsafe/frontends/memory_resource.hpp>
#include <streamsafe/sim/simulated_platform.hpp>

#include <catch2/catch.hpp>

#include <thread>
#include <vector>

using namespace streamsafe;
using streamsafe::cuda::memory_resource;
using streamsafe::cuda::simulated_platform;
using streamsafe::test::MiB;

namespace {

// True when [ptr, ptr+n) is memory of simulated device d (mapped there, seen through d's
// address shift) and of no other of the platform's devices.
bool on_device(simulated_platform& platform, const void* ptr, std::size_t n, int d) {
  for (int k = 0; k < platform.device_count(); ++k) {
    const auto a = reinterpret_cast<std::uintptr_t>(ptr);
    if (a < simulated_platform::address_offset(k)) {
      if (k == d) return false;
      continue;
    }
    const bool mapped = platform.device(k).is_mapped(simulated_platform::device_address(ptr, k), n);
    if (mapped != (k == d)) return false;
  }
  return true;
}

}  // namespace

TEST_CASE(
    "K17: the cuda::mr adapter for device 1 asked first, then device 0's: each returns its own "
    "device's memory",
    "[adapters][cases][K17]") {
  simulated_platform platform{2};
  simulated_platform::set_current_device(0);
  streamsafe::cuda::allocator alloc{options{}, platform.make_platform()};
  memory_resource on1(alloc, 1);
  memory_resource on0(alloc, 0);
  void* p1 = on1.allocate(4 * MiB);
  void* p0 = on0.allocate(4 * MiB);
  CHECK(on_device(platform, p1, 4 * MiB, 1));
  CHECK(on_device(platform, p0, 4 * MiB, 0));
  CHECK(alloc.owner_device(p1) == 1);
  CHECK(alloc.owner_device(p0) == 0);
  on0.deallocate(p1, 4 * MiB);  // routed by the pointer, not by the resource
  on1.deallocate(p0, 4 * MiB);
  CHECK(alloc.stats(0).allocated_bytes.current == 0);
  CHECK(alloc.stats(1).allocated_bytes.current == 0);
  CHECK(alloc.empty_cache() > 0);  // a bulk release covers both devices
  CHECK(alloc.stats(0).reserved_bytes.current == 0);
  CHECK(alloc.stats(1).reserved_bytes.current == 0);
}

TEST_CASE(
    "K17: two threads construct adapters for two devices at once and allocate 100 blocks each: no "
    "block of "
    "the other device",
    "[adapters][cases][K17]") {
  simulated_platform platform{2};
  streamsafe::cuda::allocator alloc{options{}, platform.make_platform()};
  std::vector<void*> blocks[2];
  std::vector<std::thread> threads;
  for (int d = 0; d < 2; ++d) {
    threads.emplace_back([&, d] {
      simulated_platform::set_current_device(1 - d);  // the current device is not the resource's
      memory_resource mr(alloc, d);
      for (int i = 0; i < 100; ++i) blocks[d].push_back(mr.allocate(64 * 1024));
    });
  }
  for (auto& t : threads) t.join();
  for (int d = 0; d < 2; ++d) {
    for (void* p : blocks[d]) {
      CHECK(on_device(platform, p, 64 * 1024, d));
      CHECK(alloc.owner_device(p) == d);
    }
  }
  for (int d = 0; d < 2; ++d) {
    for (void* p : blocks[d]) alloc.deallocate(p);
  }
  alloc.empty_cache();
  CHECK(alloc.stats(0).reserved_bytes.current == 0);
  CHECK(alloc.stats(1).reserved_bytes.current == 0);
  CHECK(platform.device(0).fault_count() == 0);
  CHECK(platform.device(1).fault_count() == 0);
}
