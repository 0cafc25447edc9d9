// Placement prefers free headroom to memory still pending another stream's work.
//
// A block freed with a use on another stream is pending until that use completes; an allocation
// may take it by making its stream wait on the use's events (events.cpp: take_pending_locked).
// That wait orders the new work behind the other stream's, and a large pending block carved for
// a small request is no longer there for the large request that needs it again. While the pool
// can grow without raising peak reserved (memory given back earlier, within the limit), it grows
// instead; at the peak it still takes the pending block (K9: no driver allocation per step).
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

using namespace streamsafe;
using namespace streamsafe::test;

TEST_CASE(
    "An allocation grows into free headroom rather than carving a block pending another stream's "
    "work, and the large request that needs that block later fits",
    "[core][pending][segment-fit]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  INFO(to_string(backend));
  options o = make_options(backend, fence_scope::all_streams, empty_cache_mode::wait);
  o.memory_limit_bytes = 400 * MiB;
  sim_env env(o, sim_config(8 * GiB));
  const auto s = env.dev.create_stream();
  const auto t = env.dev.create_stream();
  // An earlier phase set the peak at 300 MiB and gave its memory back.
  void* early = env.alloc.allocate(300 * MiB, s);
  env.alloc.deallocate(early);
  env.alloc.empty_cache();
  REQUIRE(env.alloc.stats().reserved_bytes.current == 0);
  // A: 250 MiB written on s, read by long work on t (recorded), freed: pending on t.
  void* a = env.alloc.allocate(250 * MiB, s);
  env.dev.launch(s, 10, {writes(a, 250 * MiB)}, "produce");
  const event_handle made = env.dev.create_event();
  env.dev.record_event(made, s);
  env.dev.stream_wait_event(t, made);
  env.dev.launch(t, 100000, {reads(a, 250 * MiB)}, "long read on t");
  env.alloc.record_stream(a, t);
  env.alloc.deallocate(a);
  const auto waits_before = env.alloc.stats().stream_waits;
  const auto new_before = env.dev.counters().maps + env.dev.counters().segment_allocs;
  // 40 MiB on s: headroom under the peak (250 + 40 <= 300): not A, no stream wait behind t.
  void* x = env.alloc.allocate(40 * MiB, s);
  CHECK((addr(x) + 40 * MiB <= addr(a) || addr(x) >= addr(a) + 250 * MiB));
  CHECK(env.alloc.stats().stream_waits == waits_before);
  // 250 MiB on s: A serves it (behind a stream wait now: no headroom left), no new memory.
  const auto new_mid = env.dev.counters().maps + env.dev.counters().segment_allocs;
  void* y = nullptr;
  REQUIRE_NOTHROW(y = env.alloc.allocate(250 * MiB, s));
  CHECK(addr(y) == addr(a));
  CHECK(env.dev.counters().maps + env.dev.counters().segment_allocs == new_mid);
  CHECK(new_mid > new_before);  // x grew
  CHECK(env.alloc.stats().reserved_bytes.peak <= static_cast<std::int64_t>(300 * MiB));
  env.dev.launch(s, 10, {writes(y, 250 * MiB)}, "reuse");
  env.alloc.deallocate(x);
  env.alloc.deallocate(y);
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  env.dev.destroy_event(made);
  env.alloc.check_invariants();
}
