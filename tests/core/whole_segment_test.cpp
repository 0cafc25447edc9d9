// The whole-segment rule of the cuda_malloc backend (options::whole_segment_split_ratio,
// allocator/src/core/blocks/segment_fit.hpp) on the simulated device: a wholly free segment far
// larger than a large request stays whole for a request of its own size; remainders of split
// segments and segments close in size still serve any request; at the memory limit the rule gives
// way.
#include "support/sim_fixture.hpp"
#include "support/whole_segments.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <string>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

// After a 300 MiB peak (released), a 200 MiB "logits" block is freed, a 12 MiB "activation"
// follows, then logits again. Reserved bytes stay below the earlier peak throughout.
struct logits_then_activation {
  void* logits = nullptr;
  void* activation = nullptr;
  void* logits_again = nullptr;
  std::uint64_t segment_allocs = 0, segment_frees = 0;
  std::int64_t peak_reserved = 0;
};

logits_then_activation replay_logits_then_activation(const options& o) {
  sim_env env(o);
  logits_then_activation r;
  env.alloc.deallocate(env.alloc.allocate(300 * MiB, 0));
  env.alloc.empty_cache();
  r.logits = env.alloc.allocate(200 * MiB, 0);
  env.alloc.deallocate(r.logits);
  r.activation = env.alloc.allocate(12 * MiB, 0);  // 200 > 8 x 12 and 200 - 12 > 20 MiB
  r.logits_again = env.alloc.allocate(200 * MiB, 0);
  r.segment_allocs = env.dev.counters().segment_allocs;
  r.segment_frees = env.dev.counters().segment_frees;
  r.peak_reserved = env.alloc.stats().reserved_bytes.peak;
  env.alloc.deallocate(r.logits_again);
  env.alloc.deallocate(r.activation);
  env.alloc.check_invariants();
  return r;
}

}  // namespace

TEST_CASE(
    "A wholly free segment far larger than a large request stays whole for a request of its size",
    "[core][segment-fit]") {
  REQUIRE(options{}.whole_segment_split_ratio == 8);  // the default: the rule is on
  const logits_then_activation r = replay_logits_then_activation(options{});
  CHECK_FALSE(inside(r.activation, r.logits, 200 * MiB));  // a 12 MiB segment of its own
  CHECK(r.logits_again == r.logits);                       // the big segment is still whole
  CHECK(r.segment_allocs == 3);
  CHECK(r.segment_frees == 1);  // only empty_cache's: the growth stayed below the peak
  CHECK(r.peak_reserved == static_cast<std::int64_t>(300 * MiB));
}

TEST_CASE("whole_segment_split_ratio:0 carves the request out of the free segment, as PyTorch does",
          "[core][segment-fit]") {
  const logits_then_activation r = replay_logits_then_activation(
      options::parse("whole_segment_split_ratio:0"));
  CHECK(r.activation == r.logits);    // best fit: the front of the 200 MiB segment
  CHECK(r.logits_again != r.logits);  // the segment is split: the logits need a new one
  CHECK(r.segment_allocs == 3);
  CHECK(r.peak_reserved == static_cast<std::int64_t>(400 * MiB));
}

