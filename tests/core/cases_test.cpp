// Failure cases from the field (shared/cases/CASES.md), on the simulated device.
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <random>
#include <thread>

using namespace streamsafe;
using namespace streamsafe::test;

TEST_CASE("K2: unmap on free never runs before the stream's work, 200 times", "[core][cases][K2]") {
  sim_env env(make_options(backend_kind::expandable), sim_config(4 * GiB));
  auto s = env.dev.create_stream();
  for (int i = 0; i < 200; ++i) {
    void* p = env.alloc.allocate(56 * MiB, s);
    env.dev.launch(s, 5000, {writes(p, 56 * MiB)}, "5 ms write");
    env.alloc.deallocate(p);
    env.alloc.empty_cache();
    CHECK(env.alloc.stats().reserved_bytes.current == 0);
  }
  CHECK(env.dev.fault_count() == 0);
  CHECK(env.dev.now_us() >= 200 * 5000);  // the host waited for each write
  CHECK(env.alloc.stats().num_sync_all_streams == 0);
}

TEST_CASE(
    "K2: the same release under the allocation_stream scope faults when another stream uses the "
    "memory",
    "[core][cases][K2]") {
  // Proof that the K2 check can fail: a use on a second stream, without record_stream.
  sim_env env(make_options(backend_kind::expandable, fence_scope::allocation_stream),
              sim_config(4 * GiB));
  auto s = env.dev.create_stream();
  auto t = env.dev.create_stream();
  env.alloc.allocate(4 * KiB, t);  // t is a stream the allocator has seen
  void* p = env.alloc.allocate(56 * MiB, s);
  auto ev = env.dev.create_event();
  env.dev.record_event(ev, s);
  env.dev.stream_wait_event(t, ev);
  env.dev.launch(t, 5000, {reads(p, 56 * MiB)}, "5 ms read on t");
  env.alloc.deallocate(p);
  env.alloc.empty_cache();
  CHECK(env.dev.fault_count() == 1);
  CHECK(env.dev.faults().front().kind == sim::fault_kind::release_under_pending_work);
}

TEST_CASE(
    "K2: a bulk release twice in a row under a hold defers, then is a no-op, never a driver error",
    "[core][cases][K2]") {
  sim_env env(
      make_options(backend_kind::expandable, fence_scope::all_streams, empty_cache_mode::defer),
      sim_config(4 * GiB));
  auto s = env.dev.create_stream();
  auto t = env.dev.create_stream();
  env.alloc.allocate(4 * KiB, t);
  void* p = env.alloc.allocate(56 * MiB, s);
  auto ev = env.dev.create_event();
  env.dev.record_event(ev, s);
  env.dev.stream_wait_event(t, ev);
  auto h = env.dev.hold(t);
  env.dev.launch(t, 10, {reads(p, 56 * MiB)}, "read behind the hold, no record_stream");
  env.alloc.deallocate(p);
  CHECK(env.alloc.empty_cache() == 0);
  CHECK(env.alloc.pending_release_bytes() == 56 * MiB);  // chunks of 20, 20 and 16 MiB
  CHECK(env.alloc.empty_cache() == 0);  // second bulk release: nothing new, no error
  CHECK(env.alloc.stats().releases_deferred == 1);
  CHECK(env.dev.counters().unmaps == 0);
  env.dev.open(h);
  env.dev.run_until_idle();
  CHECK(env.alloc.reclaim() == 56 * MiB);
  CHECK(env.alloc.empty_cache() == 0);
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}

TEST_CASE("K3: a cached block moved between streams carries the ordering of its last use",
          "[core][cases][K3]") {
  options o;
  o.memory_limit_bytes = 64 * MiB;
  sim_env env(o);
  auto a = env.dev.create_stream();
  auto b = env.dev.create_stream();
  auto c = env.dev.create_stream();
  auto h = env.dev.hold(a);
  void* x = env.alloc.allocate(40 * MiB, a);
  env.dev.launch(a, 10, {writes(x, 40 * MiB, 0xAA)}, "write 0xAA on A");
  env.alloc.deallocate(x, a);
  void* on_b = env.alloc.allocate(40 * MiB, b);  // only reachable by taking A's cached block
  CHECK(on_b == x);
  env.alloc.deallocate(on_b);
  void* y = env.alloc.allocate(40 * MiB, c);
  CHECK(y == x);
  env.dev.launch(c, 10, {writes(y, 40 * MiB, 0xCC)}, "write 0xCC on C");
  env.dev.open(h);
  env.dev.run_until_idle();
  CHECK(env.dev.value_at(addr(y)) == std::optional<std::uint8_t>(0xCC));
  CHECK(env.dev.fault_count() == 0);
  CHECK(env.alloc.stats().segments_moved == 2);
  CHECK(env.dev.counters().segment_allocs == 1);
  env.alloc.deallocate(y);
  env.alloc.check_invariants();
}

