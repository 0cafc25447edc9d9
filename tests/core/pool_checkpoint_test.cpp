// Checkpoint and restore of a CUDA graph's private pool (core/pool_checkpoint.hpp), on the
// simulated device: the layouts PyTorch's cudagraph trees checkpoint (blocks kept in the middle
// of a segment, side by side, several segments, a tensor that dies after the checkpoint, an
// allocation made after it) come back exactly, at the same addresses; a restore that cannot
// happen (a segment that is not the pool's, a held free, a capture underway) is refused with
// nothing changed; memory a restore frees while another stream still reads it is not written
// by the pool's stream before that read ends.
#include "support/sim_faults.hpp"
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <set>
#include <stdexcept>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

// Stream s captures the graphs; `other` is a second stream the allocator knows.
struct checkpoint_env : sim_env {
  stream_handle s, other;
  explicit checkpoint_env(backend_kind backend)
      : sim_env(make_options(backend)), s(dev.create_stream()), other(dev.create_stream()) {
    alloc.allocate(4 * KiB, other);
  }
  void begin(std::uint64_t share = 0) {
    alloc.notify_capture_begin(s, share);
    dev.begin_capture(s);
  }
  std::uint64_t end() {
    dev.end_capture(s);
    return alloc.notify_capture_end(s);
  }
  // A graph that allocates `n` blocks of `size` bytes and keeps those in `keep` (by index).
  std::vector<void*> capture_keeping(std::size_t n, std::size_t size,
                                     const std::set<std::size_t>& keep, std::uint64_t* graph) {
    begin();
    std::vector<void*> all, kept;
    for (std::size_t i = 0; i < n; ++i) all.push_back(alloc.allocate(size, s));
    for (std::size_t i = 0; i < n; ++i) {
      if (keep.count(i)) kept.push_back(all[i]);
      else alloc.deallocate(all[i]);
    }
    *graph = end();
    return kept;
  }
  // A graph that keeps two blocks of 512 bytes, and its pool's checkpoint.
  struct two_kept {
    std::uint64_t graph = 0;
    std::vector<void*> kept;
    pool_checkpoint c;
  };
  two_kept checkpoint_two_kept() {
    two_kept t;
    t.kept = capture_keeping(2, 512, {0, 1}, &t.graph);
    t.c = alloc.checkpoint_graph_pool(t.graph);
    return t;
  }
  void finish() {
    dev.run_until_idle();
    INFO(fault_text(dev));
    CHECK(dev.fault_count() == 0);
    alloc.check_invariants();
  }
};

// The layout of a checkpoint, for comparisons: (address, size, allocated) of every block.
std::vector<std::tuple<std::uintptr_t, std::size_t, bool>> layout(const pool_checkpoint& c) {
  std::vector<std::tuple<std::uintptr_t, std::size_t, bool>> out;
  for (const auto& s : c.segments)
    for (const auto& b : s.blocks) out.emplace_back(b.address, b.size_bytes, b.allocated);
  return out;
}

