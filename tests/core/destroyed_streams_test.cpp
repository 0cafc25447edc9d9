// Destroyed streams are forgotten (case K6 at scale), on the simulated
// device: after notify_stream_destroyed a stream's state goes once its last event completes,
// its cached blocks serve other streams (behind that event) and are releasable, and every
// per-call cost (event queries, live events, stream waits) follows the live streams, not every
// stream ever seen.
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <set>
#include <string>
#include <thread>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

std::uint64_t live_events(const sim::simulated_device& dev) {
  const auto c = dev.counters();
  return c.events_created - c.events_destroyed;
}

std::size_t streams_in_snapshot(const caching_allocator& a) {
  std::set<stream_handle> streams;
  for (const auto& seg : a.snapshot().segments) streams.insert(seg.stream);
  return streams.size();
}

// n short-lived streams: each allocates 1 MiB (a 2 MiB small segment), uses and frees it, is
// announced destroyed and destroyed; then the device runs dry.
void churn(sim_env& env, int n, std::size_t bytes = 1 * MiB) {
  for (int i = 0; i < n; ++i) {
    const auto s = env.dev.create_stream();
    void* p = env.alloc.allocate(bytes, s);
    env.dev.launch(s, 1, {writes(p, bytes)}, "task");
    env.alloc.deallocate(p);
    env.alloc.notify_stream_destroyed(s);
    env.dev.destroy_stream(s);
  }
  env.dev.run_until_idle();
}

}  // namespace

TEST_CASE(
    "After 2,000 destroyed streams, one empty_cache queries and keeps events for the live streams "
    "only and "
    "releases the dead streams' pools",
    "[core][destroyed-streams][K6]") {
  sim_env env;
  const auto live = env.dev.create_stream();
  env.alloc.deallocate(env.alloc.allocate(4 * KiB, live));
  churn(env, 2000);
  const auto before = env.dev.counters();
  env.alloc.empty_cache();
  const auto after = env.dev.counters();
  INFO("event queries " << after.event_queries - before.event_queries << ", stream waits "
                        << after.stream_waits - before.stream_waits << ", live events "
                        << live_events(env.dev));
  CHECK(after.event_queries - before.event_queries <= 8);
  CHECK(live_events(env.dev) <= 16);
  CHECK(env.alloc.stats().reserved_bytes.current == 0);
  CHECK(streams_in_snapshot(env.alloc) == 0);
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}

TEST_CASE(
    "The dead streams' cached memory serves a live stream at the limit, with stream waits and "
    "queries for "
    "the live streams only",
    "[core][destroyed-streams][K6]") {
  options o;
  o.memory_limit_bytes = 2000 * 2 * MiB;  // exactly the dead pools: no growth possible
  sim_env env(o);
  // The 2,000 streams live at once (one after another, each would reuse its predecessor's
  // segment behind the tombstone), then all destroyed.
  std::vector<stream_handle> dying;
  for (int i = 0; i < 2000; ++i) {
    dying.push_back(env.dev.create_stream());
    void* q = env.alloc.allocate(1 * MiB, dying.back());
    env.dev.launch(dying.back(), 1, {writes(q, MiB)}, "task");
    env.alloc.deallocate(q);
  }
  for (const auto s : dying) {
    env.alloc.notify_stream_destroyed(s);
    env.dev.destroy_stream(s);
  }
  env.dev.run_until_idle();
  REQUIRE(env.alloc.stats().reserved_bytes.current == static_cast<std::int64_t>(2000 * 2 * MiB));
  const auto live = env.dev.create_stream();
  const auto before = env.dev.counters();
  void* p = env.alloc.allocate(1 * MiB, live);
  const auto after = env.dev.counters();
  INFO("event queries " << after.event_queries - before.event_queries << ", stream waits "
                        << after.stream_waits - before.stream_waits << ", events recorded "
                        << after.events_recorded - before.events_recorded);
  CHECK(after.stream_waits - before.stream_waits <= 2);
  CHECK(after.event_queries - before.event_queries <= 8);
  CHECK(after.events_recorded - before.events_recorded <= 8);
  env.dev.launch(live, 1, {writes(p, MiB)}, "use on the live stream");
  std::vector<void*> more;
  for (int i = 0; i < 100; ++i)
    more.push_back(env.alloc.allocate(1 * MiB, live));  // no out_of_memory
  CHECK(env.alloc.stats().reserved_bytes.current <=
        static_cast<std::int64_t>(o.memory_limit_bytes));
  env.alloc.deallocate(p);
  for (void* q : more) env.alloc.deallocate(q);
  env.dev.run_until_idle();
  env.alloc.empty_cache();
  CHECK(env.alloc.stats().reserved_bytes.current == 0);
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}