TEST_CASE(
    "A refused whole segment goes back to the driver, behind its fence, before a growth past the "
    "peak",
    "[core][segment-fit]") {
  for (const char* conf :
       {"empty_cache:wait", "empty_cache:defer", "whole_segment_split_ratio:0"}) {
    INFO(conf);
    const std::string c = conf;
    sim_env env(options::parse(conf));
    auto s = env.dev.create_stream();
    void* logits = env.alloc.allocate(200 * MiB, s);
    env.dev.launch(s, 100, {writes(logits, 200 * MiB)}, "a kernel still writing the logits");
    env.alloc.deallocate(logits);
    void* activation = env.alloc.allocate(12 * MiB, s);  // 212 MiB would pass the 200 MiB peak
    CHECK(env.dev.fault_count() == 0);                   // nothing released under the kernel
    if (c == "empty_cache:wait" || c == "empty_cache:defer") {
      // An allocation never waits on a fence outside its out-of-memory retry, in either mode:
      // the segment is queued behind the fence, and the pool grows meanwhile.
      CHECK(env.dev.counters().segment_frees == 0);
      CHECK(env.alloc.pending_release_bytes() == 200 * MiB);
      env.dev.run_until_idle();
      env.alloc.reclaim();
      CHECK(env.dev.counters().segment_frees == 1);
    } else {  // rule off: carved out of the logits segment (same stream: no wait needed)
      CHECK(activation == logits);
      CHECK(env.dev.counters().segment_frees == 0);
    }
    CHECK(env.dev.fault_count() == 0);
    env.dev.run_until_idle();
    env.alloc.deallocate(activation);
    env.alloc.check_invariants();
  }
}

TEST_CASE("A failed release of refused segments leaves them cached and the allocation goes on",
          "[core][segment-fit][fault-injection]") {
  sim_env env;
  void* logits = env.alloc.allocate(200 * MiB, 0);
  env.alloc.deallocate(logits);
  env.dev.fail_next(sim::call::free_segment);
  void* activation = nullptr;
  REQUIRE_NOTHROW(activation = env.alloc.allocate(12 * MiB, 0));
  CHECK_FALSE(inside(activation, logits, 200 * MiB));
  CHECK(env.dev.counters().segment_frees == 0);
  env.alloc.check_invariants();
  void* again = env.alloc.allocate(200 * MiB, 0);  // still cached, still whole
  CHECK(again == logits);
  env.alloc.deallocate(again);
  env.alloc.deallocate(activation);
  env.alloc.check_invariants();
}

TEST_CASE("A whole free segment within the ratio, or within 20 MiB of the request, still serves it",
          "[core][segment-fit]") {
  sim_env env;
  void* a = env.alloc.allocate(64 * MiB, 0);
  env.alloc.deallocate(a);
  void* b = env.alloc.allocate(12 * MiB, 0);  // 64 < 8 x 12: split as before
  CHECK(b == a);
  env.alloc.deallocate(b);
  void* mid = env.alloc.allocate(2 * MiB, 0);  // a 20 MiB segment
  env.alloc.deallocate(mid);
  void* small_large = env.alloc.allocate(1536 * KiB, 0);  // 20 > 8 x 1.5 but only 18.5 MiB bigger
  CHECK(small_large == mid);
  CHECK(env.dev.counters().segment_allocs == 2);
  env.alloc.deallocate(small_large);
  env.alloc.check_invariants();
}

TEST_CASE("The free remainder of a split segment serves any request (best fit)",
          "[core][segment-fit]") {
  sim_env env;
  void* seg = env.alloc.allocate(400 * MiB, 0);
  env.alloc.deallocate(seg);
  void* front = env.alloc.allocate(100 * MiB, 0);  // 400 < 8 x 100: split, 300 MiB remain
  CHECK(front == seg);
  void* tail = env.alloc.allocate(12 * MiB, 0);  // 300 > 8 x 12, but the segment is split already
  CHECK(addr(tail) == addr(seg) + 100 * MiB);
  CHECK(env.dev.counters().segment_allocs == 1);
  env.alloc.deallocate(front);
  env.alloc.deallocate(tail);
  env.alloc.check_invariants();
}

TEST_CASE(
    "A refused whole segment that fits best gives way to a larger remainder that may be split",
    "[core][segment-fit]") {
  sim_env env;
  void* a = env.alloc.allocate(400 * MiB, 0);
  void* w = env.alloc.allocate(120 * MiB, 0);
  env.alloc.deallocate(a);
  env.alloc.deallocate(w);
  void* front = env.alloc.allocate(250 * MiB, 0);  // only the 400 MiB segment fits: 150 MiB remain
  CHECK(front == a);
  void* x = env.alloc.allocate(12 * MiB, 0);  // best fit: the whole 120 MiB segment, refused
  CHECK(addr(x) == addr(a) + 250 * MiB);      // the 150 MiB remainder instead
  CHECK(env.dev.counters().segment_allocs == 2);
  void* again = env.alloc.allocate(120 * MiB, 0);
  CHECK(again == w);
  for (void* p : {front, x, again}) env.alloc.deallocate(p);
  env.alloc.check_invariants();
}

