// The caching allocator's policy on the simulated device: rounding, split and merge, pools per
// stream, statistics, stream uses, release and bad input.
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <set>
#include <sstream>

using namespace streamsafe;
using namespace streamsafe::test;

TEST_CASE("Requests are rounded up to 512 bytes and blocks are 512-byte aligned", "[core]") {
  sim_env env;
  for (std::size_t size : {1, 511, 512, 513, 4097, 1000000}) {
    void* p = env.alloc.allocate(size, 0);
    CHECK(addr(p) % 512 == 0);
    CHECK(env.alloc.find_block(p).size_bytes == (size + 511) / 512 * 512);
    env.alloc.deallocate(p);
    env.alloc.check_invariants();
  }
}

TEST_CASE("A freed block is reused on its stream and its free neighbours are merged", "[core]") {
  sim_env env;
  void* a = env.alloc.allocate(4 * KiB, 0);
  void* b = env.alloc.allocate(4 * KiB, 0);
  void* c = env.alloc.allocate(4 * KiB, 0);
  CHECK(addr(b) == addr(a) + 4 * KiB);  // split from one 2 MiB small segment
  CHECK(addr(c) == addr(b) + 4 * KiB);
  CHECK(env.dev.counters().segment_allocs == 1);
  env.alloc.deallocate(a);
  env.alloc.deallocate(b);
  env.alloc.check_invariants();
  void* again = env.alloc.allocate(4 * KiB, 0);  // same size: straight from the quick cache
  CHECK(again == b);
  env.alloc.deallocate(again);
  env.alloc.empty_cache();  // flushes the quick cache: a and b merge (c keeps the segment)
  env.alloc.check_invariants();
  void* d = env.alloc.allocate(8 * KiB, 0);  // best fit: the merged 8 KiB hole
  CHECK(d == a);
  env.alloc.deallocate(c);
  env.alloc.deallocate(d);
  env.alloc.check_invariants();
  CHECK(env.alloc.stats().allocated_bytes.current == 0);
  CHECK(env.dev.counters().segment_allocs == 1);
}

TEST_CASE("Small and large requests come from separate segments of the documented sizes",
          "[core]") {
  sim_env env;
  void* small = env.alloc.allocate(1 * MiB, 0);
  void* mid = env.alloc.allocate(3 * MiB, 0);
  void* big = env.alloc.allocate(33 * MiB, 0);
  auto s = env.alloc.stats();
  CHECK(s.reserved_bytes.current == static_cast<std::int64_t>(2 * MiB + 20 * MiB + 34 * MiB));
  CHECK(s.segment.current == 3);
  for (void* p : {small, mid, big}) env.alloc.deallocate(p);
  env.alloc.check_invariants();
}

TEST_CASE("Each stream has its own pool: a block freed on one stream is not handed to another",
          "[core]") {
  sim_env env;
  auto s1 = env.dev.create_stream();
  auto s2 = env.dev.create_stream();
  void* a = env.alloc.allocate(64 * KiB, s1);
  env.alloc.deallocate(a);
  void* b = env.alloc.allocate(64 * KiB, s2);
  CHECK(b != a);
  void* c = env.alloc.allocate(64 * KiB, s1);
  CHECK(c == a);
  env.alloc.deallocate(b);
  env.alloc.deallocate(c);
  env.alloc.check_invariants();
}

TEST_CASE("Statistics track allocated, active, reserved and requested bytes with peaks", "[core]") {
  sim_env env;
  void* a = env.alloc.allocate(1000, 0);
  void* b = env.alloc.allocate(30 * MiB, 0);
  auto s = env.alloc.stats();
  CHECK(s.allocated_bytes.current == 1024 + 30 * MiB);
  CHECK(s.active_bytes.current == s.allocated_bytes.current);
  CHECK(s.requested_bytes.current == 1000 + 30 * MiB);
  CHECK(s.reserved_bytes.current == 2 * MiB + 30 * MiB);
  CHECK(s.allocation.current == 2);
  CHECK(s.num_device_alloc == 2);
  env.alloc.deallocate(b);
  s = env.alloc.stats();
  CHECK(s.allocated_bytes.current == 1024);
  CHECK(s.allocated_bytes.peak == 1024 + 30 * MiB);
  env.alloc.reset_peak_stats();
  CHECK(env.alloc.stats().allocated_bytes.peak == 1024);
  env.alloc.deallocate(a);
  CHECK(env.alloc.empty_cache() == 32 * MiB);
  s = env.alloc.stats();
  CHECK(s.reserved_bytes.current == 0);
  CHECK(s.num_device_free == 2);
  CHECK(s.bytes_released == 32 * MiB);
  CHECK(s.to_string().find("reserved_bytes.all.peak: ") != std::string::npos);
}

