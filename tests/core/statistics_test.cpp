// Statistics as PyTorch reports them: device-wide peaks of every counter (bytes and counts), a
// snapshot's statistics equal to its walk while other threads allocate, free and empty the cache.
#include "support/sim_fixture.hpp"

#include <streamsafe/core/sleep.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

// Every counter of `s` of every pool kind, by PyTorch's name ("segment.small_pool"), for checks
// over all of them.
std::vector<std::pair<std::string, stat>> counters_of(const statistics& s) {
  std::vector<std::pair<std::string, stat>> out;
  const std::pair<const char*, const pool_statistics*> kinds[] = {
      {"all", &s}, {"small_pool", &s.small_pool}, {"large_pool", &s.large_pool}};
  for (const auto& [kind, x] : kinds) {
    const std::string k = std::string(".") + kind;
    out.insert(out.end(), {{"allocated_bytes" + k, x->allocated_bytes},
                           {"reserved_bytes" + k, x->reserved_bytes},
                           {"active_bytes" + k, x->active_bytes},
                           {"inactive_split_bytes" + k, x->inactive_split_bytes},
                           {"requested_bytes" + k, x->requested_bytes},
                           {"allocation" + k, x->allocation},
                           {"segment" + k, x->segment},
                           {"active" + k, x->active}});
  }
  return out;
}

// Checks that the small and large pool counters add up to every pool's (current, allocated,
// freed; peaks need not: the two kinds may peak at different times).
void check_kinds_add_up(const statistics& s) {
  const auto c = counters_of(s);
  const std::size_t n = c.size() / 3;
  for (std::size_t i = 0; i < n; ++i) {
    const stat& all = c[i].second;
    const stat& small = c[n + i].second;
    const stat& large = c[2 * n + i].second;
    INFO(c[i].first << ": all " << all.current << ", small " << small.current << ", large "
                    << large.current);
    CHECK(small.current + large.current == all.current);
    CHECK(small.allocated + large.allocated == all.allocated);
    CHECK(small.freed + large.freed == all.freed);
    CHECK(all.peak <= small.peak + large.peak);
    CHECK(all.peak >= std::max(small.peak, large.peak));
  }
}

// Checks that every peak is at least its current value and at least every current value seen
// since the last reset (`seen`, by counter, raised here).
void check_peaks(const statistics& s, std::vector<std::int64_t>& seen) {
  const auto all = counters_of(s);
  seen.resize(all.size(), 0);
  for (std::size_t i = 0; i < all.size(); ++i) {
    const auto& [name, st] = all[i];
    INFO(name << ": current " << st.current << ", peak " << st.peak << ", largest seen "
              << seen[i]);
    CHECK(st.peak >= st.current);
    seen[i] = std::max(seen[i], st.current);
    CHECK(st.peak >= seen[i]);
  }
}

constexpr auto k_block_bytes = static_cast<std::int64_t>(256 * KiB);

// A snapshot's totals from its walk, by kind: [0] every segment, [1] small pools', [2] large's.
struct walk_totals {
  std::int64_t mapped[3] = {}, allocated[3] = {}, active_bytes[3] = {}, requested[3] = {};
  std::int64_t allocations[3] = {}, active[3] = {}, segments[3] = {};

  explicit walk_totals(const memory_snapshot& snap) {
    for (const segment_snapshot& seg : snap.segments) {
      add(seg, 0);
      add(seg, seg.pool == snapshot_pool::small ? 1 : 2);
    }
  }
  void add(const segment_snapshot& seg, std::size_t k) {
    ++segments[k];
    mapped[k] += static_cast<std::int64_t>(seg.mapped_bytes);
    for (const block_snapshot& b : seg.blocks) {
      if (b.state == snapshot_block_state::active) {
        ++allocations[k];
        allocated[k] += static_cast<std::int64_t>(b.size_bytes);
        requested[k] += static_cast<std::int64_t>(b.requested_bytes);
      }
      if (b.state == snapshot_block_state::active ||
          b.state == snapshot_block_state::pending_free) {
        ++active[k];
        active_bytes[k] += static_cast<std::int64_t>(b.size_bytes);
      }
    }
  }
};

}  // namespace

