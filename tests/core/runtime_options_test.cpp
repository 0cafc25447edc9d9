// The options a program may change while the allocator runs (PyTorch's
// _set_allocator_settings): max_split_size, garbage_collection_threshold and
// roundup_power2_divisions, the last also in PyTorch's per-size list form.
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

std::size_t rounded_size(sim_env& env, std::size_t bytes) {
  void* p = env.alloc.allocate(bytes, 0);
  const std::size_t size = env.alloc.find_block(p).size_bytes;
  env.alloc.deallocate(p);
  return size;
}

}  // namespace

TEST_CASE(
    "roundup_power2_divisions in PyTorch's list form rounds each size interval by its own "
    "divisions",
    "[core][config]") {
  const options o = options::parse(
      "roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1],memory_limit:4GiB");
  sim_env env(o);
  CHECK(rounded_size(env, 5 * MiB + 1) == 5 * MiB + 512 * KiB);  // below 64 MiB: the first entry
  CHECK(rounded_size(env, 84 * MiB) == 88 * MiB);                // 64 to 128 MiB: 8 steps of 8 MiB
  CHECK(rounded_size(env, 400 * MiB) == 512 * MiB);              // 256 to 512 MiB: 2 steps
  CHECK(rounded_size(env, 1025 * MiB) == 1026 * MiB);  // 1 division: no rounding (2 MiB large)
  CHECK(rounded_size(env, 128 * MiB) == 128 * MiB);    // a power of two stays
  CHECK(options::parse(o.to_string()).roundup_power2_divisions == o.roundup_power2_divisions);

  const options tail = options::parse("roundup_power2_divisions:[>:4]");
  CHECK(tail.roundup_power2_divisions.for_size(1 * MiB) == 0);  // '>' after no entry: from 2 MiB
  CHECK(tail.roundup_power2_divisions.for_size(2 * MiB) == 4);
  CHECK(tail.roundup_power2_divisions.for_size(std::size_t{1} << 40) == 4);
  // A boundary of 2^50 MiB (past size_t in bytes) names the last interval, from 32 GiB.
  const options huge = options::parse("roundup_power2_divisions:[1:2,1125899906842624:8]");
  CHECK(huge.roundup_power2_divisions.for_size(std::size_t{1} << 40) == 8);
  CHECK(huge.roundup_power2_divisions.for_size(1 * MiB) == 2);
  CHECK(huge.roundup_power2_divisions.for_size(1 * GiB) == 0);  // named by no entry
  CHECK(options::parse("roundup_power2_divisions:[]").roundup_power2_divisions ==
        power2_divisions{});
}

TEST_CASE("A bad roundup_power2_divisions list is refused naming what is wrong",
          "[core][config][bad-input]") {
  REQUIRE_THROWS_WITH(options::parse("roundup_power2_divisions:[3:4]"),
                      Catch::Contains("'3'") && Catch::Contains("power of two"));
  REQUIRE_THROWS_WITH(options::parse("roundup_power2_divisions:[64:3]"),
                      Catch::Contains("'3'") && Catch::Contains("power of two"));
  REQUIRE_THROWS_WITH(options::parse("roundup_power2_divisions:[64:8,128:2"),
                      Catch::Contains("']'"));
  REQUIRE_THROWS_WITH(options::parse("roundup_power2_divisions:[64]"),
                      Catch::Contains("'64'") && Catch::Contains("boundary:divisions"));
  REQUIRE_THROWS_WITH(options::parse("roundup_power2_divisions:[128:2,64:8]"),
                      Catch::Contains("increas"));
  REQUIRE_THROWS_WITH(options::parse("roundup_power2_divisions:[>:2,64:8]"),
                      Catch::Contains("last"));
}

