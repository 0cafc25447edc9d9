// Bad input: bad pointers (case K7), sizes 0 and near SIZE_MAX, tiny limits, destroyed and
// recycled streams (case K6), and calls while the runtime is going away at process exit.
// Every bad call is a clear, documented error that leaves the allocator's state and statistics
// as they were. Regression tests of the defects the fuzz runs found are at the end.
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <streamsafe/core/errors.hpp>

#include <sys/wait.h>
#include <unistd.h>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

constexpr std::size_t size_max = std::numeric_limits<std::size_t>::max();

const sim::call every_call[] = {sim::call::allocate_segment,
                                sim::call::free_segment,
                                sim::call::reserve_address_range,
                                sim::call::release_address_range,
                                sim::call::map,
                                sim::call::unmap,
                                sim::call::create_event,
                                sim::call::record_event,
                                sim::call::query_event,
                                sim::call::synchronize_event,
                                sim::call::stream_wait_event,
                                sim::call::synchronize_device};

// Runs body in a child process (fork) and returns how it ended: "exit N", "signal N" or
// "hang" (killed after timeout). For calls that may hang or crash the process.
template <class F>
std::string run_in_child(F&& body, std::chrono::milliseconds timeout) {
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    body();
    std::_Exit(0);
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return "hang";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "signal " + std::to_string(WTERMSIG(status));
  return "unknown";
}

}  // namespace

// ---- K7: bad pointers -----------------------------------------------------------------------

TEST_CASE("K7: every kind of bad free and record_stream is invalid_pointer and changes nothing",
          "[core][bad-input][cases][K7]") {
  for (auto backend : {backend_kind::cuda_malloc, backend_kind::expandable}) {
    INFO(to_string(backend));
    sim_env env(make_options(backend));
    auto s1 = env.dev.create_stream();
    auto s2 = env.dev.create_stream();
    void* p = env.alloc.allocate(512, s1);
    void* q = env.alloc.allocate(4 * KiB, s1);
    void* pending = env.alloc.allocate(4 * KiB, s1);
    auto h = env.dev.hold(s2);
    env.dev.launch(s2, 10, {reads(pending, 4 * KiB)}, "read behind a hold");
    env.alloc.record_stream(pending, s2);
    env.alloc.deallocate(pending);  // freed, waiting for s2
    env.alloc.deallocate(p);        // freed, cached
    const std::string before = env.alloc.stats().to_string();
    struct bad {
      void* ptr;
      const char* says;
    };
    const bad cases[] = {
        {p, "double free"},                                 // cached
        {pending, "double free"},                           // waiting for its stream uses
        {static_cast<char*>(q) + 512, "interior pointer"},  // inside a live block
        {static_cast<char*>(q) + 1, "interior pointer"},    // unaligned, inside
        {static_cast<char*>(q) + 4 * KiB, ""},              // one past the end: not q's
        {reinterpret_cast<void*>(0x1234000), "unknown pointer"},
        {reinterpret_cast<void*>(size_max & ~std::uintptr_t{511}), "unknown pointer"},
    };
    for (const bad& b : cases) {
      INFO("pointer " << b.ptr);
      for (int call = 0; call < 3; ++call) {
        try {
          if (call == 0) env.alloc.deallocate(b.ptr);
          else if (call == 1) env.alloc.deallocate(b.ptr, s2);
          else env.alloc.record_stream(b.ptr, s2);
          FAIL("a bad pointer was accepted");
        } catch (const invalid_pointer& e) {
          CHECK(std::string(e.what()).find(b.says) != std::string::npos);
          CHECK(std::string(e.what()).find("device 0") != std::string::npos);
        }
        CHECK(env.alloc.stats().to_string() == before);
      }
    }
    // nullptr: rejected as unknown, or ignored as cudaFree and free() do; either way nothing
    // changes.
    for (int call = 0; call < 3; ++call) {
      try {
        if (call == 0) env.alloc.deallocate(nullptr);
        else if (call == 1) env.alloc.deallocate(nullptr, s2);
        else env.alloc.record_stream(nullptr, s2);
      } catch (const invalid_pointer& e) {
        CHECK(std::string(e.what()).find("unknown pointer") != std::string::npos);
      }
      CHECK(env.alloc.stats().to_string() == before);
    }
    env.alloc.check_invariants();
    // The allocator keeps working: two new allocations differ, and the good frees succeed.
    void* r1 = env.alloc.allocate(512, s1);
    void* r2 = env.alloc.allocate(512, s1);
    CHECK(r1 != r2);
    for (void* r : {r1, r2, q}) env.alloc.deallocate(r);
    env.dev.open(h);
    env.dev.run_until_idle();
    env.alloc.empty_cache(empty_cache_mode::wait);
    CHECK(env.alloc.stats().reserved_bytes.current == 0);
    CHECK(env.dev.fault_count() == 0);
  }
}

