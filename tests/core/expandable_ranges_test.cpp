// The expandable backend runs out of memory only when the memory is not there, on
// the simulated device: a request that does not fit in the holes of a (stream, pool)'s
// reserved address range is served after a safe release and remapping (a second range, or
// moving the mapped chunks), as the cuda_malloc backend serves it.
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

options limited(backend_kind backend, std::size_t limit_bytes) {
  options o = make_options(backend);
  o.memory_limit_bytes = limit_bytes;
  return o;
}

// Five 200 MiB blocks under a 1 GiB limit, the 2nd and 4th freed, the cache emptied: 600 MiB
// allocated, 424 MiB free under the limit, no hole larger than 200 MiB.
struct holes_env : sim_env {
  stream_handle s;
  std::vector<void*> blocks;
  explicit holes_env(backend_kind backend)
      : sim_env(limited(backend, 1 * GiB)), s(dev.create_stream()) {
    for (int i = 0; i < 5; ++i) {
      blocks.push_back(alloc.allocate(200 * MiB, s));
      dev.launch(s, 10, {writes(blocks.back(), 200 * MiB, static_cast<std::uint8_t>(i))}, "fill");
    }
    alloc.deallocate(blocks[1]);
    alloc.deallocate(blocks[3]);
    alloc.empty_cache();
  }
};

}  // namespace

TEST_CASE(
    "Expandable, 1 GiB limit: five 200 MiB blocks, free the 2nd and 4th, empty_cache, 300 MiB is "
    "served",
    "[core][expandable]") {
  holes_env env(backend_kind::expandable);
  CHECK(env.alloc.stats().allocated_bytes.current == static_cast<std::int64_t>(600 * MiB));
  void* p = nullptr;
  std::string error;
  try {
    p = env.alloc.allocate(300 * MiB, env.s);
  } catch (const out_of_memory& e) {
    error = e.what();
  }
  INFO(error);
  REQUIRE(p != nullptr);
  CHECK(env.alloc.stats().reserved_bytes.current <= static_cast<std::int64_t>(1 * GiB));
  env.dev.launch(env.s, 10, {writes(p, 300 * MiB, 0x77)}, "use of the 300 MiB block");
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  // The live blocks kept their contents: nothing under them was unmapped or remapped.
  CHECK(env.dev.value_at(addr(env.blocks[0])) == std::optional<std::uint8_t>(0));
  CHECK(env.dev.value_at(addr(env.blocks[2])) == std::optional<std::uint8_t>(2));
  CHECK(env.dev.value_at(addr(env.blocks[4])) == std::optional<std::uint8_t>(4));
  CHECK(env.dev.value_at(addr(p)) == std::optional<std::uint8_t>(0x77));
  env.alloc.deallocate(p);
  env.alloc.check_invariants();
}

TEST_CASE(
    "Control: cuda_malloc, 1 GiB limit: five 200 MiB blocks, free the 2nd and 4th, empty_cache, "
    "300 MiB is "
    "served",
    "[core][expandable]") {
  holes_env env(backend_kind::cuda_malloc);
  void* p = env.alloc.allocate(300 * MiB, env.s);
  CHECK(p != nullptr);
  env.alloc.deallocate(p);
  env.alloc.check_invariants();
}

TEST_CASE("Expandable, 1 GiB limit: a request beyond the memory really free is still out_of_memory",
          "[core][expandable]") {
  holes_env env(backend_kind::expandable);
  CHECK_THROWS_AS(env.alloc.allocate(500 * MiB, env.s), out_of_memory);  // 600 + 500 > 1024
  env.alloc.check_invariants();
}