TEST_CASE("At the memory limit the whole-segment rule gives way instead of releasing or failing",
          "[core][segment-fit]") {
  sim_env env(with_ratio(8, 210 * MiB));
  void* logits = env.alloc.allocate(200 * MiB, 0);
  env.alloc.deallocate(logits);
  void* activation = env.alloc.allocate(12 * MiB, 0);  // a 12 MiB segment would pass the limit
  CHECK(activation == logits);
  CHECK(env.dev.counters().segment_allocs == 1);
  CHECK(env.dev.counters().segment_frees == 0);  // nothing went back to the driver to make room
  CHECK(env.alloc.stats().num_alloc_retries == 0);
  env.alloc.deallocate(activation);
  env.alloc.check_invariants();
}

TEST_CASE(
    "whole_segment_split_ratio accepts 0 to 1024 and names the key and the accepted values "
    "otherwise",
    "[core][config][bad-input]") {
  CHECK(options{}.whole_segment_split_ratio == 8);
  CHECK(options::parse("whole_segment_split_ratio:0").whole_segment_split_ratio == 0);
  CHECK(options::parse("whole_segment_split_ratio:16").whole_segment_split_ratio == 16);
  CHECK(options::parse("whole_segment_split_ratio:1024").whole_segment_split_ratio == 1024);
  CHECK_THAT(options{}.to_string(), Catch::Contains("whole_segment_split_ratio:8"));
  for (const char* bad : {"whole_segment_split_ratio:1.5", "whole_segment_split_ratio:-2",
                          "whole_segment_split_ratio:1025", "whole_segment_split_ratio:1e30",
                          "whole_segment_split_ratio:eight", "whole_segment_split_ratio:"}) {
    INFO(bad);
    REQUIRE_THROWS_AS(options::parse(bad), config_error);
    REQUIRE_THROWS_WITH(options::parse(bad),
                        Catch::Contains("'whole_segment_split_ratio'") &&
                            Catch::Contains("0 (off) or a whole number from 1 to 1024"));
  }
}

TEST_CASE(
    "Whole free segments too small for a request go back before a growth past the peak, when they "
    "cover it",
    "[core][segment-fit][corpus-policy]") {
  sim_env env(with_ratio(8));
  auto s = env.dev.create_stream();
  cache_two_segments(env, s, 30 * MiB);  // two idle 30 MiB segments, each too small for 50 MiB
  void* c = env.alloc.allocate(50 * MiB, s);
  env.dev.run_until_idle();
  CHECK(env.alloc.stats().reserved_bytes.peak ==
        static_cast<std::int64_t>(60 * MiB));  // not 110 MiB
  CHECK(env.alloc.stats().reserved_bytes.current == static_cast<std::int64_t>(50 * MiB));
  env.alloc.deallocate(c);
  env.alloc.check_invariants();
}

TEST_CASE("Control: whole_segment_split_ratio:0 keeps the idle segments and grows past the peak",
          "[core][segment-fit][corpus-policy]") {
  sim_env env(with_ratio(0));
  auto s = env.dev.create_stream();
  cache_two_segments(env, s, 30 * MiB);
  void* c = env.alloc.allocate(50 * MiB, s);
  CHECK(env.alloc.stats().reserved_bytes.peak == static_cast<std::int64_t>(110 * MiB));
  env.alloc.deallocate(c);
  env.alloc.check_invariants();
}