TEST_CASE("The device-wide allocated peak counts a peak no single stream passes its own at",
          "[core]") {
  // Each stream reaches 6 MiB alone; later both hold 5 MiB at once: the device's peak is
  // 10 MiB, set by allocations that raise neither stream's own peak (6 MiB).
  sim_env env;
  auto s1 = env.dev.create_stream();
  auto s2 = env.dev.create_stream();
  env.alloc.deallocate(env.alloc.allocate(6 * MiB, s1));
  env.alloc.deallocate(env.alloc.allocate(6 * MiB, s2));
  CHECK(env.alloc.stats().allocated_bytes.peak == 6 * MiB);
  void* a = env.alloc.allocate(5 * MiB, s1);
  void* b = env.alloc.allocate(5 * MiB, s2);
  CHECK(env.alloc.stats().allocated_bytes.peak == 10 * MiB);
  CHECK(env.alloc.stats().requested_bytes.peak == 10 * MiB);
  env.alloc.deallocate(a);
  env.alloc.deallocate(b);
  CHECK(env.alloc.stats().allocated_bytes.peak == 10 * MiB);
  env.alloc.reset_peak_stats();
  CHECK(env.alloc.stats().allocated_bytes.peak == 0);
}

TEST_CASE("A block used on another stream waits for that stream's event before reuse", "[core]") {
  sim_env env;
  auto s1 = env.dev.create_stream();
  auto s2 = env.dev.create_stream();
  void* p = env.alloc.allocate(20 * MiB, s1);  // fills its segment exactly
  env.dev.launch(s1, 10, {writes(p, 20 * MiB)});
  auto ev = env.dev.create_event();
  env.dev.record_event(ev, s1);
  env.dev.stream_wait_event(s2, ev);
  env.dev.launch(s2, 1000, {reads(p, 20 * MiB)}, "long read on s2");
  env.alloc.record_stream(p, s2);
  env.alloc.deallocate(p);
  auto s = env.alloc.stats();
  CHECK(s.events_recorded == 1);
  CHECK(s.allocated_bytes.current == 0);
  CHECK(s.active_bytes.current == 20 * MiB);   // still pending on s2
  void* q = env.alloc.allocate(20 * MiB, s1);  // served with a stream wait, not a new segment
  CHECK(q == p);
  CHECK(env.alloc.stats().stream_waits == 1);
  CHECK(env.dev.counters().segment_allocs == 1);
  env.dev.launch(s1, 10, {writes(q, 20 * MiB)}, "new owner writes");
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  env.alloc.deallocate(q);
  env.alloc.check_invariants();
}

TEST_CASE("A same-stream free records no event", "[core]") {
  sim_env env;
  auto s1 = env.dev.create_stream();
  for (int i = 0; i < 100; ++i) {
    void* p = env.alloc.allocate(static_cast<std::size_t>(1 + i * 1000), s1);
    env.alloc.deallocate(p);
    void* q = env.alloc.allocate(256, s1);
    env.alloc.deallocate(q, s1);
  }
  CHECK(env.alloc.stats().events_recorded == 0);
  CHECK(env.dev.counters().events_recorded == 0);
}

TEST_CASE("A stream-ordered free on another stream keeps the block until that stream passes",
          "[core]") {
  sim_env env;
  auto s1 = env.dev.create_stream();
  auto s2 = env.dev.create_stream();
  void* p = env.alloc.allocate(4 * KiB, s1);
  auto h = env.dev.hold(s2);
  env.alloc.deallocate(p, s2);
  env.alloc.reclaim();
  CHECK(env.alloc.stats().active_bytes.current == 4 * KiB);
  env.dev.open(h);
  env.dev.run_until_idle();
  env.alloc.reclaim();
  CHECK(env.alloc.stats().active_bytes.current == 0);
  env.alloc.check_invariants();
}

TEST_CASE("Allocating 0 bytes throws invalid_size and changes nothing", "[core][bad-input]") {
  sim_env env;
  auto before = env.alloc.stats();
  REQUIRE_THROWS_AS(env.alloc.allocate(0, 0), invalid_size);
  REQUIRE_THROWS_WITH(env.alloc.allocate(0, 0), Catch::Contains("size must be positive"));
  CHECK(env.alloc.stats().to_string() == before.to_string());
}

