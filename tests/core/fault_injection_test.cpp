// Fault injection: every backend call the allocator makes can fail (simulated_device::fail_next),
// and after each failure the public call reports the documented error (backend_error naming the
// call, or out_of_memory where the driver said "no memory"), check_invariants() passes, the
// statistics are unchanged (or moved only as documented), reserved bytes still equal the device
// memory in use, the next call succeeds, and at the end everything frees, empty_cache brings
// reserved bytes to zero and the allocator gives back every event it created.
//
// Each scenario runs for both backends (where the call belongs to it) and both empty_cache modes.
#include "support/fault_injection_env.hpp"
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <streamsafe/core/errors.hpp>

#include <optional>
#include <string>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;

TEST_CASE(
    "A failing segment allocation or chunk map is an out-of-memory: retried once, then "
    "out_of_memory",
    "[core][fault-injection]") {
  for (const variant& v : all_variants) {
    INFO(describe(v));
    const sim::call call = v.backend == backend_kind::expandable ? sim::call::map
                                                                 : sim::call::allocate_segment;
    fi_env env(opts(v));
    void* keep = env.a().allocate(4 * KiB, 0);
    // One failure: the allocator releases what it can and retries, and the retry succeeds.
    env.dev.fail_next(call, 1);
    void* p = env.a().allocate(30 * MiB, 0);
    CHECK(env.a().stats().num_alloc_retries == 1);
    env.check_consistent();
    // Persistent failure: out_of_memory with the state of the allocator, nothing changed.
    const auto before = env.a().stats();
    env.dev.fail_next(call, 1000);
    try {
      env.a().allocate(50 * MiB, 0);
      FAIL("expected out_of_memory");
    } catch (const out_of_memory& e) {
      CHECK(std::string(e.what()).find("out of memory") != std::string::npos);
    }
    env.dev.fail_next(call, 0);
    const auto after = env.a().stats();
    CHECK(after.num_ooms == before.num_ooms + 1);
    CHECK(after.allocated_bytes.current == before.allocated_bytes.current);
    CHECK(after.allocation.current == before.allocation.current);
    env.check_consistent();
    // The next call succeeds.
    void* q = env.a().allocate(50 * MiB, 0);
    env.check_consistent();
    env.drain({keep, p, q});
  }
}

TEST_CASE("A failing address-range reservation is a backend_error that changes nothing",
          "[core][fault-injection]") {
  for (auto mode : {empty_cache_mode::wait, empty_cache_mode::defer}) {
    fi_env env(opts({backend_kind::expandable, mode}));
    const std::string before = env.a().stats().to_string();
    env.dev.fail_next(sim::call::reserve_address_range, 1);
    require_backend_error([&] { env.a().allocate(3 * MiB, 0); }, "reserve_address_range");
    CHECK(env.a().stats().to_string() == before);
    env.check_consistent();
    void* p = env.a().allocate(3 * MiB, 0);
    env.check_consistent();
    env.drain({p});
  }
}

TEST_CASE(
    "A failing free_segment or unmap keeps the memory cached, reserved and reusable; the next "
    "empty_cache releases it",
    "[core][fault-injection]") {
  for (const variant& v : all_variants) {
    INFO(describe(v));
    const bool expandable = v.backend == backend_kind::expandable;
    const sim::call call = expandable ? sim::call::unmap : sim::call::free_segment;
    fi_env env(opts(v));
    auto s = seen_stream(env);
    void* p = env.a().allocate(6 * MiB, s);
    void* keep = env.a().allocate(4 * KiB, 0);
    env.a().deallocate(p);
    const auto before = env.a().stats();
    env.dev.fail_next(call, 1);
    require_backend_error([&] { env.a().empty_cache(); }, expandable ? "unmap" : "free_segment");
    env.dev.fail_next(call, 0);
    const auto after = env.a().stats();
    CHECK(after.allocated_bytes.current == before.allocated_bytes.current);
    CHECK(after.bytes_released + static_cast<std::uint64_t>(after.reserved_bytes.current) ==
          before.bytes_released + static_cast<std::uint64_t>(before.reserved_bytes.current));
    env.check_consistent();
    // What was not released is still usable, and releasable later.
    void* again = env.a().allocate(6 * MiB, s);
    env.dev.launch(s, 10, {writes(again, 6 * MiB)});
    env.a().deallocate(again);
    env.a().empty_cache(empty_cache_mode::wait);
    env.check_consistent();
    CHECK(env.a().stats().reserved_bytes.current == static_cast<std::int64_t>(2 * MiB));  // keep's
    env.drain({keep});
  }
}