TEST_CASE("roundup_power2_divisions changed at runtime rounds the allocations that follow",
          "[core][config]") {
  sim_env env;
  CHECK(rounded_size(env, 84 * MiB) == 84 * MiB);
  runtime_options r = runtime_options::of(env.alloc.config());
  r.roundup_power2_divisions =
      options::parse("roundup_power2_divisions:[64:8,>:2]").roundup_power2_divisions;
  env.alloc.set_runtime_options(r);
  CHECK(rounded_size(env, 84 * MiB) == 88 * MiB);
  CHECK(rounded_size(env, 400 * MiB) == 512 * MiB);
  env.alloc.set_runtime_options(runtime_options{});  // back to no rounding
  CHECK(rounded_size(env, 84 * MiB) == 84 * MiB);
  env.alloc.check_invariants();
}

TEST_CASE("max_split_size changed at runtime stops the split of larger blocks from then on",
          "[core][config]") {
  sim_env env;
  void* big = env.alloc.allocate(64 * MiB, 0);
  env.alloc.deallocate(big);
  void* carved = env.alloc.allocate(12 * MiB, 0);  // no limit yet: carved out of the 64 MiB
  CHECK(carved == big);
  env.alloc.deallocate(carved);

  runtime_options r;
  r.max_split_size_bytes = 40 * MiB;
  env.alloc.set_runtime_options(r);
  CHECK(env.alloc.config().max_split_size_bytes == 40 * MiB);
  void* small = env.alloc.allocate(14 * MiB, 0);  // the 64 MiB block now stays whole
  CHECK(small != big);
  void* again = env.alloc.allocate(60 * MiB, 0);  // close in size: takes it whole
  CHECK(again == big);
  CHECK(env.alloc.find_block(again).size_bytes == 64 * MiB);
  env.alloc.deallocate(small);
  env.alloc.deallocate(again);
  env.alloc.check_invariants();
}

TEST_CASE(
    "garbage_collection_threshold changed at runtime gives cached segments back before "
    "the next growth",
    "[core][config]") {
  sim_env env(options::parse("memory_limit:100MB"));
  auto s1 = env.dev.create_stream();
  auto s2 = env.dev.create_stream();
  void* a = env.alloc.allocate(30 * MiB, s1);
  env.dev.launch(s1, 100, {writes(a, 30 * MiB)});
  env.alloc.deallocate(a);  // 30 MiB cached on s1, unusable by s2
  env.dev.run_until_idle();
  runtime_options r;
  r.garbage_collection_threshold = 0.5;
  env.alloc.set_runtime_options(r);
  void* b = env.alloc.allocate(30 * MiB, s2);  // 60 of 100 MiB would pass the threshold
  CHECK(env.alloc.stats().reserved_bytes.current == 30 * MiB);
  CHECK(env.dev.counters().segment_frees == 1);
  CHECK(env.dev.fault_count() == 0);
  env.alloc.deallocate(b);
  env.alloc.check_invariants();
}

TEST_CASE("A bad runtime option is refused with a clear error and nothing changes",
          "[core][config][bad-input]") {
  sim_env env(options::parse("max_split_size_mb:64,garbage_collection_threshold:0.25"));
  const std::string before = env.alloc.config().to_string();
  runtime_options good = runtime_options::of(env.alloc.config());
  good.roundup_power2_divisions = 4;

  runtime_options r = good;
  r.max_split_size_bytes = 5 * MiB;
  REQUIRE_THROWS_WITH(env.alloc.set_runtime_options(r),
                      Catch::Contains("max_split_size_mb") && Catch::Contains("at least 20"));
  r = good;
  r.garbage_collection_threshold = 1.5;
  REQUIRE_THROWS_WITH(
      env.alloc.set_runtime_options(r),
      Catch::Contains("garbage_collection_threshold") && Catch::Contains("fraction"));
  r = good;
  r.roundup_power2_divisions.by_interval[3] = 3;
  REQUIRE_THROWS_AS(env.alloc.set_runtime_options(r), config_error);
  REQUIRE_THROWS_WITH(
      env.alloc.set_runtime_options(r),
      Catch::Contains("roundup_power2_divisions") && Catch::Contains("power of two"));
  CHECK(env.alloc.config().to_string() == before);
  CHECK(rounded_size(env, 5 * MiB + 1) == 5 * MiB + 512);  // no rounding came in
}