TEST_CASE("K4: a block freed at enqueue time on S1 reaches S2 only behind a wait on S1",
          "[core][cases][K4]") {
  options o;
  o.memory_limit_bytes = 40 * MiB;
  sim_env env(o);
  auto s1 = env.dev.create_stream();
  auto s2 = env.dev.create_stream();
  SECTION("allocated on S1: S2 gets another block or an ordered one") {
    void* p = env.alloc.allocate(30 * MiB, s1);
    auto h = env.dev.hold(s1);
    env.dev.launch(s1, 10, {reads(p, 30 * MiB)}, "read on S1");
    env.alloc.deallocate(p, s1);
    void* q = env.alloc.allocate(30 * MiB, s2);
    env.dev.launch(s2, 10, {writes(q, 30 * MiB)}, "write on S2");
    env.dev.open(h);
    env.dev.run_until_idle();
    CHECK(env.dev.fault_count() == 0);
    env.alloc.deallocate(q);
  }
  SECTION("allocated on S2, freed stream-ordered on S1: S2 reuses it with a wait") {
    void* p = env.alloc.allocate(30 * MiB, s2);
    auto ev = env.dev.create_event();
    env.dev.record_event(ev, s2);
    env.dev.stream_wait_event(s1, ev);
    auto h = env.dev.hold(s1);
    env.dev.launch(s1, 10, {reads(p, 30 * MiB)}, "read on S1");
    env.alloc.deallocate(p, s1);
    void* q = env.alloc.allocate(30 * MiB, s2);
    CHECK(q == p);
    CHECK(env.alloc.stats().stream_waits == 1);
    env.dev.launch(s2, 10, {writes(q, 30 * MiB)}, "write on S2");
    env.dev.open(h);
    env.dev.run_until_idle();
    CHECK(env.dev.fault_count() == 0);
    env.alloc.deallocate(q);
  }
  env.alloc.check_invariants();
}

TEST_CASE("K7: bad frees are clear errors that change nothing, and the allocator keeps working",
          "[core][cases][K7]") {
  sim::simulated_device dev0(sim_config(8 * GiB, 0));
  sim::simulated_device dev1(sim_config(8 * GiB, 1));
  caching_allocator a0(dev0, options{});
  caching_allocator a1(dev1, options{});
  void* p = a0.allocate(512, 0);
  void* q = a0.allocate(512, 0);
  a0.deallocate(p);
  const std::string before = a0.stats().to_string();
  REQUIRE_THROWS_AS(a0.deallocate(p), invalid_pointer);
  REQUIRE_THROWS_WITH(a0.deallocate(p), Catch::Contains("double free"));
  REQUIRE_THROWS_WITH(a0.deallocate(static_cast<char*>(q) + 256),
                      Catch::Contains("interior pointer") && Catch::Contains("256 bytes into"));
  REQUIRE_THROWS_WITH(a0.deallocate(reinterpret_cast<void*>(0x1234000)),
                      Catch::Contains("unknown pointer"));
  REQUIRE_THROWS_WITH(a1.deallocate(q),
                      Catch::Contains("unknown pointer") && Catch::Contains("device 1"));
  REQUIRE_THROWS_AS(a0.record_stream(p, 0), invalid_pointer);
  CHECK(a0.stats().to_string() == before);
  a0.check_invariants();
  a0.deallocate(q);
  a0.check_invariants();
  void* r1 = a0.allocate(512, 0);
  void* r2 = a0.allocate(512, 0);
  CHECK(r1 != r2);
  a0.deallocate(r1);
  a0.deallocate(r2);
}