std::vector<void*> sorted(std::vector<void*> v) {
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST_CASE("Restoring a graph pool's checkpoint keeps blocks kept in the middle of a segment",
          "[core][graph][checkpoint]") {
  EACH_BACKEND(backend);
  // One kept block, two apart, two side by side: the free runs around them come back.
  const auto keep = GENERATE(std::set<std::size_t>{5}, std::set<std::size_t>{5, 8},
                             std::set<std::size_t>{5, 6});
  checkpoint_env env(backend);
  std::uint64_t graph = 0;
  const std::vector<void*> kept = env.capture_keeping(11, 512, keep, &graph);
  const pool_checkpoint before = env.alloc.checkpoint_graph_pool(graph);
  CHECK(before.allocated_blocks() == keep.size());
  const std::int64_t allocated = env.alloc.stats().allocated_bytes.current;

  const pool_restore r = env.alloc.restore_graph_pool(before);
  CHECK(sorted(r.freed) == sorted(kept));
  CHECK(sorted(r.allocated) == sorted(kept));
  CHECK(layout(env.alloc.checkpoint_graph_pool(graph)) == layout(before));
  CHECK(env.alloc.stats().allocated_bytes.current == allocated);
  for (void* p : kept) env.alloc.deallocate(p);
  CHECK(env.alloc.checkpoint_graph_pool(graph).allocated_blocks() == 0);
  env.finish();
}

TEST_CASE("Restoring a checkpoint of several segments of both sizes brings each block back",
          "[core][graph][checkpoint]") {
  EACH_BACKEND(backend);
  checkpoint_env env(backend);
  env.begin();
  constexpr std::size_t x_bytes = 4 * KiB;
  void* x = env.alloc.allocate(x_bytes, env.s);
  void* x2 = env.alloc.allocate(x_bytes, env.s);  // x + x: the first x dies in the graph
  env.alloc.deallocate(x);
  void* small = env.alloc.allocate(512, env.s);
  void* big = env.alloc.allocate(6 * MiB, env.s);
  void* bigger = env.alloc.allocate(30 * MiB, env.s);
  void* gone = env.alloc.allocate(3 * MiB, env.s);
  env.alloc.deallocate(gone);
  const std::uint64_t graph = env.end();
  const pool_checkpoint before = env.alloc.checkpoint_graph_pool(graph);
  REQUIRE(before.segments.size() >= 2);
  CHECK(before.allocated_blocks() == 4);

  const pool_restore r = env.alloc.restore_graph_pool(before);
  CHECK(sorted(r.allocated) == sorted({x2, small, big, bigger}));
  CHECK(layout(env.alloc.checkpoint_graph_pool(graph)) == layout(before));
  for (void* p : {x2, small, big, bigger}) env.alloc.deallocate(p);
  env.finish();
}

TEST_CASE("A block freed after the checkpoint is allocated again by the restore",
          "[core][graph][checkpoint]") {
  EACH_BACKEND(backend);
  checkpoint_env env(backend);
  const auto [graph, kept, c] = env.checkpoint_two_kept();
  const std::int64_t allocations = env.alloc.stats().allocation.current;
  for (void* p : kept) env.alloc.deallocate(p);  // the tensors die after the checkpoint

  const pool_restore r = env.alloc.restore_graph_pool(c);
  CHECK(r.freed.empty());
  CHECK(sorted(r.allocated) == sorted(kept));
  CHECK(env.alloc.stats().allocation.current == allocations);
  env.alloc.deallocate(kept[0]);  // the caller owns them again
  CHECK(env.alloc.checkpoint_graph_pool(graph).allocated_blocks() == 1);
  env.alloc.deallocate(kept[1]);
  CHECK(env.alloc.checkpoint_graph_pool(graph).allocated_blocks() == 0);
  env.finish();
}

TEST_CASE("A block allocated into the pool after the checkpoint is freed by the restore",
          "[core][graph][checkpoint]") {
  EACH_BACKEND(backend);
  checkpoint_env env(backend);
  std::uint64_t graph = 0;
  const std::vector<void*> kept = env.capture_keeping(1, 512, {0}, &graph);
  const pool_checkpoint c = env.alloc.checkpoint_graph_pool(graph);
  env.begin(graph);  // a second graph into the same pool allocates after the checkpoint
  void* later = env.alloc.allocate(512, env.s);
  const std::uint64_t graph2 = env.end();
  CHECK(env.alloc.checkpoint_graph_pool(graph2).allocated_blocks() == 2);

  const pool_restore r = env.alloc.restore_graph_pool(c);
  CHECK(sorted(r.freed) == sorted({kept[0], later}));
  CHECK(r.allocated == kept);
  CHECK(layout(env.alloc.checkpoint_graph_pool(graph)) == layout(c));
  CHECK_THROWS_AS(env.alloc.deallocate(later), std::logic_error);  // not the caller's any more
  env.alloc.deallocate(kept[0]);
  env.finish();
}

TEST_CASE("A restore refuses a checkpoint whose segments are not the graph pool's",
          "[core][graph][checkpoint]") {
  EACH_BACKEND(backend);
  checkpoint_env env(backend);
  std::uint64_t g1 = 0, g2 = 0;
  const std::vector<void*> a = env.capture_keeping(1, 512, {0}, &g1);
  const std::vector<void*> b = env.capture_keeping(1, 512, {0}, &g2);  // a pool of its own
  pool_checkpoint other_pool = env.alloc.checkpoint_graph_pool(g1);
  other_pool.graph = g2;
  const auto unchanged = layout(env.alloc.checkpoint_graph_pool(g2));
  CHECK_THROWS_WITH(env.alloc.restore_graph_pool(other_pool),
                    Catch::Contains("is no longer a segment of the graph's pool"));
  pool_checkpoint gone = env.alloc.checkpoint_graph_pool(g2);
  gone.segments.front().address += 1 << 30;  // a segment that does not exist (any more)
  for (auto& blk : gone.segments.front().blocks) blk.address += 1 << 30;
  CHECK_THROWS_WITH(env.alloc.restore_graph_pool(gone),
                    Catch::Contains("is no longer a segment of the graph's pool"));
  CHECK(layout(env.alloc.checkpoint_graph_pool(g2)) == unchanged);
  env.alloc.deallocate(a[0]);
  env.alloc.deallocate(b[0]);
  env.alloc.notify_graph_released(g1);
  CHECK_THROWS_AS(env.alloc.checkpoint_graph_pool(g1), std::invalid_argument);
  CHECK_NOTHROW(env.alloc.restore_graph_pool(env.alloc.checkpoint_graph_pool(g2)));
  env.finish();
}

TEST_CASE("A restore refuses while a block of the pool is held or a capture is underway",
          "[core][graph][checkpoint]") {
  EACH_BACKEND(backend);
  checkpoint_env env(backend);
  const auto [g1, kept, c] = env.checkpoint_two_kept();

  env.begin();  // graph 2 (a pool of its own) reads kept[0]; its free is held for graph 2
  env.dev.launch(env.s, 10, {reads(kept[0], 512)}, "graph 2 reads a block of graph 1's pool");
  CHECK_THROWS_WITH(env.alloc.restore_graph_pool(c), Catch::Contains("capture is underway"));
  env.alloc.deallocate(kept[0]);
  const std::uint64_t g2 = env.end();
  REQUIRE(env.alloc.held_free_count() == 1);
  const auto unchanged = layout(env.alloc.checkpoint_graph_pool(g1));
  CHECK_THROWS_WITH(env.alloc.restore_graph_pool(c), Catch::Contains("a held free"));
  CHECK(layout(env.alloc.checkpoint_graph_pool(g1)) == unchanged);
  env.alloc.notify_graph_released(g2);  // the held free completes
  const pool_restore r = env.alloc.restore_graph_pool(c);
  CHECK(sorted(r.allocated) == sorted(kept));
  for (void* p : kept) env.alloc.deallocate(p);
  env.finish();
}

TEST_CASE(
    "Memory a restore frees while another stream reads it is written by the pool's stream only "
    "after that read",
    "[core][graph][checkpoint]") {
  EACH_BACKEND(backend);
  checkpoint_env env(backend);
  std::uint64_t graph = 0;
  const std::vector<void*> a = env.capture_keeping(1, 2 * MiB, {0}, &graph);
  const pool_checkpoint c = env.alloc.checkpoint_graph_pool(graph);  // A allocated
  env.alloc.deallocate(a[0]);
  env.begin(graph);  // B takes A's memory in a second graph of the pool
  void* b = env.alloc.allocate(2 * MiB, env.s);
  env.end();
  REQUIRE(b == a[0]);
  env.alloc.record_stream(b, env.other);
  env.dev.launch(env.other, 1000, {reads(b, 2 * MiB)}, "a long read of B on the other stream");

  const pool_restore r = env.alloc.restore_graph_pool(c);  // B freed under the read, A back
  CHECK(r.freed == std::vector<void*>{b});
  CHECK(r.allocated == a);
  env.dev.launch(env.s, 10, {writes(a[0], 2 * MiB, 0x5a)}, "the pool's stream writes A");
  env.dev.run_until_idle();
  INFO(fault_text(env.dev));
  CHECK(env.dev.fault_count() == 0);
  // The read's stream stays a use of A: its next free waits for it again.
  env.dev.launch(env.other, 1000, {reads(a[0], 2 * MiB)}, "the other stream reads A");
  env.alloc.deallocate(a[0]);
  const memory_snapshot snap = env.alloc.snapshot();
  std::vector<stream_handle> waiting_on;
  for (const auto& seg : snap.segments) {
    for (const auto& blk : seg.blocks) {
      if (blk.address == addr(a[0]) && blk.state == snapshot_block_state::pending_free)
        waiting_on = blk.waiting_on;
    }
  }
  CHECK(waiting_on == std::vector<stream_handle>{env.other});
  env.finish();
}