TEST_CASE("K7: a stream-ordered double free is rejected like a host double free",
          "[core][bad-input][cases][K7]") {
  sim_env env;
  auto s1 = env.dev.create_stream();
  auto s2 = env.dev.create_stream();
  void* p = env.alloc.allocate(64 * KiB, s1);
  env.alloc.deallocate(p, s2);
  const std::string before = env.alloc.stats().to_string();
  REQUIRE_THROWS_WITH(env.alloc.deallocate(p, s2), Catch::Contains("double free"));
  REQUIRE_THROWS_WITH(env.alloc.deallocate(p), Catch::Contains("double free"));
  CHECK(env.alloc.stats().to_string() == before);
  env.alloc.check_invariants();
}

TEST_CASE(
    "K7: a pointer of one device's allocator is unknown to another's, and the owner still frees it",
    "[core][bad-input][cases][K7]") {
  sim::simulated_device dev0(sim_config(8 * GiB, 0));
  sim::simulated_device dev1(sim_config(8 * GiB, 1));
  caching_allocator a0(dev0, options{});
  caching_allocator a1(dev1, options{});
  void* p0 = a0.allocate(1 * MiB, 0);
  void* p1 = a1.allocate(1 * MiB, 0);
  const std::string s0 = a0.stats().to_string(), s1 = a1.stats().to_string();
  REQUIRE_THROWS_WITH(a1.deallocate(p0),
                      Catch::Contains("unknown pointer") && Catch::Contains("device 1"));
  REQUIRE_THROWS_WITH(a0.deallocate(p1),
                      Catch::Contains("unknown pointer") && Catch::Contains("device 0"));
  REQUIRE_THROWS_AS(a1.record_stream(p0, 0), invalid_pointer);
  CHECK(a0.stats().to_string() == s0);
  CHECK(a1.stats().to_string() == s1);
  a0.deallocate(p0);
  a1.deallocate(p1);
  a0.check_invariants();
  a1.check_invariants();
}

// ---- sizes ------------------------------------------------------------------------------------

TEST_CASE("Size 0 is invalid_size on every stream and backend, and changes nothing",
          "[core][bad-input]") {
  for (auto backend : {backend_kind::cuda_malloc, backend_kind::expandable}) {
    sim_env env(make_options(backend));
    auto s = env.dev.create_stream();
    const std::string before = env.alloc.stats().to_string();
    REQUIRE_THROWS_AS(env.alloc.allocate(0, 0), invalid_size);
    REQUIRE_THROWS_AS(env.alloc.allocate(0, s), invalid_size);
    CHECK(env.alloc.stats().to_string() == before);
    CHECK(env.dev.counters().segment_allocs == 0);
    CHECK(env.dev.counters().maps == 0);
  }
}