TEST_CASE(
    "A failing event creation or record on the free path leaves the block live and the statistics "
    "unchanged",
    "[core][fault-injection]") {
  for (const variant& v : all_variants) {
    for (sim::call call : {sim::call::create_event, sim::call::record_event}) {
      const char* name = call == sim::call::create_event ? "create_event" : "record_event";
      INFO(describe(v) << " " << name);
      fi_env env(opts(v));
      auto s1 = env.dev.create_stream();
      auto s2 = env.dev.create_stream();
      void* p = env.a().allocate(64 * KiB, s1);
      void* q = env.a().allocate(64 * KiB, s1);
      env.a().record_stream(p, s2);
      const std::string before = env.a().stats().to_string();
      // Host free with a recorded use.
      env.dev.fail_next(call, 1);
      require_backend_error([&] { env.a().deallocate(p); }, name);
      CHECK(env.a().stats().to_string() == before);
      CHECK(env.a().find_block(p).size_bytes == 64 * KiB);
      env.check_consistent();
      // Stream-ordered free on another stream.
      env.dev.fail_next(call, 1);
      require_backend_error([&] { env.a().deallocate(q, s2); }, name);
      CHECK(env.a().stats().to_string() == before);
      CHECK(env.a().find_block(q).size_bytes == 64 * KiB);
      env.check_consistent();
      // The next calls succeed.
      env.a().deallocate(p);
      env.a().deallocate(q, s2);
      env.check_consistent();
      env.drain({});
    }
  }
}

TEST_CASE("A failing event creation or record for the release fence keeps the cache intact",
          "[core][fault-injection]") {
  for (const variant& v : all_variants) {
    for (sim::call call : {sim::call::create_event, sim::call::record_event}) {
      const char* name = call == sim::call::create_event ? "create_event" : "record_event";
      INFO(describe(v) << " " << name);
      fi_env env(opts(v));
      auto s1 = seen_stream(env);
      seen_stream(env);
      void* p = env.a().allocate(6 * MiB, s1);
      env.dev.launch(s1, 100, {writes(p, 6 * MiB)});
      env.a().deallocate(p);
      const auto before = env.a().stats();
      // The fence needs one event per stream: the first (creation) or the second (record) fails.
      env.dev.fail_next(call, call == sim::call::create_event ? 100 : 1);
      require_backend_error([&] { env.a().empty_cache(); }, name);
      env.dev.fail_next(call, 0);
      const auto after = env.a().stats();
      CHECK(after.reserved_bytes.current == before.reserved_bytes.current);
      CHECK(after.allocated_bytes.current == before.allocated_bytes.current);
      CHECK(env.a().pending_release_bytes() == 0);
      env.check_consistent();
      CHECK(env.a().empty_cache(empty_cache_mode::wait) > 0);
      env.check_consistent();
      env.drain({});
    }
  }
}

TEST_CASE(
    "A failing host wait on the release fence puts the memory back and a later empty_cache "
    "releases it",
    "[core][fault-injection]") {
  for (const variant& v : all_variants) {
    for (fence_scope scope :
         {fence_scope::all_streams, fence_scope::used_streams, fence_scope::device}) {
      INFO(describe(v) << " " << to_string(scope));
      const bool device = scope == fence_scope::device;
      const sim::call call = device ? sim::call::synchronize_device : sim::call::synchronize_event;
      fi_env env(opts(v, scope));
      auto s = seen_stream(env);
      void* p = env.a().allocate(6 * MiB, s);
      env.dev.launch(s, 500, {writes(p, 6 * MiB)}, "write still running at release");
      env.a().deallocate(p);
      const auto before = env.a().stats();
      env.dev.fail_next(call, 1);
      require_backend_error([&] { env.a().empty_cache(empty_cache_mode::wait); },
                            device ? "synchronize_device" : "synchronize_event");
      env.dev.fail_next(call, 0);
      const auto after = env.a().stats();
      CHECK(after.reserved_bytes.current == before.reserved_bytes.current);
      CHECK(after.allocated_bytes.current == before.allocated_bytes.current);
      env.check_consistent();
      CHECK(env.dev.fault_count() == 0);
      CHECK(env.a().empty_cache(empty_cache_mode::wait) > 0);
      env.check_consistent();
      env.drain({});
    }
  }
}

TEST_CASE(
    "A failing stream wait when reusing a block freed behind other streams leaves it pending; the "
    "next allocation succeeds",
    "[core][fault-injection]") {
  for (const variant& v : all_variants) {
    INFO(describe(v));
    fi_env env(opts(v));
    auto s1 = env.dev.create_stream();
    auto s2 = env.dev.create_stream();
    void* p = env.a().allocate(6 * MiB, s1);
    auto h = env.dev.hold(s2);
    env.dev.launch(s2, 10, {reads(p, 6 * MiB)}, "read on s2 behind a hold");
    env.a().record_stream(p, s2);
    env.a().deallocate(p);
    const std::string before = env.a().stats().to_string();
    env.dev.fail_next(sim::call::stream_wait_event, 1);
    // The allocation may take another block (growth) or fail trying to wait: either way the
    // pending block stays pending and nothing races.
    void* q = nullptr;
    try {
      q = env.a().allocate(6 * MiB, s1);
    } catch (const backend_error& e) {
      CHECK(std::string(e.what()).find("stream_wait_event") != std::string::npos);
      CHECK(env.a().stats().allocated_bytes.current == 0);
    }
    env.dev.fail_next(sim::call::stream_wait_event, 0);
    env.check_consistent();
    if (!q) q = env.a().allocate(6 * MiB, s1);
    env.dev.launch(s1, 10, {writes(q, 6 * MiB)}, "new owner writes");
    CHECK(env.dev.fault_count() == 0);
    env.dev.open(h);
    env.check_consistent();
    env.drain({q});
  }
}