TEST_CASE(
    "Device-wide peaks: two streams peaking at different times give the largest sum, not the sum "
    "of their peaks nor the largest stream's peak",
    "[core][statistics]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  INFO("backend " << to_string(backend));
  sim_env env(make_options(backend));
  const auto s1 = env.dev.create_stream();
  const auto s2 = env.dev.create_stream();
  // s1 holds 4 blocks of 256 KiB, s2 one: 5 blocks, 1.25 MiB at once. Then s1 frees its blocks
  // and s2 takes 3 more: s2 peaks at 4 blocks (1 MiB) on its own. Largest stream peak 4 blocks,
  // sum of the stream peaks 8, device-wide 5.
  std::vector<void*> on1, on2;
  for (int i = 0; i < 4; ++i) on1.push_back(env.alloc.allocate(256 * KiB, s1));
  on2.push_back(env.alloc.allocate(256 * KiB, s2));
  for (void* p : on1) env.alloc.deallocate(p);
  for (int i = 0; i < 3; ++i) on2.push_back(env.alloc.allocate(256 * KiB, s2));
  const statistics s = env.alloc.stats();
  CHECK(s.allocation.current == 4);
  CHECK(s.allocation.peak == 5);
  CHECK(s.active.peak == 5);
  CHECK(s.allocated_bytes.peak == 5 * k_block_bytes);
  CHECK(s.active_bytes.peak == 5 * k_block_bytes);
  CHECK(s.requested_bytes.peak == 5 * k_block_bytes);

  // After a reset the peaks are the current values, and a later device-wide high counts again.
  env.alloc.reset_peak_stats();
  const statistics r = env.alloc.stats();
  CHECK(r.allocation.peak == 4);
  CHECK(r.active.peak == 4);
  on1.clear();
  on1.push_back(env.alloc.allocate(256 * KiB, s1));
  env.alloc.deallocate(on1.back());
  const statistics after = env.alloc.stats();
  CHECK(after.allocation.peak == 5);
  CHECK(after.allocated_bytes.peak == 5 * k_block_bytes);
  for (void* p : on2) env.alloc.deallocate(p);
  env.alloc.check_invariants();
}

TEST_CASE(
    "One stream: a peak of every pool's counters that neither the small nor the large pool's "
    "peak shows is reported",
    "[core][statistics]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  INFO("backend " << to_string(backend));
  sim_env env(make_options(backend));
  const stream_handle s = 0;  // the only stream the allocator knows: no sample unless a peak rose
  // 8 small blocks of 1 MiB, freed: the small pool peaks at 8. One 8 MiB block, freed: the
  // large pool peaks at 8 MiB. Then 7 small blocks, a 7 MiB block and one more small block at
  // once: each pool at or below its own peak, every pool's counters at 15 MiB and 9 blocks.
  std::vector<void*> small;
  for (int i = 0; i < 8; ++i) small.push_back(env.alloc.allocate(1 * MiB, s));
  for (void* p : small) env.alloc.deallocate(p);
  void* large = env.alloc.allocate(8 * MiB, s);
  env.alloc.deallocate(large);
  small.clear();
  for (int i = 0; i < 7; ++i) small.push_back(env.alloc.allocate(1 * MiB, s));
  large = env.alloc.allocate(7 * MiB, s);
  env.alloc.deallocate(env.alloc.allocate(1 * MiB, s));
  env.alloc.deallocate(large);  // read below the peak: stats() never reports a peak below current
  const statistics st = env.alloc.stats();
  CHECK(st.small_pool.allocated_bytes.peak == static_cast<std::int64_t>(8 * MiB));
  CHECK(st.large_pool.allocated_bytes.peak == static_cast<std::int64_t>(8 * MiB));
  CHECK(st.allocated_bytes.peak == static_cast<std::int64_t>(15 * MiB));
  CHECK(st.requested_bytes.peak == static_cast<std::int64_t>(15 * MiB));
  CHECK(st.active_bytes.peak == static_cast<std::int64_t>(15 * MiB));
  CHECK(st.allocation.peak == 9);
  CHECK(st.active.peak == 9);
  CHECK(st.allocated_bytes.current == static_cast<std::int64_t>(7 * MiB));
  CHECK(st.allocation.current == 7);
  for (void* p : small) env.alloc.deallocate(p);
  env.alloc.check_invariants();
}