TEST_CASE(
    "Sizes near SIZE_MAX and beyond the limit are out_of_memory on both backends, without overflow",
    "[core][bad-input]") {
  for (auto backend : {backend_kind::cuda_malloc, backend_kind::expandable}) {
    INFO(to_string(backend));
    options o = make_options(backend);
    o.memory_limit_bytes = 1 * GiB;
    o.expandable_chunk_bytes = 2 * MiB;  // the limit is a whole number of chunks
    sim_env env(o);
    auto s = env.dev.create_stream();
    const std::size_t sizes[] = {
        size_max,     size_max - 1,     size_max - 511, size_max - 512,
        size_max / 2, size_max / 2 + 1, size_max / 4,   std::size_t{1} << 48,
        1 * GiB + 1,  1 * GiB + 512,    8 * GiB,        8 * GiB + 1};
    for (std::size_t size : sizes) {
      INFO("size " << size);
      for (stream_handle st : {stream_handle{0}, s}) {
        const auto before = env.alloc.stats();
        REQUIRE_THROWS_AS(env.alloc.allocate(size, st), out_of_memory);
        const auto after = env.alloc.stats();
        CHECK(after.num_ooms == before.num_ooms + 1);
        CHECK(after.allocated_bytes.current == before.allocated_bytes.current);
        CHECK(after.reserved_bytes.current == before.reserved_bytes.current);
      }
    }
    CHECK(env.dev.bytes_in_use() == 0);
    // Exactly the limit is a valid request.
    void* p = env.alloc.allocate(1 * GiB, s);
    CHECK(env.alloc.find_block(p).size_bytes == 1 * GiB);
    REQUIRE_THROWS_AS(env.alloc.allocate(1, s), out_of_memory);
    env.alloc.deallocate(p);
    void* small = env.alloc.allocate(1, s);
    env.alloc.deallocate(small);
    env.alloc.check_invariants();
    env.alloc.empty_cache(empty_cache_mode::wait);
    CHECK(env.alloc.stats().reserved_bytes.current == 0);
  }
}

TEST_CASE("A limit smaller than one segment makes every allocation out_of_memory, cleanly",
          "[core][bad-input]") {
  for (auto backend : {backend_kind::cuda_malloc, backend_kind::expandable}) {
    for (std::size_t limit : {std::size_t{1}, std::size_t{512}, 1 * MiB}) {
      INFO(to_string(backend) << " limit " << limit);
      options o = make_options(backend);
      o.memory_limit_bytes = limit;
      sim_env env(o);
      REQUIRE_THROWS_AS(env.alloc.allocate(1, 0), out_of_memory);
      REQUIRE_THROWS_AS(env.alloc.allocate(limit, 0), out_of_memory);
      env.alloc.check_invariants();
      CHECK(env.dev.bytes_in_use() == 0);
    }
  }
}

TEST_CASE("A memory fraction caps reserved bytes below the device total", "[core][bad-input]") {
  options o;
  o.memory_fraction = 0.25;
  sim_env env(o, sim_config(1 * GiB));
  REQUIRE_THROWS_AS(env.alloc.allocate(256 * MiB + 512, 0), out_of_memory);
  void* p = env.alloc.allocate(200 * MiB, 0);
  CHECK(env.alloc.stats().reserved_bytes.current <= static_cast<std::int64_t>(256 * MiB));
  env.alloc.deallocate(p);
}

// ---- K6: destroyed and recycled streams -------------------------------------------------------