TEST_CASE("K7: an injected backend failure on the free path leaves the block live and no lock held",
          "[core][cases][K7]") {
  sim_env env;
  auto s1 = env.dev.create_stream();
  auto s2 = env.dev.create_stream();
  void* p = env.alloc.allocate(4 * KiB, s1);
  env.alloc.record_stream(p, s2);
  const std::string before = env.alloc.stats().to_string();
  env.dev.fail_next(sim::call::record_event);
  REQUIRE_THROWS_AS(env.alloc.deallocate(p), backend_error);
  CHECK(env.alloc.stats().to_string() == before);
  CHECK(env.alloc.find_block(p).size_bytes == 4 * KiB);
  std::atomic<bool> done{false};
  std::thread other([&] {
    void* q = env.alloc.allocate(4 * KiB, s2);
    env.alloc.deallocate(q);
    done = true;
  });
  other.join();
  CHECK(done);
  env.alloc.deallocate(p);  // the retry succeeds
  env.alloc.check_invariants();
  CHECK(env.alloc.stats().allocated_bytes.current == 0);
}

namespace {

// K10's working set: the same 200 sizes every step, 4 KiB to 64 MiB.
std::vector<std::size_t> working_set() {
  std::mt19937_64 rng(10);
  std::vector<std::size_t> sizes;
  for (int i = 0; i < 200; ++i) {
    const int shift = 12 + static_cast<int>(rng() % 15);  // 4 KiB .. 64 MiB
    sizes.push_back((std::size_t{1} << shift) + (rng() % 4096));
  }
  return sizes;
}

}  // namespace

TEST_CASE("K10: synchronising the stream never releases cache; empty_cache costs what it releases",
          "[core][cases][K10]") {
  const auto sizes = working_set();
  sim_env env(options{}, sim_config(64 * GiB));
  auto s = env.dev.create_stream();
  std::vector<void*> live;
  auto one_step = [&] {
    for (auto size : sizes) {
      live.push_back(env.alloc.allocate(size, s));
      env.dev.launch(s, 1, {writes(live.back(), size)});
    }
    for (void* p : live) env.alloc.deallocate(p);
    live.clear();
    env.dev.synchronize_device();
  };
  for (int i = 0; i < 10; ++i) one_step();  // warm-up: the cache settles in a few steps (6 here)
  const auto warm = env.dev.counters();
  for (int step = 0; step < 1000; ++step) one_step();
  CHECK(env.dev.counters().segment_allocs == warm.segment_allocs);  // run 1: no driver calls
  CHECK(env.dev.counters().segment_frees == 0);

  std::uint64_t released = 0;
  for (int step = 0; step < 20; ++step) {  // run 2: empty_cache every step releases all it holds
    one_step();
    const auto reserved = static_cast<std::size_t>(env.alloc.stats().reserved_bytes.current);
    const auto frees_before = env.dev.counters().segment_frees;
    CHECK(env.alloc.empty_cache() == reserved);
    CHECK(env.alloc.stats().reserved_bytes.current == 0);
    CHECK(env.dev.counters().segment_frees - frees_before ==
          static_cast<std::uint64_t>(env.alloc.stats().segment.freed) - released);
    released = static_cast<std::uint64_t>(env.alloc.stats().segment.freed);
  }
  CHECK(env.dev.fault_count() == 0);
}

TEST_CASE("K10: empty_cache under a hold skips the busy blocks and never releases them early",
          "[core][cases][K10]") {
  sim_env env(
      make_options(backend_kind::cuda_malloc, fence_scope::all_streams, empty_cache_mode::defer));
  auto s = env.dev.create_stream();
  auto busy = env.dev.create_stream();
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(env.alloc.allocate(30 * MiB, s));
  auto ev = env.dev.create_event();
  env.dev.record_event(ev, s);
  env.dev.stream_wait_event(busy, ev);
  auto h = env.dev.hold(busy);
  for (int i = 0; i < 4; ++i) {
    env.dev.launch(busy, 10, {reads(blocks[i], 30 * MiB)}, "busy read");
    env.alloc.record_stream(blocks[i], busy);
  }
  for (void* p : blocks) env.alloc.deallocate(p);
  env.alloc.empty_cache();  // the four idle blocks' fence covers `busy` too: deferred, not released
  CHECK(env.dev.fault_count() == 0);
  CHECK(env.dev.counters().segment_frees == 0);
  env.dev.open(h);
  env.dev.run_until_idle();
  env.alloc.empty_cache();
  CHECK(env.alloc.stats().reserved_bytes.current == 0);
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}
