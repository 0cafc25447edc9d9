// The reuse fence, on the simulated device: a block read on a side stream
// without record_stream (a device-to-host copy, a collective on a third stream), freed from the
// host and handed back to its allocation stream at once, races with the pending read. Under
// the option reuse_fence:all_streams a host free is fenced against every stream the allocator
// knows before its block is reused, one event per stream covering a whole batch of frees.
// Without the option (the default) the race shows: that is the control.
#include "support/sim_faults.hpp"
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <string>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

options reuse_fenced() {
  options o;
  REQUIRE_NOTHROW(o = options::parse("reuse_fence:all_streams"));
  return o;
}

// s allocates p and writes it; t (known to the allocator) reads p behind a hold, with no
// record_stream; p is freed from the host and 32 MiB asked for again on s, then written.
// Returns the number of cross-stream races the simulated device saw.
std::size_t unrecorded_side_read_then_reuse(const options& o, bool* reused = nullptr) {
  sim_env env(o);
  const auto s = env.dev.create_stream();
  const auto t = env.dev.create_stream();
  env.alloc.deallocate(env.alloc.allocate(4 * KiB, t));  // t is a stream the allocator knows
  void* p = env.alloc.allocate(32 * MiB, s);
  env.dev.launch(s, 10, {writes(p, 32 * MiB, 0x01)}, "producer on s");
  auto ev = env.dev.create_event();
  env.dev.record_event(ev, s);
  env.dev.stream_wait_event(t, ev);
  const auto h = env.dev.hold(t, "t busy");
  env.dev.launch(t, 10, {reads(p, 32 * MiB)}, "device-to-host copy on t, no record_stream");
  env.alloc.deallocate(p);
  void* q = env.alloc.allocate(32 * MiB, s);
  if (reused) *reused = q == p;
  env.dev.launch(s, 10, {writes(q, 32 * MiB, 0x02)}, "next producer on s");
  env.dev.open(h);
  env.dev.run_until_idle();
  const std::size_t races = count_faults(env.dev, sim::fault_kind::cross_stream_race);
  env.alloc.deallocate(q);
  env.alloc.check_invariants();
  return races;
}

}  // namespace

TEST_CASE("reuse_fence:all_streams parses and is written back by options::to_string",
          "[core][reuse-fence][config]") {
  const options o = reuse_fenced();
  CHECK_THAT(o.to_string(), Catch::Contains("reuse_fence:all_streams"));
  CHECK_NOTHROW(options::parse(o.to_string()));
}

TEST_CASE(
    "Under reuse_fence:all_streams a host-freed block read on a side stream without record_stream "
    "is not "
    "reused before the read",
    "[core][reuse-fence]") {
  bool reused = false;
  CHECK(unrecorded_side_read_then_reuse(reuse_fenced(), &reused) == 0);
  INFO("reused the same block: " << reused);
}

TEST_CASE("Control: by default the same reuse races with the unrecorded side-stream read",
          "[core][reuse-fence]") {
  bool reused = false;
  CHECK(unrecorded_side_read_then_reuse(options{}, &reused) == 1);
  CHECK(reused);
}

TEST_CASE(
    "Under reuse_fence:all_streams one event per known stream covers a batch of 100 host frees",
    "[core][reuse-fence]") {
  sim_env env(reuse_fenced());
  const auto s = env.dev.create_stream();
  const auto t = env.dev.create_stream();
  const auto u = env.dev.create_stream();
  env.alloc.deallocate(env.alloc.allocate(4 * KiB, t));
  env.alloc.deallocate(env.alloc.allocate(4 * KiB, u));
  std::vector<void*> blocks;
  for (int i = 0; i < 100; ++i) {
    blocks.push_back(env.alloc.allocate(256 * KiB, s));
    env.dev.launch(s, 1, {writes(blocks.back(), 256 * KiB)}, "use");
  }
  const auto before = env.dev.counters().events_recorded;
  for (void* p : blocks) env.alloc.deallocate(p);  // one batch
  std::vector<void*> again;
  for (int i = 0; i < 100; ++i)
    again.push_back(env.alloc.allocate(256 * KiB, s));  // reuses, behind the batch
  const auto recorded = env.dev.counters().events_recorded - before;
  INFO("events recorded for 100 frees and 100 reuses, 3 known streams: " << recorded);
  CHECK(recorded >= 1);  // the fence exists
  CHECK(recorded <= 6);  // two batches of one event per stream at most, never one per free
  for (void* p : again) env.alloc.deallocate(p);
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}

TEST_CASE("Control: by default same-stream host frees record no event", "[core][reuse-fence]") {
  sim_env env;
  const auto s = env.dev.create_stream();
  const auto t = env.dev.create_stream();
  env.alloc.deallocate(env.alloc.allocate(4 * KiB, t));
  std::vector<void*> blocks;
  for (int i = 0; i < 100; ++i) blocks.push_back(env.alloc.allocate(256 * KiB, s));
  const auto before = env.dev.counters().events_recorded;
  for (void* p : blocks) env.alloc.deallocate(p);
  for (int i = 0; i < 100; ++i) env.alloc.deallocate(env.alloc.allocate(256 * KiB, s));
  CHECK(env.dev.counters().events_recorded == before);
}

TEST_CASE(
    "Under reuse_fence:all_streams a host free on the device-locked path (the thread allocated "
    "last on "
    "another stream) waits for the reuse fence too",
    "[core][reuse-fence]") {
  // The free's fast path serves only blocks of the stream this thread allocated from last; here
  // the last allocation is on t, so the free of s's block takes the path under the device lock.
  sim_env env(reuse_fenced());
  const auto s = env.dev.create_stream();
  const auto t = env.dev.create_stream();
  void* p = env.alloc.allocate(512 * KiB, s);
  env.dev.launch(s, 10, {writes(p, 512 * KiB, 0x01)}, "producer on s");
  void* x = env.alloc.allocate(4 * KiB, t);  // t is known, and is this thread's last stream
  auto ev = env.dev.create_event();
  env.dev.record_event(ev, s);
  env.dev.stream_wait_event(t, ev);
  const auto h = env.dev.hold(t, "t busy");
  env.dev.launch(t, 10, {reads(p, 512 * KiB)}, "device-to-host copy on t, no record_stream");
  env.alloc.deallocate(p);
  void* q = env.alloc.allocate(512 * KiB, s);
  env.dev.launch(s, 10, {writes(q, 512 * KiB, 0x02)}, "next producer on s");
  env.dev.open(h);
  env.dev.run_until_idle();
  CHECK(count_faults(env.dev, sim::fault_kind::cross_stream_race) == 0);
  env.alloc.deallocate(q);
  env.alloc.deallocate(x);
  env.alloc.check_invariants();
}