TEST_CASE(
    "Expandable, long random runs with many sizes never run out of memory while allocated + "
    "request stays "
    "under the limit minus the stated slack",
    "[core][expandable]") {
  // Slack: two mapping chunks (20 MiB each) per live block plus two, for chunks shared with
  // live neighbours, and 8 MiB for the small pool. Sizes 1-300 MiB (large pool) and some
  // 4 KiB-1 MiB (small pool), 3,000 operations per seed, up to 12 live blocks.
  constexpr std::size_t limit = 1 * GiB;
  constexpr std::size_t chunk = 20 * MiB;
  const std::uint64_t seed = GENERATE(1, 2, 3, 4, 5);
  INFO("seed " << seed);
  options o = limited(backend_kind::expandable, limit);
  sim_env env(o);
  auto s = env.dev.create_stream();
  std::mt19937_64 rng(seed);
  std::vector<void*> live;
  std::size_t ooms = 0, served = 0;
  std::string first_oom;
  for (int op = 0; op < 3000; ++op) {
    const bool do_free = !live.empty() && (live.size() >= 12 || rng() % 2 == 0);
    if (do_free) {
      const std::size_t i = static_cast<std::size_t>(rng() % live.size());
      env.alloc.deallocate(live[i]);
      live[i] = live.back();
      live.pop_back();
      if (rng() % 8 == 0) env.alloc.empty_cache();
      continue;
    }
    const std::size_t size = rng() % 5 == 0 ? 4 * KiB + rng() % MiB : MiB + rng() % (300 * MiB);
    const std::size_t rounded = (size + 511) / 512 * 512;
    const auto allocated = static_cast<std::size_t>(env.alloc.stats().allocated_bytes.current);
    const std::size_t slack = (2 * live.size() + 2) * chunk + 8 * MiB;
    if (allocated + rounded + slack > limit) continue;  // not promised
    try {
      live.push_back(env.alloc.allocate(size, s));
      env.dev.launch(s, 1, {writes(live.back(), size)}, "use");
      ++served;
    } catch (const out_of_memory& e) {
      if (ooms++ == 0) first_oom = std::to_string(op) + ": " + e.what();
    }
  }
  INFO("served " << served << ", first out_of_memory at op " << first_oom);
  CHECK(ooms == 0);
  for (void* p : live) env.alloc.deallocate(p);
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}

TEST_CASE(
    "Expandable: idle mapped chunks are unmapped before a large growth past the peak that they "
    "cover",
    "[core][expandable][corpus-policy]") {
  // A 100 MiB, B 20 MiB, C 100 MiB; A and C freed: 200 MiB idle. 150 MiB would map 60 MiB more
  // after C (peak 280 MiB); unmapping A and C first keeps the peak at 220 MiB.
  sim_env env(make_options(backend_kind::expandable));
  auto s = env.dev.create_stream();
  void* a = env.alloc.allocate(100 * MiB, s);
  void* b = env.alloc.allocate(20 * MiB, s);
  void* c = env.alloc.allocate(100 * MiB, s);
  env.dev.launch(s, 10, {writes(b, 20 * MiB, 0x42)}, "fill b");
  env.alloc.deallocate(a);
  env.alloc.deallocate(c);
  void* d = env.alloc.allocate(150 * MiB, s);
  env.dev.launch(s, 10, {writes(d, 150 * MiB, 0x43)}, "use d");
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  CHECK(env.dev.value_at(addr(b)) == std::optional<std::uint8_t>(0x42));
  CHECK(env.alloc.stats().reserved_bytes.peak == static_cast<std::int64_t>(220 * MiB));
  env.alloc.deallocate(b);
  env.alloc.deallocate(d);
  env.alloc.check_invariants();
}

TEST_CASE("Expandable: a growth maps what the request lacks, the last chunk cut to the granularity",
          "[core][expandable][corpus-policy]") {
  sim_env env(make_options(backend_kind::expandable));  // 20 MiB chunks in large pools
  auto s = env.dev.create_stream();
  void* a = env.alloc.allocate(30 * MiB, s);  // a 20 MiB chunk and a 10 MiB one, not two of 20
  CHECK(env.alloc.stats().reserved_bytes.current == static_cast<std::int64_t>(30 * MiB));
  CHECK(env.dev.counters().maps == 2);
  void* b = env.alloc.allocate(3 * MiB, s);  // after a, in a chunk of its own (4 MiB)
  CHECK(env.alloc.stats().reserved_bytes.current == static_cast<std::int64_t>(34 * MiB));
  CHECK(env.dev.counters().maps == 3);
  env.alloc.deallocate(a);
  // a's chunks lie wholly inside its block: all 30 MiB can be unmapped while b lives.
  CHECK(env.alloc.empty_cache() == 30 * MiB);
  CHECK(env.alloc.stats().num_device_free == 2);
  env.alloc.deallocate(b);
  env.alloc.check_invariants();
}