TEST_CASE(
    "Idle whole segments of a quarter of the new segment go back before a growth past the peak",
    "[core][segment-fit][corpus-policy]") {
  sim_env env(with_ratio(8));
  auto s = env.dev.create_stream();
  cache_two_segments(env, s,
                     12 * MiB);  // 24 MiB idle in two segments: under 60 MiB, over a quarter of it
  void* c = env.alloc.allocate(60 * MiB, s);
  env.dev.run_until_idle();
  CHECK(env.alloc.stats().reserved_bytes.peak == static_cast<std::int64_t>(60 * MiB));  // not 84
  CHECK(env.alloc.stats().reserved_bytes.current == static_cast<std::int64_t>(60 * MiB));
  CHECK(env.dev.counters().segment_frees == 2);
  env.alloc.deallocate(c);
  env.alloc.check_invariants();
}

TEST_CASE(
    "Below the high-water mark of reserved bytes idle whole segments stay, also after "
    "reset_peak_stats",
    "[core][segment-fit][corpus-policy]") {
  sim_env env(with_ratio(8));
  auto s = env.dev.create_stream();
  env.alloc.deallocate(env.alloc.allocate(100 * MiB, s));
  env.alloc.empty_cache();       // nothing reserved; the most ever reserved: 100 MiB
  env.alloc.reset_peak_stats();  // the statistic restarts at 0, the growth policy's mark stays
  cache_two_segments(env, s, 12 * MiB);  // 24 MiB idle, over a quarter of 60 MiB
  // 24 + 60 = 84 MiB stays under the mark: nothing is worth a cudaFree.
  void* c = env.alloc.allocate(60 * MiB, s);
  CHECK(env.dev.counters().segment_frees == 1);  // the 100 MiB segment, at empty_cache
  CHECK(env.alloc.stats().reserved_bytes.current == static_cast<std::int64_t>(84 * MiB));
  CHECK(env.alloc.stats().reserved_bytes.peak == static_cast<std::int64_t>(84 * MiB));
  env.alloc.deallocate(c);
  env.alloc.check_invariants();
}

TEST_CASE("Idle whole segments under a quarter of the new segment stay cached",
          "[core][segment-fit][corpus-policy]") {
  sim_env env(with_ratio(8));
  auto s = env.dev.create_stream();
  void* a = env.alloc.allocate(12 * MiB, s);
  env.alloc.deallocate(a);  // 12 MiB idle: under a quarter of 60 MiB, not worth a cudaFree
  void* c = env.alloc.allocate(60 * MiB, s);
  CHECK(env.alloc.stats().reserved_bytes.peak == static_cast<std::int64_t>(72 * MiB));
  CHECK(env.dev.counters().segment_frees == 0);
  env.alloc.deallocate(c);
  env.alloc.check_invariants();
}

TEST_CASE(
    "A growth past the peak takes another stream's whole free segment, behind an event wait, "
    "instead of a new one",
    "[core][segment-fit][corpus-policy]") {
  sim_env env(with_ratio(8));
  auto s1 = env.dev.create_stream();
  auto s2 = env.dev.create_stream();
  void* a = env.alloc.allocate(100 * MiB, s1);
  auto h = env.dev.hold(s1);
  env.dev.launch(s1, 10, {writes(a, 100 * MiB, 0xA1)}, "s1 writes a, behind a hold");
  env.alloc.deallocate(a);  // a whole free 100 MiB segment of s1's pool, s1's write pending
  void* b = env.alloc.allocate(60 * MiB, s2);  // would be a new 60 MiB segment past the peak
  CHECK(inside(b, a, 100 * MiB));
  CHECK(env.dev.counters().segment_allocs == 1);
  CHECK(env.alloc.stats().reserved_bytes.peak == static_cast<std::int64_t>(100 * MiB));
  CHECK(env.alloc.stats().segments_moved == 1);
  env.dev.launch(s2, 10, {writes(b, 60 * MiB, 0xB2)}, "s2 writes b");
  env.dev.open(h);
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);  // s2's write waited for s1's
  CHECK(env.dev.value_at(addr(b)) == std::optional<std::uint8_t>(0xB2));
  env.alloc.deallocate(b);
  env.alloc.check_invariants();
}
