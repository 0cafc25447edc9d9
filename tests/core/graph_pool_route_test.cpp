// Allocation into a CUDA graph's private pool outside a capture (begin_allocate_to_graph_pool),
// on the simulated device: a routed thread's allocations land in the graph's pool (its
// checkpoint, its snapshot segments, its statistics), other threads' do not; the pool's cached
// memory serves a routed stream only behind a wait on the pool's stream; a routed block freed
// with work pending on its stream is not handed out under that work; an open route keeps the
// pool from being released; bad arguments are named errors.
#include "support/sim_faults.hpp"
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <thread>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

// Stream s captures the graphs; `side` is the stream routed work runs on. `graph` is a graph
// whose capture allocated `temp` (4 KiB) and freed it: cached in the graph's pool.
struct route_env : sim_env {
  stream_handle s, side;
  std::uint64_t sim_graph = 0;  // the simulated device's id of the last graph captured
  void* temp = nullptr;
  std::uint64_t graph = 0;
  explicit route_env(backend_kind backend)
      : sim_env(make_options(backend)), s(dev.create_stream()), side(dev.create_stream()) {
    graph = capture_temp(4 * KiB, &temp);
  }
  // A graph whose capture allocates one block of `bytes` (written by a kernel) and frees it:
  // the block stays cached in the graph's pool. *out is its address.
  std::uint64_t capture_temp(std::size_t bytes, void** out) {
    alloc.notify_capture_begin(s);
    dev.begin_capture(s);
    *out = alloc.allocate(bytes, s);
    dev.launch(s, 10, {writes(*out, bytes)}, "graph kernel");
    alloc.deallocate(*out);
    sim_graph = dev.end_capture(s);
    return alloc.notify_capture_end(s);
  }
  // A route that takes the calling thread's allocations, whatever their stream.
  std::uint64_t route_this_thread(std::uint64_t to_graph) {
    const std::thread::id me = std::this_thread::get_id();
    return alloc.begin_allocate_to_graph_pool(
        to_graph, [me](stream_handle) { return std::this_thread::get_id() == me; });
  }
  std::size_t pool_segments(std::uint64_t of_graph) {
    const memory_snapshot snap = alloc.snapshot();
    return static_cast<std::size_t>(
        std::count_if(snap.segments.begin(), snap.segments.end(),
                      [&](const segment_snapshot& seg) { return seg.graph_pool == of_graph; }));
  }
  std::size_t pool_mapped_bytes(std::uint64_t of_graph) {
    std::size_t n = 0;
    for (const auto& seg : alloc.snapshot().segments)
      if (seg.graph_pool == of_graph) n += seg.mapped_bytes;
    return n;
  }
  void finish() {
    dev.run_until_idle();
    INFO(fault_text(dev));
    CHECK(dev.fault_count() == 0);
    alloc.check_invariants();
  }
};

bool has_block(const pool_checkpoint& c, const void* p) {
  for (const auto& seg : c.segments)
    for (const auto& b : seg.blocks)
      if (b.allocated && b.address == addr(p)) return true;
  return false;
}

}  // namespace

TEST_CASE("A routed thread's allocations come from the graph's pool, other threads' do not",
          "[core][graph]") {
  EACH_BACKEND(backend);
  route_env env(backend);
  const std::uint64_t graph = env.graph;
  env.dev.run_until_idle();
  const std::size_t segments_before = env.pool_segments(graph);
  REQUIRE(segments_before >= 1);

  const std::uint64_t route = env.route_this_thread(graph);
  void* a = env.alloc.allocate(2 * MiB, env.side);  // large: a pool of its own size class
  void* b = env.alloc.allocate(2 * MiB, env.side);
  void* elsewhere = nullptr;
  std::thread([&] { elsewhere = env.alloc.allocate(2 * MiB, env.side); }).join();
  env.alloc.end_allocate_to_graph_pool(route);
  void* after = env.alloc.allocate(2 * MiB, env.side);

  const pool_checkpoint c = env.alloc.checkpoint_graph_pool(graph);
  CHECK(has_block(c, a));
  CHECK(has_block(c, b));
  CHECK_FALSE(has_block(c, elsewhere));
  CHECK_FALSE(has_block(c, after));
  CHECK(c.allocated_blocks() == 2);
  CHECK(env.pool_segments(graph) > segments_before);  // the pool grew for them
  CHECK(env.alloc.find_block(a).size_bytes >= 2 * MiB);
  for (void* p : {a, b, elsewhere, after}) env.alloc.deallocate(p);
  CHECK(env.alloc.checkpoint_graph_pool(graph).allocated_blocks() == 0);  // freed into the pool
  env.finish();
}

TEST_CASE("A stream filter routes only the streams it takes into the graph's pool",
          "[core][graph]") {
  EACH_BACKEND(backend);
  route_env env(backend);
  const std::uint64_t graph = env.graph;
  const stream_handle routed = env.side;
  const std::uint64_t route = env.alloc.begin_allocate_to_graph_pool(
      graph, [routed](stream_handle st) { return st == routed; });
  void* in = env.alloc.allocate(8 * KiB, env.side);
  const stream_handle other = env.dev.create_stream();
  void* out = env.alloc.allocate(8 * KiB, other);
  env.alloc.end_allocate_to_graph_pool(route);
  const pool_checkpoint c = env.alloc.checkpoint_graph_pool(graph);
  CHECK(has_block(c, in));
  CHECK_FALSE(has_block(c, out));
  env.alloc.deallocate(in);
  env.alloc.deallocate(out);
  env.finish();
}