TEST_CASE(
    "expandable_peak_chunk_mb:2: a growth past the high-water mark of reserved bytes maps 2 MiB "
    "chunks, memory mapped again below it 20 MiB chunks, and reset_peak_stats does not move the "
    "mark",
    "[core][expandable][corpus-policy]") {
  sim_env env(options::parse("backend:expandable,expandable_peak_chunk_mb:2"));
  auto s = env.dev.create_stream();
  void* a = env.alloc.allocate(100 * MiB, s);  // 0 -> 100 MiB: past the mark, fifty 2 MiB chunks
  CHECK(env.dev.counters().maps == 50);
  env.alloc.deallocate(a);
  CHECK(env.alloc.empty_cache() == 100 * MiB);
  env.alloc.reset_peak_stats();  // the statistic's peak restarts at 0; the mark stays 100 MiB
  CHECK(env.alloc.stats().reserved_bytes.peak == 0);
  void* b = env.alloc.allocate(100 * MiB, s);  // below the mark: five 20 MiB chunks
  CHECK(env.dev.counters().maps == 55);
  void* c = env.alloc.allocate(30 * MiB, s);  // 100 -> 130 MiB: past it again, fifteen of 2 MiB
  CHECK(env.dev.counters().maps == 70);
  env.dev.launch(s, 10, {writes(b, 100 * MiB, 0x42), writes(c, 30 * MiB, 0x43)}, "use b, c");
  env.alloc.deallocate(b);
  // b's 20 MiB chunks and c's 2 MiB chunks each unmap whole: all of b's 100 MiB goes back.
  CHECK(env.alloc.empty_cache() == 100 * MiB);
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  CHECK(env.dev.value_at(addr(c)) == std::optional<std::uint8_t>(0x43));
  env.alloc.deallocate(c);
  CHECK(env.alloc.empty_cache() == 30 * MiB);
  // A growth that crosses the mark (now 130 MiB): 134 MiB maps 130 below it in 20 MiB chunks (the
  // last one 10 MiB) and the 4 MiB past it in two of 2 MiB.
  const auto maps = env.dev.counters().maps;
  void* d = env.alloc.allocate(134 * MiB, s);
  CHECK(env.dev.counters().maps == maps + 9);
  env.alloc.deallocate(d);
  env.alloc.check_invariants();
}

TEST_CASE(
    "expandable_peak_chunk_mb:2, defer mode: the next step reclaims the last step's chunks still "
    "queued for release and maps nothing",
    "[core][expandable][corpus-policy]") {
  sim_env env(options::parse("backend:expandable,empty_cache:defer,expandable_peak_chunk_mb:2"));
  auto s = env.dev.create_stream();
  auto t = env.dev.create_stream();
  void* a = env.alloc.allocate(100 * MiB, t);  // past the mark: fifty 2 MiB chunks
  CHECK(env.dev.counters().maps == 50);
  env.dev.launch(t, 1000, {writes(a, 100 * MiB, 0x41)}, "the last step's kernel, still queued");
  env.alloc.deallocate(a);
  env.alloc.empty_cache();  // t is busy: a's chunks wait in the queue, still reserved
  CHECK(env.alloc.pending_release_bytes() == 100 * MiB);
  CHECK(env.alloc.stats().reserved_bytes.current == static_cast<std::int64_t>(100 * MiB));
  // The next step, on another stream: the queued chunks are mapped again into its range behind
  // a device-side wait on their fence (no new memory), and reserved stays at 100 MiB.
  void* b = env.alloc.allocate(100 * MiB, s);
  CHECK(env.dev.counters().maps == 50);
  CHECK(env.dev.counters().aliases == 1);
  CHECK(env.alloc.stats().reserved_bytes.peak == static_cast<std::int64_t>(100 * MiB));
  env.dev.launch(s, 10, {writes(b, 100 * MiB, 0x42)}, "use b");
  env.dev.run_until_idle();
  env.alloc.reclaim();
  CHECK(env.alloc.pending_release_bytes() == 0);
  CHECK(env.dev.fault_count() == 0);
  env.alloc.deallocate(b);
  env.alloc.check_invariants();
}

TEST_CASE("expandable_peak_chunk_mb: parsed in MiB, a multiple of 2, at most the chunk in effect",
          "[core][expandable][corpus-policy][config]") {
  CHECK(options{}.expandable_peak_chunk_bytes == 20 * MiB);  // off: one chunk size
  CHECK(options::parse("expandable_peak_chunk_mb:4").expandable_peak_chunk_bytes == 4 * MiB);
  CHECK_THAT(options::parse("expandable_peak_chunk_mb:4").to_string(),
             Catch::Contains("expandable_peak_chunk_mb:4"));
  for (const char* bad :
       {"expandable_peak_chunk_mb:3", "expandable_peak_chunk_mb:0", "expandable_peak_chunk_mb:-2",
        "expandable_peak_chunk_mb:two", "expandable_peak_chunk_mb:2.5",
        "expandable_peak_chunk_mb:2.0000001", "expandable_peak_chunk_mb:1e9",
        "expandable_peak_chunk_mb:", "expandable_chunk_mb:4.5"}) {
    INFO(bad);
    CHECK_THROWS_WITH(options::parse(bad), Catch::Contains("expandable_"));
  }
  // Larger than expandable_chunk_mb: the chunk size itself, one size for every growth.
  sim_env env(
      options::parse("backend:expandable,expandable_chunk_mb:20,expandable_peak_chunk_mb:40"));
  auto s = env.dev.create_stream();
  void* a = env.alloc.allocate(100 * MiB, s);
  CHECK(env.dev.counters().maps == 5);
  env.alloc.deallocate(a);
  env.alloc.check_invariants();
}