TEST_CASE(
    "Sizes near SIZE_MAX throw out_of_memory naming the request and leave the allocator usable",
    "[core][bad-input]") {
  sim_env env;
  const std::size_t max = std::numeric_limits<std::size_t>::max();
  for (std::size_t size : {max, max - 1, max - 511, max / 2 + 1, 9 * GiB}) {
    REQUIRE_THROWS_AS(env.alloc.allocate(size, 0), out_of_memory);
  }
  try {
    env.alloc.allocate(max, 0);
  } catch (const out_of_memory& e) {
    const std::string what = e.what();
    CHECK(what.find("tried to allocate") != std::string::npos);
    CHECK(what.find("device total") != std::string::npos);
    CHECK(what.find("largest free block") != std::string::npos);
  }
  CHECK(env.alloc.stats().num_ooms == 6);
  void* p = env.alloc.allocate(1 * MiB, 0);
  env.alloc.deallocate(p);
  env.alloc.check_invariants();
  CHECK(env.alloc.stats().reserved_bytes.current == 2 * MiB);
}

TEST_CASE("Out of memory releases the cache safely, retries, then reports the state", "[core]") {
  options o;
  o.memory_limit_bytes = 100 * MiB;
  sim_env env(o);
  auto s1 = env.dev.create_stream();
  void* a = env.alloc.allocate(60 * MiB, s1);
  env.alloc.deallocate(a);                    // cached on s1
  void* b = env.alloc.allocate(70 * MiB, 0);  // needs the cached 60 MiB back
  CHECK(env.alloc.stats().num_alloc_retries == 1);
  CHECK(env.alloc.stats().reserved_bytes.current == 70 * MiB);
  try {
    env.alloc.allocate(40 * MiB, 0);
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    const std::string what = e.what();
    CHECK(what.find("40.00 MiB") != std::string::npos);
    CHECK(what.find("reserved 70.00 MiB") != std::string::npos);
    CHECK(what.find("allocated 70.00 MiB") != std::string::npos);
  }
  CHECK(env.alloc.stats().num_ooms == 1);
  env.alloc.deallocate(b);
  void* c = env.alloc.allocate(40 * MiB, 0);
  env.alloc.deallocate(c);
  env.alloc.check_invariants();
}

TEST_CASE("Expandable segments grow by mapping chunks and empty_cache unmaps whole free chunks",
          "[core][expandable]") {
  options o = make_options(backend_kind::expandable);
  o.expandable_chunk_bytes = 2 * MiB;
  sim_env env(o);
  void* a = env.alloc.allocate(3 * MiB, 0);
  void* b = env.alloc.allocate(3 * MiB, 0);
  CHECK(addr(b) == addr(a) + 3 * MiB);  // one growing address range
  auto s = env.alloc.stats();
  CHECK(s.reserved_bytes.current == 6 * MiB);  // 2 MiB chunks: 4 MiB then 2 MiB more
  env.alloc.check_invariants();
  env.alloc.deallocate(a);
  CHECK(env.alloc.empty_cache() == 2 * MiB);  // only the chunk wholly inside a
  CHECK(env.alloc.stats().reserved_bytes.current == 4 * MiB);
  CHECK_FALSE(env.dev.is_mapped(addr(a), 1));
  CHECK(env.dev.is_mapped(addr(b), 3 * MiB));
  env.alloc.check_invariants();
  void* c = env.alloc.allocate(2 * MiB, 0);  // remaps
  env.alloc.deallocate(b);
  env.alloc.deallocate(c);
  env.alloc.empty_cache();
  CHECK(env.alloc.stats().reserved_bytes.current == 0);
  env.alloc.check_invariants();
}

TEST_CASE("max_split_size keeps large blocks whole", "[core]") {
  options o;
  o.max_split_size_bytes = 40 * MiB;
  sim_env env(o);
  void* big = env.alloc.allocate(64 * MiB, 0);
  env.alloc.deallocate(big);
  void* small = env.alloc.allocate(12 * MiB, 0);  // not carved out of the 64 MiB block
  CHECK(small != big);
  void* again = env.alloc.allocate(60 * MiB, 0);  // close enough in size: reuses it whole
  CHECK(again == big);
  CHECK(env.alloc.find_block(again).size_bytes == 64 * MiB);
  env.alloc.deallocate(small);
  env.alloc.deallocate(again);
  env.alloc.check_invariants();
}