TEST_CASE(
    "Small and large pool counters: PyTorch's 1 MiB boundary, tagged and graph pools included, "
    "adding up to all",
    "[core][statistics][graph]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  INFO("backend " << to_string(backend));
  sim_env env(make_options(backend));
  const auto s = env.dev.create_stream();
  const auto capture = env.dev.create_stream();
  void* small = env.alloc.allocate(MiB, s);  // 1 MiB exactly: still small
  void* large = env.alloc.allocate(MiB + 1, s);
  statistics st = env.alloc.stats();
  CHECK(st.small_pool.allocation.current == 1);
  CHECK(st.large_pool.allocation.current == 1);
  CHECK(st.small_pool.allocated_bytes.current == static_cast<std::int64_t>(MiB));
  CHECK(st.large_pool.requested_bytes.current == static_cast<std::int64_t>(MiB + 1));
  CHECK(st.small_pool.segment.current == 1);
  CHECK(st.large_pool.segment.current == 1);
  CHECK(st.small_pool.reserved_bytes.current > 0);
  CHECK(st.large_pool.reserved_bytes.current > 0);
  check_kinds_add_up(st);

  // A tagged pool's blocks and segments count in their kind.
  void* tagged = nullptr;
  {
    tag_scope scope("weights");
    tagged = env.alloc.allocate(4 * KiB, s);
  }
  // A graph's private pool's too.
  env.alloc.allocate(4 * KiB, capture);  // the allocator knows the stream before the capture
  env.alloc.notify_capture_begin(capture);
  env.dev.begin_capture(capture);
  void* in_graph_small = env.alloc.allocate(8 * KiB, capture);
  void* in_graph_large = env.alloc.allocate(4 * MiB, capture);
  env.dev.end_capture(capture);
  env.alloc.notify_capture_end(capture);
  st = env.alloc.stats();
  CHECK(st.small_pool.allocation.current == 4);
  CHECK(st.large_pool.allocation.current == 2);
  CHECK(st.small_pool.segment.current == 4);  // default, tagged, the capture stream's, the graph's
  CHECK(st.large_pool.segment.current == 2);
  check_kinds_add_up(st);

  for (void* p : {small, large, tagged, in_graph_small, in_graph_large}) env.alloc.deallocate(p);
  env.dev.run_until_idle();
  st = env.alloc.stats();
  CHECK(st.small_pool.allocation.current == 1);
  CHECK(st.large_pool.allocation.current == 0);
  CHECK(st.small_pool.allocation.freed == 3);
  CHECK(st.large_pool.allocation.freed == 2);
  check_kinds_add_up(st);
  env.alloc.check_invariants();
}