TEST_CASE(
    "K6: streams destroyed while their kernels run; recycled handles inherit nothing without a "
    "wait",
    "[core][bad-input][cases][K6]") {
  for (auto backend : {backend_kind::cuda_malloc, backend_kind::expandable}) {
    for (auto mode : {empty_cache_mode::wait, empty_cache_mode::defer}) {
      INFO(to_string(backend) << "/" << to_string(mode));
      options o = make_options(backend, fence_scope::all_streams, mode);
      o.memory_limit_bytes = 512 * MiB;
      sim_env env(o);
      env.dev.set_reuse_stream_handles(true);
      std::vector<stream_handle> old;
      for (int i = 0; i < 8; ++i) {
        const stream_handle s = env.dev.create_stream();
        old.push_back(s);
        env.dev.launch(s, 1000000, {}, "a 1 s kernel, still running when the stream goes");
        for (int j = 0; j < 3; ++j) {
          void* p = env.alloc.allocate((1 + static_cast<std::size_t>(j)) * MiB, s);
          env.dev.launch(s, 100, {writes(p, (1 + static_cast<std::size_t>(j)) * MiB, 0x11)},
                         "old stream writes");
          env.alloc.deallocate(p);
        }
      }
      for (stream_handle s : old) {
        env.alloc.notify_stream_destroyed(s);
        env.dev.destroy_stream(s);
      }
      // A large block on the default stream, then the cache is released (deferred or waited).
      void* big = env.alloc.allocate(300 * MiB, 0);
      env.dev.launch(0, 10, {writes(big, 300 * MiB, 0x22)});
      env.alloc.empty_cache();  // wait: waits for the dead streams' last work; defer: queues
      CHECK(env.dev.fault_count() == 0);
      // Eight new streams, with the old handle values, allocate the same sizes and write.
      std::vector<void*> fresh;
      for (int i = 0; i < 8; ++i) {
        const stream_handle s = env.dev.create_stream();
        CHECK(s == old[static_cast<std::size_t>(i)]);
        for (int j = 0; j < 3; ++j) {
          const std::size_t n = (1 + static_cast<std::size_t>(j)) * MiB;
          void* p = nullptr;
          try {
            p = env.alloc.allocate(n, s);
          } catch (const out_of_memory&) {
            // empty_cache:defer never waits on the out-of-memory path (K8): the cache queued
            // behind the dead streams' running kernels comes back once they have finished.
            REQUIRE(mode == empty_cache_mode::defer);
            env.dev.run_until_idle();
            env.alloc.reclaim();
            p = env.alloc.allocate(n, s);
          }
          env.dev.launch(s, 10, {writes(p, n, 0x33)}, "new stream writes");
          fresh.push_back(p);
        }
      }
      CHECK(env.dev.fault_count() == 0);  // no write raced with a dead stream's pending write
      env.dev.run_until_idle();
      for (void* p : fresh) CHECK(env.dev.value_at(addr(p)) == std::optional<std::uint8_t>(0x33));
      for (void* p : fresh) env.alloc.deallocate(p);
      env.alloc.deallocate(big);
      env.alloc.empty_cache(empty_cache_mode::wait);
      env.alloc.check_invariants();
      CHECK(env.alloc.stats().reserved_bytes.current == 0);
      CHECK(env.dev.fault_count() == 0);
    }
  }
}

TEST_CASE(
    "K6: the default stream takes a destroyed stream's cached segment only behind its last work",
    "[core][bad-input][cases][K6]") {
  options o;
  o.memory_limit_bytes = 64 * MiB;
  sim_env env(o);
  auto s = env.dev.create_stream();
  void* p = env.alloc.allocate(40 * MiB, s);
  auto h = env.dev.hold(s);
  env.dev.launch(s, 10, {writes(p, 40 * MiB, 0x11)}, "last write of the dead stream");
  env.alloc.deallocate(p);
  env.alloc.notify_stream_destroyed(s);
  env.dev.destroy_stream(s);
  env.alloc.notify_stream_destroyed(s);       // twice: a no-op
  void* q = env.alloc.allocate(40 * MiB, 0);  // only reachable through the dead stream's pool
  env.dev.launch(0, 10, {writes(q, 40 * MiB, 0x22)}, "default stream writes");
  CHECK(env.dev.fault_count() == 0);
  env.dev.open(h);
  env.dev.run_until_idle();
  CHECK(env.dev.value_at(addr(q)) == std::optional<std::uint8_t>(0x22));
  env.alloc.deallocate(q);
  env.alloc.check_invariants();
}

TEST_CASE("K6: notify_stream_destroyed of a stream the allocator never saw is a no-op",
          "[core][bad-input][cases][K6]") {
  sim_env env;
  auto s = env.dev.create_stream();
  const std::string before = env.alloc.stats().to_string();
  env.alloc.notify_stream_destroyed(s);
  env.alloc.notify_stream_destroyed(12345);
  CHECK(env.alloc.stats().to_string() == before);
  CHECK(env.dev.counters().events_recorded == 0);
}