TEST_CASE("A backend that cannot map refuses the expandable setting with a clear error",
          "[core][bad-input]") {
  sim::device_config c = sim_config();
  c.supports_expandable = false;
  sim::simulated_device dev(c);
  REQUIRE_THROWS_AS(caching_allocator(dev, make_options(backend_kind::expandable)), config_error);
}

TEST_CASE(
    "A stream announced as destroyed is fenced by its last event and a recycled handle waits for "
    "it",
    "[core][cases][K6]") {
  sim_env env;
  env.dev.set_reuse_stream_handles(true);
  auto s1 = env.dev.create_stream();
  void* p = env.alloc.allocate(1 * MiB, s1);
  auto h = env.dev.hold(s1);
  env.dev.launch(s1, 10, {writes(p, 1 * MiB, 0x11)}, "last write on the old stream");
  env.alloc.deallocate(p);
  env.alloc.notify_stream_destroyed(s1);
  env.dev.destroy_stream(s1);
  auto s1b = env.dev.create_stream();
  REQUIRE(s1b == s1);  // the driver recycled the handle value
  void* q = env.alloc.allocate(1 * MiB, s1b);
  CHECK(q == p);
  env.dev.launch(s1b, 10, {writes(q, 1 * MiB, 0x22)}, "new stream writes");
  env.dev.open(h);
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  CHECK(env.dev.value_at(addr(q)) == std::optional<std::uint8_t>(0x22));
  env.alloc.deallocate(q);
  env.alloc.check_invariants();
}

TEST_CASE(
    "A snapshot shows every segment and block with its state and the streams a pending block waits "
    "for",
    "[core][snapshot]") {
  sim_env env;
  auto s1 = env.dev.create_stream();
  auto s2 = env.dev.create_stream();
  void* a = env.alloc.allocate(20 * MiB, s1);
  void* b = env.alloc.allocate(4 * KiB, s1);
  auto h = env.dev.hold(s2);
  env.alloc.record_stream(a, s2);
  env.alloc.deallocate(a);  // pending on s2
  const memory_snapshot snap = env.alloc.snapshot();
  snap.check_consistency();
  REQUIRE(snap.segments.size() == 2);
  bool saw_pending = false, saw_active = false;
  for (const auto& seg : snap.segments) {
    for (const auto& blk : seg.blocks) {
      if (blk.address == addr(a)) {
        CHECK(blk.state == snapshot_block_state::pending_free);
        CHECK(blk.waiting_on == std::vector<stream_handle>{s2});
        saw_pending = true;
      }
      if (blk.address == addr(b)) {
        CHECK(blk.state == snapshot_block_state::active);
        CHECK(blk.requested_bytes == 4 * KiB);
        saw_active = true;
      }
    }
  }
  CHECK(saw_pending);
  CHECK(saw_active);
  CHECK(snap.stats.active_bytes.current == static_cast<std::int64_t>(20 * MiB + 4 * KiB));
  env.dev.open(h);
  env.dev.run_until_idle();
  env.alloc.deallocate(b);
}

TEST_CASE(
    "The trace records allocations, frees, segment operations, deferred releases and out of memory",
    "[core][trace]") {
  options o = make_options(backend_kind::expandable, fence_scope::all_streams,
                           empty_cache_mode::defer);
  o.trace_capacity = 64;
  o.memory_limit_bytes = 100 * MiB;
  sim_env env(o);
  auto s1 = env.dev.create_stream();
  auto s2 = env.dev.create_stream();
  void* p = env.alloc.allocate(30 * MiB, s1);
  env.alloc.record_stream(p, s2);
  auto h = env.dev.hold(s2);
  env.alloc.deallocate(p);
  env.dev.open(h);
  env.dev.run_until_idle();
  env.alloc.reclaim();
  void* q = env.alloc.allocate(1 * MiB, s2);
  auto h2 = env.dev.hold(s2);
  env.alloc.empty_cache();  // s2 is busy: deferred
  REQUIRE_THROWS_AS(env.alloc.allocate(200 * MiB, s1), out_of_memory);
  env.dev.open(h2);
  env.dev.run_until_idle();
  env.alloc.reclaim();
  env.alloc.deallocate(q);
  REQUIRE(env.alloc.trace() != nullptr);
  std::vector<trace_action> actions;
  for (const auto& e : env.alloc.trace()->events()) actions.push_back(e.action);
  auto has = [&](trace_action a) {
    return std::find(actions.begin(), actions.end(), a) != actions.end();
  };
  CHECK(has(trace_action::alloc));
  CHECK(has(trace_action::free_requested));
  CHECK(has(trace_action::free_completed));
  CHECK(has(trace_action::segment_map));
  CHECK(has(trace_action::segment_unmap));
  CHECK(has(trace_action::release_deferred));
  CHECK(has(trace_action::oom));
  CHECK(actions.front() == trace_action::segment_map);
  std::ostringstream csv;
  env.alloc.trace()->to_csv(csv);
  CHECK(csv.str().rfind("time_us,action,address,size,stream", 0) == 0);
}

