// allocate and deallocate never block the host on a fence for a release nobody asked for
// (the opportunistic trim), on the simulated device: with max_cached_bytes or
// garbage_collection_threshold set and empty_cache:wait (the default), the opportunistic trim
// inside allocate releases what is safe now and leaves the rest. The calling thread holds a
// stream busy (a collective it must itself release, as when one thread drives several GPUs):
// a host wait on that stream would hang it. blocking_host_backend blocks a host wait as a GPU
// does; the watchdog opens the hold after 5 s and fails the test instead of hanging.
#include "support/blocking_host.hpp"
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <string>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

constexpr std::chrono::milliseconds k_watchdog{5000};

// The allocator over a blocking host; `busy` is a stream the allocator knows, held by the
// calling thread; s has 100 MiB cached, idle (its own uses completed).
struct trim_env {
  sim::simulated_device dev;
  blocking_host_backend host;
  caching_allocator alloc;
  stream_handle s, busy;
  std::vector<void*> extra;  // `extra_blocks` 100 MiB blocks, live, allocated before the hold
  std::uint64_t hold = 0;
  bool opened = false;
  explicit trim_env(const options& o, int extra_blocks = 0)
      : dev(sim_config(8 * GiB)), host(dev, std::chrono::seconds(30)), alloc(host, o),
        s(dev.create_stream()), busy(dev.create_stream()) {
    void* small = alloc.allocate(4 * KiB, busy);
    dev.launch(busy, 10, {writes(small, 4 * KiB)}, "use on busy");
    void* p = alloc.allocate(100 * MiB, s);
    dev.launch(s, 10, {writes(p, 100 * MiB)}, "use on s");
    dev.run_until_idle();
    alloc.deallocate(p);
    for (int i = 0; i < extra_blocks; ++i)
      extra.push_back(alloc.allocate(100 * MiB + static_cast<std::size_t>(i) * MiB, s));
    hold = dev.hold(busy, "a collective this thread releases later");
  }
  void open() {
    if (!opened) dev.open(hold);
    opened = true;
  }
};

options with_max_cached() {
  options o;
  o.max_cached_bytes = 64 * MiB;
  return o;
}

options with_gc_threshold() {
  options o;
  o.memory_limit_bytes = 1 * GiB;
  o.garbage_collection_threshold = 0.25;  // growth to 302 MiB of 1 GiB crosses it
  return o;
}

}  // namespace

TEST_CASE(
    "With max_cached_bytes or garbage_collection_threshold and empty_cache:wait, an allocation "
    "that grows "
    "does not wait on a busy stream's fence",
    "[core][blocking]") {
  const bool gc = GENERATE(false, true);
  INFO((gc ? "garbage_collection_threshold:0.25, limit 1 GiB" : "max_cached_bytes:64 MiB"));
  trim_env env(gc ? with_gc_threshold() : with_max_cached());
  REQUIRE(env.alloc.config().empty_cache == empty_cache_mode::wait);
  void* q = nullptr;
  const auto r = returns_within([&] { q = env.alloc.allocate(200 * MiB, env.s); }, k_watchdog,
                                [&] { env.open(); });
  CHECK(r.returned_in_time);
  CHECK(r.error.empty());
  INFO(r.error);
  CHECK(env.host.blocked_calls() == 0);
  CHECK(env.host.blocking_calls() == 0);  // no host wait at all
  CHECK(q != nullptr);

  env.open();
  env.dev.run_until_idle();
  if (q) env.alloc.deallocate(q);
  env.alloc.empty_cache();  // asked for: the rest goes now
  CHECK(env.alloc.stats().reserved_bytes.current == static_cast<std::int64_t>(2 * MiB));
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}

TEST_CASE(
    "With max_cached_bytes and empty_cache:wait, frees that bring the cache over the cap do not "
    "wait on a "
    "busy stream's fence",
    "[core][blocking]") {
  trim_env env(with_max_cached(), 4);
  const auto r = returns_within(
      [&] {
        for (void* p : env.extra) env.alloc.deallocate(p);  // 500 MiB cached, cap 64 MiB
      },
      k_watchdog, [&] { env.open(); });
  CHECK(r.returned_in_time);
  CHECK(r.error.empty());
  INFO(r.error);
  CHECK(env.host.blocked_calls() == 0);
  env.open();
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}

TEST_CASE(
    "Control: an explicit empty_cache in wait mode under the hold blocks, and the watchdog catches "
    "it",
    "[core][blocking]") {
  trim_env env(with_max_cached());
  const auto r = returns_within([&] { env.alloc.empty_cache(); }, std::chrono::milliseconds(500),
                                [&] { env.open(); });
  CHECK_FALSE(r.returned_in_time);  // it waited on busy's fence, as asked
  CHECK(env.host.blocked_calls() >= 1);
  CHECK(r.error.empty());
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
}
