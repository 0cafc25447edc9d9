// Tests of cuda::allocator, the multi-device front end: lazy per-device allocators, frees and
// record_stream routed to the owning device whatever device is current (K7), the errors for
// bad pointers (naming the devices searched), special stream handles, and thread safety, over
// simulated devices (simulated_platform). The same on the real device:
// frontend_allocator_gpu_test.cpp.
#include "support/gpu.hpp"
#include "support/sim_fixture.hpp"

#include <streamsafe/core/errors.hpp>
#include <streamsafe/frontends/allocator.hpp>
#include <streamsafe/sim/simulated_platform.hpp>

#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

using streamsafe::invalid_pointer;
using streamsafe::options;
using streamsafe::stream_handle;
using streamsafe::cuda::allocator;
using streamsafe::cuda::simulated_platform;
using streamsafe::test::MiB;
namespace sim = streamsafe::sim;

cudaStream_t as_stream(stream_handle s) { return reinterpret_cast<cudaStream_t>(s); }

// A range of a block as the simulated device of `device` sees it.
sim::range device_writes(const void* p, std::size_t n, int device, std::uint8_t value) {
  return {simulated_platform::device_address(p, device), n, sim::access::write, value};
}

struct two_devices {
  simulated_platform platform{2};
  allocator alloc{options{}, platform.make_platform()};
  two_devices() { simulated_platform::set_current_device(0); }
  ~two_devices() { simulated_platform::set_current_device(0); }
};

}  // namespace

TEST_CASE("The front end creates one caching allocator per device, on first use", "[frontend]") {
  two_devices env;
  REQUIRE(env.alloc.device_count() == 2);
  CHECK(env.alloc.devices_in_use() == 0);
  CHECK(env.alloc.find_device_allocator(1) == nullptr);
  CHECK(env.alloc.stats(1).reserved_bytes.current == 0);

  void* p = env.alloc.allocate(MiB, 1, nullptr);
  CHECK(env.alloc.devices_in_use() == 1);
  REQUIRE(env.alloc.find_device_allocator(1) != nullptr);
  CHECK(env.alloc.find_device_allocator(0) == nullptr);
  CHECK(env.alloc.owner_device(p) == 1);
  CHECK(env.alloc.stats(1).allocated_bytes.current == static_cast<std::int64_t>(MiB));

  simulated_platform::set_current_device(1);
  void* q = env.alloc.allocate(MiB);  // the current device
  CHECK(env.alloc.owner_device(q) == 1);
  CHECK(env.alloc.devices_in_use() == 1);
  env.alloc.deallocate(p);
  env.alloc.deallocate(q);
  CHECK_THROWS_AS(env.alloc.allocate(MiB, 2, nullptr), std::out_of_range);
  CHECK_THROWS_AS(env.alloc.stats(-1), std::out_of_range);
}

TEST_CASE("Runtime options reach every device's allocator, those created later too",
          "[frontend][config]") {
  two_devices env;
  void* p = env.alloc.allocate(MiB, 0, nullptr);  // device 0's allocator exists, device 1's not
  streamsafe::runtime_options r;
  r.roundup_power2_divisions = 4;
  r.max_split_size_bytes = 40 * MiB;
  env.alloc.set_runtime_options(r);
  CHECK(env.alloc.config().max_split_size_bytes == 40 * MiB);
  void* a = env.alloc.allocate(5 * MiB + 1, 0, nullptr);  // 4 steps from 4 MiB: 6 MiB
  CHECK(env.alloc.stats(0).allocated_bytes.current == static_cast<std::int64_t>(7 * MiB));
  void* b = env.alloc.allocate(5 * MiB + 1, 1, nullptr);  // device 1 made after the change
  CHECK(env.alloc.stats(1).allocated_bytes.current == static_cast<std::int64_t>(6 * MiB));
  CHECK(env.alloc.device_allocator(1).config().max_split_size_bytes == 40 * MiB);
  r.garbage_collection_threshold = 2;  // not a fraction: refused, nothing changed
  CHECK_THROWS_AS(env.alloc.set_runtime_options(r), streamsafe::config_error);
  CHECK(env.alloc.config().garbage_collection_threshold == 0);
  CHECK(env.alloc.device_allocator(0).config().garbage_collection_threshold == 0);
  for (void* x : {p, a, b}) env.alloc.deallocate(x);
}