TEST_CASE("roundup_power2_divisions rounds sizes to a few steps per power of two",
          "[core][config]") {
  options o = options::parse("roundup_power2_divisions:4");
  sim_env env(o);
  void* p = env.alloc.allocate(5 * MiB + 1, 0);  // between 4 and 8 MiB: steps of 1 MiB
  CHECK(env.alloc.find_block(p).size_bytes == 6 * MiB);
  void* q = env.alloc.allocate(4 * MiB, 0);  // a power of two stays
  CHECK(env.alloc.find_block(q).size_bytes == 4 * MiB);
  void* r = env.alloc.allocate(700, 0);  // small steps never go below 512 B
  CHECK(env.alloc.find_block(r).size_bytes == 1024);
  for (void* x : {p, q, r}) env.alloc.deallocate(x);
  REQUIRE_THROWS_WITH(options::parse("roundup_power2_divisions:3"),
                      Catch::Contains("power of two"));
}

TEST_CASE(
    "garbage_collection_threshold and max_cached_bytes give cached segments back before growing",
    "[core][config]") {
  for (const char* conf :
       {"memory_limit:100MB,garbage_collection_threshold:0.5", "max_cached_bytes:10MB"}) {
    INFO(conf);
    sim_env env(options::parse(conf));
    auto s1 = env.dev.create_stream();
    auto s2 = env.dev.create_stream();
    void* a = env.alloc.allocate(30 * MiB, s1);
    env.dev.launch(s1, 100, {writes(a, 30 * MiB)});
    env.alloc.deallocate(a);   // 30 MiB cached on s1, unusable by s2
    env.dev.run_until_idle();  // the trim releases only what is safe now: it never waits on a fence
                               // nobody asked for
    void* b = env.alloc.allocate(30 * MiB, s2);
    CHECK(env.alloc.stats().reserved_bytes.current == 30 * MiB);  // s1's segment went back first
    CHECK(env.dev.counters().segment_frees == 1);
    CHECK(env.dev.fault_count() == 0);  // behind its fence
    env.alloc.deallocate(b);
    env.alloc.check_invariants();
  }
  REQUIRE_THROWS_WITH(options::parse("garbage_collection_threshold:1.5"),
                      Catch::Contains("fraction"));
}

// Field case: the block-count peaks were the largest per-stream peak, below the device's
// current count when two streams hold blocks; and snapshot() read its statistics in a call of
// its own before the walk.
TEST_CASE(
    "Count peaks are never below the device's current counts; a snapshot's statistics "
    "match its walk",
    "[core][snapshot]") {
  sim_env env(make_options(backend_kind::cuda_malloc));
  const auto s1 = env.dev.create_stream();
  const auto s2 = env.dev.create_stream();
  std::vector<void*> blocks;
  for (int i = 0; i < 3; ++i) blocks.push_back(env.alloc.allocate(MiB, s1));
  for (int i = 0; i < 2; ++i) blocks.push_back(env.alloc.allocate(4 * MiB, s2));
  const statistics st = env.alloc.stats();
  CHECK(st.allocation.current == 5);
  CHECK(st.allocation.peak >= 5);
  CHECK(st.active.peak >= st.active.current);
  CHECK(st.segment.peak >= st.segment.current);

  const memory_snapshot snap = env.alloc.snapshot();
  std::int64_t active = 0, allocated = 0, reserved = 0;
  for (const auto& seg : snap.segments) {
    reserved += static_cast<std::int64_t>(seg.mapped_bytes);
    for (const auto& b : seg.blocks) {
      if (b.state == snapshot_block_state::active) {
        ++active;
        allocated += static_cast<std::int64_t>(b.size_bytes);
      }
    }
  }
  CHECK(snap.stats.allocation.current == active);
  CHECK(snap.stats.allocated_bytes.current == allocated);
  CHECK(snap.stats.reserved_bytes.current == reserved);
  CHECK(snap.stats.allocation.peak >= snap.stats.allocation.current);
  for (void* p : blocks) env.alloc.deallocate(p);
  env.alloc.check_invariants();
}