TEST_CASE(
    "Every peak is at least every current value seen since the last reset, under random "
    "traffic on several streams",
    "[core][statistics]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  INFO("backend " << to_string(backend));
  sim_env env(make_options(backend));
  const std::vector<stream_handle> streams = {env.dev.create_stream(), env.dev.create_stream(),
                                              env.dev.create_stream()};
  struct live {
    void* p;
    stream_handle s;
  };
  std::vector<live> blocks;
  std::mt19937 rng(7);
  std::vector<std::int64_t> seen;
  const std::size_t sizes[] = {512, 64 * KiB, 700 * KiB, MiB + 512, 3 * MiB, 12 * MiB};
  for (int step = 0; step < 600; ++step) {
    INFO("step " << step);
    const unsigned op = rng() % 10;
    if (op < 5 || blocks.empty()) {
      const stream_handle s = streams[rng() % streams.size()];
      blocks.push_back({env.alloc.allocate(sizes[rng() % std::size(sizes)], s), s});
    } else if (op < 8) {
      const std::size_t i = rng() % blocks.size();
      const stream_handle other = streams[rng() % streams.size()];
      if (other != blocks[i].s) env.alloc.record_stream(blocks[i].p, other);
      env.alloc.deallocate(blocks[i].p);
      blocks.erase(blocks.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (op == 8) {
      env.dev.run_until_idle();
      env.alloc.empty_cache(empty_cache_mode::wait);
    } else if (step % 50 == 9) {
      env.alloc.reset_peak_stats();
      seen.clear();
      const statistics r = env.alloc.stats();
      for (const auto& [name, st] : counters_of(r)) {
        INFO(name);
        CHECK(st.peak == st.current);
      }
    }
    const statistics now = env.alloc.stats();
    check_peaks(now, seen);
    check_kinds_add_up(now);
  }
  for (const live& b : blocks) env.alloc.deallocate(b.p);
  env.dev.run_until_idle();
  env.alloc.check_invariants();
}

TEST_CASE(
    "A snapshot's statistics equal its walk while other threads allocate, free and empty the "
    "cache",
    "[core][statistics][snapshot][threads]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  INFO("backend " << to_string(backend));
  sim_env env(make_options(backend));
  constexpr int k_threads = 3;
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < k_threads; ++t) {
    const stream_handle s = env.dev.create_stream();
    threads.emplace_back([&env, &stop, s, t] {
      std::mt19937 rng(static_cast<unsigned>(t) + 1);
      std::vector<void*> mine;
      const std::size_t sizes[] = {512, 96 * KiB, MiB, 2 * MiB + 512, 24 * MiB};
      while (!stop.load()) {
        if (mine.size() < 8 && rng() % 2 == 0) {
          mine.push_back(env.alloc.allocate(sizes[rng() % std::size(sizes)], s));
        } else if (!mine.empty()) {
          env.alloc.deallocate(mine.back());
          mine.pop_back();
        }
        if (rng() % 16 == 0) env.alloc.empty_cache(empty_cache_mode::wait);
      }
      for (void* p : mine) env.alloc.deallocate(p);
    });
  }
  for (int i = 0; i < 400; ++i) {
    const memory_snapshot snap = env.alloc.snapshot();
    const walk_totals w(snap);
    INFO("snapshot " << i);
    bool agree = true;
    const pool_statistics* kinds[] = {&snap.stats, &snap.stats.small_pool, &snap.stats.large_pool};
    for (std::size_t k = 0; k < 3; ++k) {
      INFO("kind " << k << " (all, small_pool, large_pool)");
      const pool_statistics& x = *kinds[k];
      CHECK(x.reserved_bytes.current == w.mapped[k]);
      CHECK(x.segment.current == w.segments[k]);
      CHECK(x.allocated_bytes.current == w.allocated[k]);
      CHECK(x.requested_bytes.current == w.requested[k]);
      CHECK(x.allocation.current == w.allocations[k]);
      CHECK(x.active_bytes.current == w.active_bytes[k]);
      CHECK(x.active.current == w.active[k]);
      agree = agree && x.reserved_bytes.current == w.mapped[k] &&
              x.segment.current == w.segments[k];
    }
    if (!agree) break;
  }
  stop = true;
  for (auto& t : threads) t.join();
  env.dev.run_until_idle();
  env.alloc.check_invariants();
}