TEST_CASE(
    "K6: a host free after the recorded stream was destroyed makes no call on the dead stream",
    "[core][bad-input][cases][K6]") {
  // The dead stream's tombstone event stands in for its use (record_event on a destroyed handle
  // would fail, or hit a recycled handle).
  sim_env env;
  auto s1 = env.dev.create_stream();
  auto s2 = env.dev.create_stream();
  void* p = env.alloc.allocate(4 * KiB, s1);
  env.dev.launch(s2, 100, {reads(p, 4 * KiB)});
  env.alloc.record_stream(p, s2);
  env.alloc.notify_stream_destroyed(s2);
  env.dev.destroy_stream(s2);
  CHECK_NOTHROW(env.alloc.deallocate(p));
  env.dev.run_until_idle();
  CHECK_NOTHROW(env.alloc.empty_cache(empty_cache_mode::wait));
  CHECK(env.dev.fault_count() == 0);
}

TEST_CASE(
    "K6: a recycled stream handle does not inherit a block behind another stream's unrecorded use",
    "[core][bad-input][cases][K6]") {
  // With the all_streams scope a use on another stream may go unrecorded (FSDP2) as long as the
  // program orders that stream before the next use on the allocation stream s. After s is
  // destroyed and the driver recycles its handle value, the new stream takes s's cached blocks:
  // it must wait for every stream the fence covers, not for s's tombstone alone (found by the
  // seeded fuzz run, seed 47; fixed in the core).
  sim_env env;
  env.dev.set_reuse_stream_handles(true);
  auto s = env.dev.create_stream();
  auto t = env.dev.create_stream();
  env.alloc.deallocate(env.alloc.allocate(512, t));  // t is a stream the allocator has seen
  void* p = env.alloc.allocate(1 * MiB, s);
  env.dev.launch(s, 10, {writes(p, 1 * MiB)});
  auto ev = env.dev.create_event();
  env.dev.record_event(ev, s);
  env.dev.stream_wait_event(t, ev);
  auto h = env.dev.hold(t);
  env.dev.launch(t, 10, {reads(p, 1 * MiB)}, "unrecorded read on t");
  env.alloc.deallocate(p);
  env.alloc.notify_stream_destroyed(s);
  env.dev.destroy_stream(s);
  auto s_new = env.dev.create_stream();
  REQUIRE(s_new == s);
  void* q = env.alloc.allocate(1 * MiB, s_new);
  env.dev.launch(s_new, 10, {writes(q, 1 * MiB)}, "the new stream writes");
  CHECK(env.dev.fault_count() == 0);
  env.dev.open(h);
  env.dev.run_until_idle();
  env.alloc.deallocate(q);
}

TEST_CASE(
    "The device fence scope in defer mode: empty_cache(wait) finishes the deferred release instead "
    "of "
    "spinning",
    "[core][bad-input]") {
  // A release batch of the device scope is never complete by polling; finish_deferred(wait) once
  // synchronised the device and then looped for ever on the same batch (found by the fuzzer,
  // fixed in the core). Run in a child process with a time limit, so a regression fails
  // instead of hanging.
  const std::string how = run_in_child(
      [] {
        sim_env env(
            make_options(backend_kind::cuda_malloc, fence_scope::device, empty_cache_mode::defer));
        void* p = env.alloc.allocate(4 * KiB, 0);
        env.alloc.deallocate(p);
        env.alloc.empty_cache();  // deferred
        env.alloc.empty_cache(empty_cache_mode::wait);
        std::_Exit(env.alloc.stats().reserved_bytes.current == 0 ? 0 : 3);
      },
      std::chrono::seconds(20));
  CHECK(how == "exit 0");
}

// ---- process exit -----------------------------------------------------------------------------