TEST_CASE(
    "expandable_chunks_per_peak: an allocator whose peak is small against the chunk maps chunks "
    "small against its peak, a large growth keeps larger chunks",
    "[core][expandable][corpus-policy][config]") {
  CHECK(options::parse("expandable_chunks_per_peak:256").expandable_chunks_per_peak == 256);
  CHECK_THAT(options::parse("expandable_chunks_per_peak:64").to_string(),
             Catch::Contains("expandable_chunks_per_peak:64"));
  for (const char* bad : {"expandable_chunks_per_peak:-1", "expandable_chunks_per_peak:1.5",
                          "expandable_chunks_per_peak:65537", "expandable_chunks_per_peak:many",
                          "expandable_chunks_per_peak:"}) {
    INFO(bad);
    CHECK_THROWS_WITH(options::parse(bad), Catch::Contains("expandable_chunks_per_peak"));
  }
  struct row {
    const char* conf;
    std::size_t small_maps, large_maps;  // after 100 MiB, then after 1 GiB more
  };
  const row r = GENERATE(row{"backend:expandable,expandable_chunks_per_peak:0", 5, 5 + 52},
                         // 100 MiB / 256 is under a granule: 2 MiB chunks; then 1124 MiB / 256
                         // is 4.39 MiB: 4 MiB chunks
                         row{"backend:expandable,expandable_chunks_per_peak:256", 50, 50 + 256},
                         // 100 MiB / 64: 1.56 MiB, 2 MiB chunks; 1124 / 64 = 17.6: 16 MiB
                         row{"backend:expandable,expandable_chunks_per_peak:64", 50, 50 + 64});
  INFO(r.conf);
  sim_env env(options::parse(r.conf));
  auto s = env.dev.create_stream();
  void* a = env.alloc.allocate(100 * MiB, s);
  CHECK(env.dev.counters().maps == r.small_maps);
  void* b = env.alloc.allocate(1024 * MiB, s);
  CHECK(env.dev.counters().maps == r.large_maps);
  env.alloc.deallocate(a);
  env.alloc.deallocate(b);
  env.alloc.check_invariants();
}

TEST_CASE(
    "Expandable: before a growth past the peak, the smallest idle runs are unmapped, only as many "
    "bytes as the growth exceeds the peak by (also after reset_peak_stats)",
    "[core][expandable][corpus-policy]") {
  const bool reset = GENERATE(false, true);
  INFO("reset_peak_stats after empty_cache: " << reset);
  sim_env env(make_options(backend_kind::expandable));
  auto s = env.dev.create_stream();
  env.alloc.deallocate(env.alloc.allocate(180 * MiB, s));
  env.alloc.empty_cache();  // peak reserved 180 MiB, nothing mapped
  // The statistic restarts at 0; the growth policy keeps 180 MiB as its peak.
  if (reset) env.alloc.reset_peak_stats();
  void* a = env.alloc.allocate(40 * MiB, s);
  void* b = env.alloc.allocate(20 * MiB, s);
  void* c = env.alloc.allocate(60 * MiB, s);
  void* d = env.alloc.allocate(20 * MiB, s);
  env.dev.launch(s, 10, {writes(b, 20 * MiB, 0x42), writes(d, 20 * MiB, 0x44)}, "fill b, d");
  env.alloc.deallocate(a);
  env.alloc.deallocate(c);  // idle: 40 and 60 MiB between live blocks; 140 MiB mapped
  // 80 MiB fits neither hole: mapping it raises reserved to 220 MiB, 40 past the peak. The 40 MiB
  // hole is unmapped first; the 60 MiB one stays mapped for a later request.
  void* e = env.alloc.allocate(80 * MiB, s);
  env.dev.launch(s, 10, {writes(e, 80 * MiB, 0x45)}, "use e");
  CHECK(env.alloc.stats().reserved_bytes.peak == static_cast<std::int64_t>(180 * MiB));
  CHECK(env.alloc.stats().reserved_bytes.current == static_cast<std::int64_t>(180 * MiB));
  const auto maps = env.dev.counters().maps;
  void* f = env.alloc.allocate(60 * MiB, s);  // the hole left mapped: no map
  CHECK(env.dev.counters().maps == maps);
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  CHECK(env.dev.value_at(addr(b)) == std::optional<std::uint8_t>(0x42));
  CHECK(env.dev.value_at(addr(d)) == std::optional<std::uint8_t>(0x44));
  for (void* p : {b, d, e, f}) env.alloc.deallocate(p);
  env.alloc.check_invariants();
}