TEST_CASE("A free is routed to the owning device whatever device is current (K7)",
          "[frontend][cases][K7]") {
  two_devices env;
  void* on0 = env.alloc.allocate(512, 0, nullptr);
  void* on1 = env.alloc.allocate(64 * MiB, 1, nullptr);
  REQUIRE(env.alloc.owner_device(on0) == 0);
  REQUIRE(env.alloc.owner_device(on1) == 1);

  simulated_platform::set_current_device(0);
  env.alloc.deallocate(on1);  // device 1's block while device 0 is current
  simulated_platform::set_current_device(1);
  env.alloc.record_stream(on0, nullptr);
  env.alloc.deallocate(on0, nullptr);  // stream-ordered free, routed too
  CHECK(env.alloc.stats(0).allocated_bytes.current == 0);
  CHECK(env.alloc.stats(1).allocated_bytes.current == 0);
  CHECK(env.alloc.owner_device(on0) == -1);
  env.alloc.device_allocator(0).check_invariants();
  env.alloc.device_allocator(1).check_invariants();

  // The two new allocations differ, and each device reuses its own block.
  void* again1 = env.alloc.allocate(64 * MiB, 1, nullptr);
  void* again0 = env.alloc.allocate(512, 0, nullptr);
  CHECK(again0 != again1);
  CHECK(again1 == on1);
  CHECK(again0 == on0);
  env.alloc.deallocate(again0);
  env.alloc.deallocate(again1);
}

TEST_CASE("Bad frees throw invalid_pointer naming the devices searched and change nothing (K7)",
          "[frontend][cases][K7]") {
  two_devices env;
  SECTION("before any allocation") {
    int x = 0;
    try {
      env.alloc.deallocate(&x);
      FAIL("no exception");
    } catch (const invalid_pointer& e) {
      CHECK_THAT(e.what(), Catch::Contains("devices searched: none"));
    }
  }
  SECTION("after allocations on both devices") {
    void* p = env.alloc.allocate(512, 0, nullptr);
    void* q = env.alloc.allocate(4096, 1, nullptr);
    env.alloc.deallocate(q);
    const auto before0 = env.alloc.stats(0);
    const auto before1 = env.alloc.stats(1);

    simulated_platform::set_current_device(0);
    try {
      env.alloc.deallocate(q);  // double free of device 1's block, device 0 current
      FAIL("no exception");
    } catch (const invalid_pointer& e) {
      CHECK_THAT(e.what(), Catch::Contains("double free"));
      CHECK_THAT(e.what(), Catch::Contains("on device 1"));
      CHECK_THAT(e.what(), Catch::Contains("devices searched: 0, 1"));
    }
    try {
      env.alloc.deallocate(static_cast<char*>(p) + 256);
      FAIL("no exception");
    } catch (const invalid_pointer& e) {
      CHECK_THAT(e.what(), Catch::Contains("interior pointer"));
    }
    int x = 0;
    try {
      env.alloc.record_stream(&x, nullptr);
      FAIL("no exception");
    } catch (const invalid_pointer& e) {
      CHECK_THAT(e.what(), Catch::Contains("unknown pointer"));
      CHECK_THAT(e.what(), Catch::Contains("devices searched: 0, 1 (2 of 2"));
    }
    CHECK(env.alloc.stats(0).allocated_bytes.current == before0.allocated_bytes.current);
    CHECK(env.alloc.stats(1).allocated_bytes.current == before1.allocated_bytes.current);
    CHECK(env.alloc.stats(1).reserved_bytes.current == before1.reserved_bytes.current);
    env.alloc.device_allocator(0).check_invariants();
    env.alloc.device_allocator(1).check_invariants();
    env.alloc.deallocate(p);
  }
}

TEST_CASE("cudaStreamLegacy and the null stream name the same pool", "[frontend]") {
  two_devices env;
  void* p = env.alloc.allocate(MiB, cudaStreamLegacy);
  CHECK(env.alloc.device_allocator(0).find_block(p).stream == 0);
  env.alloc.deallocate(p);
  void* q = env.alloc.allocate(MiB, nullptr);
  CHECK(q == p);  // same stream: reused at once
  env.alloc.deallocate(q, cudaStreamLegacy);
  CHECK(env.alloc.stats(0).events_recorded == 0);  // a free on the allocation stream: no event
  CHECK(streamsafe::cuda::to_stream_handle(cudaStreamLegacy) == 0);
  CHECK(streamsafe::cuda::to_stream_handle(cudaStreamPerThread) == 2);
  CHECK(streamsafe::cuda::is_special_stream(cudaStreamPerThread));
  CHECK_FALSE(streamsafe::cuda::is_special_stream(as_stream(16)));
}