TEST_CASE(
    "Control: 200 streams that are never announced destroyed keep their pools, as they may still "
    "run",
    "[core][destroyed-streams][K6]") {
  // The other side of the rule: without notify_stream_destroyed a stream is live, its
  // pool's segments are fenced on it and released by empty_cache only behind that fence.
  sim_env env;
  std::vector<stream_handle> streams;
  for (int i = 0; i < 200; ++i) {
    streams.push_back(env.dev.create_stream());
    void* p = env.alloc.allocate(1 * MiB, streams.back());
    env.alloc.deallocate(p);
  }
  const auto h = env.dev.hold(streams.front());
  CHECK(env.alloc.empty_cache(empty_cache_mode::defer) == 0);  // every fence covers the held stream
  CHECK(env.alloc.stats().reserved_bytes.current == static_cast<std::int64_t>(200 * 2 * MiB));
  env.dev.open(h);
  env.dev.run_until_idle();
  env.alloc.empty_cache();
  CHECK(env.alloc.stats().reserved_bytes.current == 0);
  CHECK(env.dev.fault_count() == 0);
}

TEST_CASE(
    "100,000 streams created, used and destroyed: streams, events and reserved memory stay bounded",
    "[core][destroyed-streams][K6][soak]") {
  options o;
  o.memory_limit_bytes = 256 * MiB;
  sim_env env(o);
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::seconds(30);  // a bound for CI, not the expectation
  std::uint64_t max_live_events = 0;
  std::size_t max_streams = 0;
  int done = 0;
  std::string error;
  try {
    while (done < 100000 && std::chrono::steady_clock::now() < deadline) {
      churn(env, 100, 4 * KiB);
      done += 100;
      max_live_events = std::max(max_live_events, live_events(env.dev));
      max_streams = std::max(max_streams, streams_in_snapshot(env.alloc));
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  const auto seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO(done << " streams in " << seconds << " s; most live events " << max_live_events
            << "; most streams holding segments " << max_streams << "; " << error);
  CHECK(error.empty());
  CHECK(done == 100000);
  CHECK(max_live_events <= 64);
  CHECK(max_streams <= 64);
  CHECK(env.alloc.stats().reserved_bytes.peak <= static_cast<std::int64_t>(64 * MiB));
  CHECK(seconds < 20);
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}

TEST_CASE(
    "Destroyed streams' states are retired and reused while other threads allocate on their own "
    "streams",
    "[core][destroyed-streams][threads][K6]") {
  // Each thread churns short-lived streams and keeps one stream of its own; the states of the
  // dead ones are retired and handed to new streams while the threads' stream caches still
  // point at them (run under TSan and ASan).
  sim_env env;
  constexpr int k_threads = 3;
  std::vector<std::thread> threads;
  std::vector<std::string> errors(k_threads);
  for (int t = 0; t < k_threads; ++t) {
    threads.emplace_back([&, t] {
      try {
        const auto own = env.dev.create_stream();
        for (int i = 0; i < 300; ++i) {
          void* keep = env.alloc.allocate(8 * KiB, own);
          churn(env, 3, 4 * KiB);
          env.dev.launch(own, 1, {writes(keep, 8 * KiB)}, "own stream");
          env.alloc.deallocate(keep);
        }
      } catch (const std::exception& e) {
        errors[t] = e.what();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& e : errors) CHECK(e.empty());
  env.dev.run_until_idle();
  env.alloc.empty_cache();
  CHECK(env.dev.fault_count() == 0);
  CHECK(live_events(env.dev) <= 64);
  env.alloc.check_invariants();
}