TEST_CASE(
    "After the runtime unloads (every backend call fails), frees without driver work still succeed "
    "and "
    "the destructor neither throws nor crashes",
    "[core][bad-input][exit]") {
  for (auto backend : {backend_kind::cuda_malloc, backend_kind::expandable}) {
    for (auto mode : {empty_cache_mode::wait, empty_cache_mode::defer}) {
      INFO(to_string(backend) << "/" << to_string(mode));
      sim::simulated_device dev(sim_config());
      std::optional<caching_allocator> alloc;
      alloc.emplace(dev, make_options(backend, fence_scope::all_streams, mode));
      auto s1 = dev.create_stream();
      auto s2 = dev.create_stream();
      void* same = alloc->allocate(1 * MiB, s1);
      void* cross = alloc->allocate(1 * MiB, s1);
      void* leaked = alloc->allocate(3 * MiB, s2);
      void* cached = alloc->allocate(30 * MiB, s2);
      alloc->record_stream(cross, s2);
      dev.launch(s2, 100, {reads(cross, 1 * MiB)});
      alloc->deallocate(cached);
      alloc->empty_cache(empty_cache_mode::defer);               // maybe a deferred batch
      for (sim::call c : every_call) dev.fail_next(c, 1 << 30);  // "the runtime is unloading"
      alloc->deallocate(same);                                   // same-stream free: no driver call
      try {
        alloc->deallocate(cross);  // needs an event record: a clear error is acceptable
      } catch (const backend_error&) {
      }
      try {
        alloc->empty_cache();
      } catch (const backend_error&) {
      }
      alloc->check_invariants();
      (void)leaked;
      CHECK_NOTHROW(alloc.reset());  // live block leaked, nothing released, no throw
    }
  }
}

TEST_CASE(
    "An allocator with static storage duration is destroyed cleanly at process exit after the "
    "runtime "
    "unloaded",
    "[core][bad-input][exit]") {
  const std::string how = run_in_child(
      [] {
        static sim::simulated_device dev(sim_config());
        static caching_allocator alloc(dev, options{});
        auto s = dev.create_stream();
        void* p = alloc.allocate(4 * MiB, s);
        void* q = alloc.allocate(4 * MiB, 0);
        alloc.record_stream(q, s);
        alloc.deallocate(p);
        dev.hold(s);  // work that never finishes
        std::atexit([] {
          for (sim::call c : every_call) dev.fail_next(c, 1 << 30);
        });
        std::exit(0);  // runs the atexit handler, then the static destructors
      },
      std::chrono::seconds(20));
  CHECK(how == "exit 0");
}

// ---- defects found by the fuzz runs, now fixed -------------------------------------------------

TEST_CASE(
    "K6: a recycled stream handle does not inherit a block behind an unrecorded use on a stream "
    "that is "
    "gone too",
    "[core][bad-input][cases][K6]") {
  // Was a bug (fixed in get_or_create_stream_locked): when a recycled handle revived, the new
  // stream waited on its own old tombstone and on an event of every *live* stream, but not on the
  // tombstones of other destroyed streams. If the stream t that used a block of s without a record
  // (FSDP2, legal under all_streams) is destroyed too, before s's handle is recycled, the new
  // stream takes the block while t's last work is still pending: cross_stream_race. Waiting on
  // every tombstone (as steal_segment_locked does) fixes it. Found while checking the fix of
  // seed 47.
  sim_env env;
  env.dev.set_reuse_stream_handles(true);
  auto s = env.dev.create_stream();
  auto t = env.dev.create_stream();
  env.alloc.deallocate(env.alloc.allocate(512, t));
  void* p = env.alloc.allocate(1 * MiB, s);
  env.dev.launch(s, 10, {writes(p, 1 * MiB)});
  auto ev = env.dev.create_event();
  env.dev.record_event(ev, s);
  env.dev.stream_wait_event(t, ev);
  auto h = env.dev.hold(t);
  env.dev.launch(t, 10, {reads(p, 1 * MiB)}, "unrecorded read on t");
  env.alloc.deallocate(p);
  env.alloc.notify_stream_destroyed(s);
  env.dev.destroy_stream(s);
  env.alloc.notify_stream_destroyed(t);
  env.dev.destroy_stream(t);
  auto s_new = env.dev.create_stream();
  REQUIRE(s_new == s);
  void* q = env.alloc.allocate(1 * MiB, s_new);
  env.dev.launch(s_new, 10, {writes(q, 1 * MiB)}, "the new stream writes");
  CHECK(env.dev.fault_count() == 0);
  env.dev.open(h);
  env.dev.run_until_idle();
  env.alloc.deallocate(q);
}