TEST_CASE("A stream-ordered free through the front end orders reuse after the stream of last use",
          "[frontend]") {
  two_devices env;
  sim::simulated_device& dev = env.platform.device(1);
  const stream_handle s1 = dev.create_stream();
  const stream_handle s2 = dev.create_stream();
  simulated_platform::set_current_device(1);

  // 64 MiB: a whole segment, so that reuse on s1 must take this very block.
  const bool stream_ordered = GENERATE(true, false);
  void* p = env.alloc.allocate(64 * MiB, as_stream(s1));
  const auto hold = dev.hold(s2);
  dev.launch(s2, 10, {device_writes(p, 64 * MiB, 1, 0x22)});
  simulated_platform::set_current_device(0);  // the free happens with another device current
  if (stream_ordered) {
    env.alloc.deallocate(p, as_stream(s2));
  } else {
    env.alloc.deallocate(p);  // wrong: the last use was on s2, not recorded
  }
  void* q = env.alloc.allocate(64 * MiB, 1, as_stream(s1));
  CHECK(q == p);  // reused on its own stream...
  dev.launch(s1, 10, {device_writes(q, 64 * MiB, 1, 0x11)});
  dev.open(hold);
  dev.run_until_idle();
  if (stream_ordered) {
    // ...behind an event wait on s2: no race, s1's write lands last.
    CHECK(dev.fault_count() == 0);
    CHECK(dev.value_at(simulated_platform::device_address(q, 1)) == std::uint8_t{0x11});
  } else {
    // The control: without the stream-ordered free the simulated device sees the race.
    CHECK(dev.fault_count() > 0);
  }
  env.alloc.deallocate(q);
}

TEST_CASE("empty_cache and reclaim cover every device", "[frontend]") {
  two_devices env;
  env.alloc.deallocate(env.alloc.allocate(3 * MiB, 0, nullptr));
  env.alloc.deallocate(env.alloc.allocate(30 * MiB, 1, nullptr));
  CHECK(env.alloc.stats(0).reserved_bytes.current > 0);
  CHECK(env.alloc.stats(1).reserved_bytes.current > 0);
  const std::size_t released = env.alloc.empty_cache();
  CHECK(released >= 33 * MiB);
  CHECK(env.alloc.stats(0).reserved_bytes.current == 0);
  CHECK(env.alloc.stats(1).reserved_bytes.current == 0);
  CHECK(env.alloc.reclaim() == 0);
}

TEST_CASE("notify_stream_destroyed reaches the allocator of the stream's device", "[frontend]") {
  two_devices env;
  sim::simulated_device& dev = env.platform.device(0);
  const stream_handle s = dev.create_stream();
  env.alloc.deallocate(env.alloc.allocate(MiB, as_stream(s)));
  const auto before = env.alloc.stats(0).events_recorded;
  env.alloc.notify_stream_destroyed(as_stream(s));  // simulated: the current device's stream
  CHECK(env.alloc.stats(0).events_recorded == before + 1);  // the tombstone event
  env.alloc.notify_stream_destroyed(nullptr);               // special handles: ignored
  env.alloc.notify_stream_destroyed(cudaStreamPerThread);
  CHECK(env.alloc.stats(0).events_recorded == before + 1);
  dev.destroy_stream(s);
  env.alloc.deallocate(env.alloc.allocate(MiB, nullptr));
  CHECK(env.alloc.empty_cache() > 0);
}

TEST_CASE("Threads allocating and freeing across devices keep every allocator consistent",
          "[frontend]") {
  two_devices env;
  constexpr int threads = 4;
  constexpr int rounds = 400;
  std::atomic<int> errors{0};
  std::mutex message_mutex;
  std::string message;  // the first error (Catch2 assertions are not thread-safe)
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t + 1));
      std::vector<void*> live;
      simulated_platform::set_current_device(t % 2);
      try {
        for (int i = 0; i < rounds; ++i) {
          const std::size_t bytes = std::size_t{512} << (rng() % 12);
          if (live.size() < 8 && rng() % 3 != 0) {
            live.push_back(env.alloc.allocate(bytes, static_cast<int>(rng() % 2), nullptr));
          } else if (!live.empty()) {
            simulated_platform::set_current_device(static_cast<int>(rng() % 2));
            env.alloc.deallocate(live.back());
            live.pop_back();
          }
        }
        for (void* p : live) env.alloc.deallocate(p);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lk(message_mutex);
        if (errors++ == 0) message = e.what();
      }
    });
  }
  for (auto& th : pool) th.join();
  INFO(message);
  CHECK(errors == 0);
  for (int d = 0; d < 2; ++d) {
    CHECK(env.alloc.stats(d).allocated_bytes.current == 0);
    env.alloc.device_allocator(d).check_invariants();
  }
}

TEST_CASE("The process allocator reads STREAMSAFE_ALLOC_CONF once", "[frontend]") {
  // instance() is created on the first call in this process; its options are whatever the
  // environment said then (normally nothing: the defaults).
  const options& o = allocator::instance().config();
  CHECK(o.to_string() == options::from_environment().to_string());
  CHECK(&allocator::instance() == &allocator::instance());
  if (streamsafe::test::gpu_count() == 0) {
    CHECK(allocator::instance().device_count() == 0);
    CHECK_THROWS_AS(allocator::instance().allocate(512, 0, nullptr), streamsafe::backend_error);
  }
}