TEST_CASE("The pool's statistics and its restore count the routed blocks",
          "[core][graph][checkpoint]") {
  EACH_BACKEND(backend);
  route_env env(backend);
  const std::uint64_t graph = env.graph;
  const pool_checkpoint empty = env.alloc.checkpoint_graph_pool(graph);
  CHECK(empty.allocated_blocks() == 0);
  const std::int64_t allocated = env.alloc.stats().allocated_bytes.current;

  const std::uint64_t route = env.route_this_thread(graph);
  void* a = env.alloc.allocate(4 * KiB, env.side);
  env.alloc.end_allocate_to_graph_pool(route);
  CHECK(env.alloc.stats().allocated_bytes.current ==
        allocated + static_cast<std::int64_t>(4 * KiB));
  const pool_checkpoint with_a = env.alloc.checkpoint_graph_pool(graph);
  CHECK(has_block(with_a, a));

  // Restoring the checkpoint taken before the route frees the routed block, as PyTorch's
  // cudagraph trees do when they switch paths.
  const pool_restore r = env.alloc.restore_graph_pool(empty);
  CHECK(r.freed == std::vector<void*>{a});
  CHECK(r.allocated.empty());
  CHECK(env.alloc.stats().allocated_bytes.current == allocated);
  CHECK_THROWS_AS(env.alloc.deallocate(a), std::logic_error);  // not the caller's any more
  env.finish();
}

TEST_CASE("The pool's cached memory serves a routed stream only after the pool's stream's work",
          "[core][graph][race]") {
  EACH_BACKEND(backend);
  route_env env(backend);
  const std::uint64_t graph = env.graph;
  // A replay on the pool's stream still writes the graph's temporary.
  env.dev.launch_graph(env.sim_graph, env.s);
  const std::uint64_t route = env.route_this_thread(graph);
  void* a = env.alloc.allocate(4 * KiB, env.side);
  env.alloc.end_allocate_to_graph_pool(route);
  CHECK(a == env.temp);  // the pool's cached block, reused
  env.dev.launch(env.side, 5, {writes(a, 4 * KiB)}, "routed kernel");
  env.alloc.deallocate(a);
  env.finish();
}

TEST_CASE("A routed block freed under its stream's work is not handed out before that work ends",
          "[core][graph][race]") {
  EACH_BACKEND(backend);
  route_env env(backend);
  const std::uint64_t graph = env.graph;
  const std::uint64_t route = env.route_this_thread(graph);
  void* a = env.alloc.allocate(64 * KiB, env.side);
  const std::uint64_t hold = env.dev.hold(env.side);  // the side stream's work is not done
  env.dev.launch(env.side, 5, {writes(a, 64 * KiB)}, "routed kernel");
  env.alloc.deallocate(a);
  const stream_handle third = env.dev.create_stream();
  void* b = env.alloc.allocate(64 * KiB, third);
  env.alloc.end_allocate_to_graph_pool(route);
  env.dev.launch(third, 5, {writes(b, 64 * KiB)}, "third kernel");
  INFO(fault_text(env.dev));
  CHECK(env.dev.fault_count() == 0);
  env.dev.open(hold);
  env.alloc.deallocate(b);
  env.finish();
}

TEST_CASE("An open route keeps the graph's pool until it ends", "[core][graph]") {
  EACH_BACKEND(backend);
  route_env env(backend);
  const std::uint64_t graph = env.graph;
  const std::uint64_t route = env.route_this_thread(graph);
  void* a = env.alloc.allocate(4 * KiB, env.side);
  env.alloc.notify_graph_released(graph);  // the route still uses the pool
  CHECK_NOTHROW(env.alloc.checkpoint_graph_pool(graph));
  void* b = env.alloc.allocate(4 * KiB, env.side);
  CHECK(has_block(env.alloc.checkpoint_graph_pool(graph), b));
  env.alloc.end_allocate_to_graph_pool(route);
  CHECK_THROWS_AS(env.alloc.checkpoint_graph_pool(graph), std::invalid_argument);  // released
  env.alloc.deallocate(a);
  env.alloc.deallocate(b);
  env.dev.run_until_idle();
  env.alloc.empty_cache();
  CHECK(env.pool_mapped_bytes(graph) == 0);  // the retired pool's memory went back
  env.finish();
}

TEST_CASE("Routing calls with bad arguments are named errors", "[core][graph]") {
  route_env env(backend_kind::cuda_malloc);
  const auto all = [](stream_handle) { return true; };
  CHECK_THROWS_AS(env.alloc.begin_allocate_to_graph_pool(42, all), std::invalid_argument);
  const std::uint64_t graph = env.graph;
  CHECK_THROWS_AS(env.alloc.begin_allocate_to_graph_pool(graph, {}), std::invalid_argument);
  const std::uint64_t route = env.alloc.begin_allocate_to_graph_pool(graph, all);
  env.alloc.end_allocate_to_graph_pool(route);
  CHECK_THROWS_AS(env.alloc.end_allocate_to_graph_pool(route), std::invalid_argument);
  env.alloc.notify_graph_released(graph);
  CHECK_THROWS_AS(env.alloc.begin_allocate_to_graph_pool(graph, all), std::invalid_argument);
  env.finish();
}