TEST_CASE("A failing stream wait when moving a free segment to another stream changes nothing",
          "[core][fault-injection]") {
  for (auto mode : {empty_cache_mode::wait, empty_cache_mode::defer}) {
    options o = opts({backend_kind::cuda_malloc, mode});
    o.memory_limit_bytes = 40 * MiB;
    fi_env env(o);
    auto a = env.dev.create_stream();
    auto b = env.dev.create_stream();
    auto h = env.dev.hold(a);
    void* x = env.a().allocate(30 * MiB, a);
    env.dev.launch(a, 10, {writes(x, 30 * MiB)}, "write on A behind a hold");
    env.a().deallocate(x);
    env.dev.fail_next(sim::call::stream_wait_event, 1);
    void* y = nullptr;
    try {
      y = env.a().allocate(30 * MiB, b);  // only reachable by moving A's free segment to B
    } catch (const backend_error& e) {
      CHECK(std::string(e.what()).find("stream_wait_event") != std::string::npos);
    }
    env.dev.fail_next(sim::call::stream_wait_event, 0);
    env.check_consistent();
    if (!y) {
      CHECK(env.a().stats().allocated_bytes.current == 0);
      y = env.a().allocate(30 * MiB, b);
    }
    env.dev.launch(b, 10, {writes(y, 30 * MiB)}, "write on B");
    CHECK(env.dev.fault_count() == 0);
    env.dev.open(h);
    env.drain({y});
  }
}

TEST_CASE(
    "A failing record when a stream is announced destroyed leaves it known; the retry succeeds",
    "[core][fault-injection][cases][K6]") {
  for (const variant& v : all_variants) {
    for (sim::call call : {sim::call::create_event, sim::call::record_event}) {
      INFO(describe(v));
      fi_env env(opts(v));
      auto s = seen_stream(env);
      void* p = env.a().allocate(1 * MiB, s);
      env.dev.launch(s, 100, {writes(p, 1 * MiB)});
      env.a().deallocate(p);
      const std::string before = env.a().stats().to_string();
      env.dev.fail_next(call, 1);
      require_backend_error([&] { env.a().notify_stream_destroyed(s); },
                            call == sim::call::create_event ? "create_event" : "record_event");
      CHECK(env.a().stats().to_string() == before);
      env.check_consistent();
      env.a().notify_stream_destroyed(s);
      env.dev.destroy_stream(s);
      env.a().empty_cache(empty_cache_mode::wait);  // must not touch the destroyed stream
      env.check_consistent();
      env.drain({});
    }
  }
}

TEST_CASE("A failing event query while polling pending blocks is a backend_error; nothing is lost",
          "[core][fault-injection]") {
  for (const variant& v : all_variants) {
    INFO(describe(v));
    fi_env env(opts(v));
    auto s1 = env.dev.create_stream();
    auto s2 = env.dev.create_stream();
    void* p = env.a().allocate(64 * KiB, s1);
    env.dev.launch(s2, 10, {reads(p, 64 * KiB)});
    env.a().record_stream(p, s2);
    env.a().deallocate(p);  // pending on s2's event
    env.dev.run_until_idle();
    env.dev.fail_next(sim::call::query_event, 1);
    try {
      env.a().reclaim();
    } catch (const backend_error& e) {
      CHECK(std::string(e.what()).find("query_event") != std::string::npos);
    }
    env.dev.fail_next(sim::call::query_event, 0);
    env.check_consistent();
    env.a().reclaim();
    CHECK(env.a().stats().active_bytes.current == 0);
    env.drain({});
  }
}

TEST_CASE(
    "A failing event query while empty_cache polls the release fence does not lose the detached "
    "memory",
    "[core][fault-injection]") {
  // release_cached() once lost the detached batch when query_event threw after the fence was
  // recorded: the memory stayed reserved for good (found by the seeded fuzz run, seed 2, op 931;
  // fixed in the core). Both backends and modes.
  for (const variant& v : all_variants) {
    INFO(describe(v));
    fi_env env(opts(v));
    seen_stream(env);
    void* p = env.a().allocate(4 * KiB, 0);
    env.a().deallocate(p);
    for (int count : {1, 2, 3}) {
      env.dev.fail_next(sim::call::query_event, count);
      try {
        env.a().empty_cache();
      } catch (const backend_error& e) {
        CHECK(std::string(e.what()).find("query_event") != std::string::npos);
      }
      env.dev.fail_next(sim::call::query_event, 0);
      env.check_consistent();
    }
    env.a().empty_cache(empty_cache_mode::wait);
    CHECK(env.a().stats().reserved_bytes.current == 0);
    CHECK(env.dev.bytes_in_use() == 0);
    env.drain({});
  }
}
