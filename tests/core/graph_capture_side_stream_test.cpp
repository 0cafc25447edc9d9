// Side streams in a CUDA graph capture (case K11), on the simulated device: a stream that joined
// a capture by waiting on one of its events allocates from the capture's private pool (its
// checkpoint and snapshot segments hold the block; a segment of its own there, expandable too,
// and given back with the pool), gets new memory rather than a block the
// capturing stream freed in the capture (or that block behind a wait inside the capture), and stops
// counting as capturing when the capture ends; a block freed with a side stream's use serves the
// capturing stream again once the side stream joined back (not before).
#include "support/sim_faults.hpp"
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

struct side_env : sim_env {
  stream_handle s, side;
  explicit side_env(backend_kind backend)
      : sim_env(make_options(backend)), s(dev.create_stream()), side(dev.create_stream()) {}
  std::uint64_t begin() {
    const std::uint64_t graph = alloc.notify_capture_begin(s);
    dev.begin_capture(s);
    return graph;
  }
  // `to` waits on the work enqueued on `from` so far (torch.cuda.Stream.wait_stream).
  void wait_stream(stream_handle to, stream_handle from) {
    const event_handle e = dev.create_event();
    dev.record_event(e, from);
    dev.stream_wait_event(to, e);
    dev.destroy_event(e);
  }
  bool in_pool(std::uint64_t graph, const void* p) {
    for (const auto& seg : alloc.checkpoint_graph_pool(graph).segments)
      for (const auto& b : seg.blocks)
        if (b.allocated && b.address == addr(p)) return true;
    return false;
  }
  std::size_t pool_segments(std::uint64_t graph) {
    const memory_snapshot snap = alloc.snapshot();
    return static_cast<std::size_t>(
        std::count_if(snap.segments.begin(), snap.segments.end(),
                      [&](const segment_snapshot& seg) { return seg.graph_pool == graph; }));
  }
  // In a capture on s: data1 written on s, read on the side stream (forked from s) into a new
  // buffer, record_stream(side), then freed from the host. Returns data1; buf: the side buffer.
  void* free_with_side_use(void*& buf) {
    void* data1 = alloc.allocate(512, s);
    dev.launch(s, 10, {writes(data1, 512)});
    wait_stream(side, s);  // fork
    buf = alloc.allocate(512, side);
    dev.launch(side, 10, {reads(data1, 512), writes(buf, 512)});
    alloc.record_stream(data1, side);
    alloc.deallocate(data1);
    return data1;
  }
  void finish() {
    dev.run_until_idle();
    INFO(fault_text(dev));
    CHECK(dev.fault_count() == 0);
    alloc.check_invariants();
  }
};

}  // namespace

TEST_CASE("K11: a side stream that joined a capture allocates from the capture's pool",
          "[core][graph]") {
  EACH_BACKEND(backend);
  side_env env(backend);
  const std::uint64_t graph = env.begin();
  void* x = env.alloc.allocate(40 * MiB, env.s);
  env.dev.launch(env.s, 10, {writes(x, 40 * MiB)});
  env.wait_stream(env.side, env.s);  // fork: the side stream joins the capture
  void* y = env.alloc.allocate(40 * MiB, env.side);
  env.dev.launch(env.side, 10, {reads(x, 40 * MiB), writes(y, 40 * MiB)});
  env.wait_stream(env.s, env.side);  // join
  env.dev.end_capture(env.s);
  env.alloc.notify_capture_end(env.s);
  CHECK_FALSE(env.alloc.capture_underway());  // the side stream's part ended with the capture
  CHECK(env.in_pool(graph, x));
  CHECK(env.in_pool(graph, y));
  // Each stream its own segment of the pool (as PyTorch's allocator makes one per pool and
  // stream, expandable segments too): the side stream's growth maps into a range of its own.
  CHECK(env.pool_segments(graph) == 2u);
  env.alloc.deallocate(y);
  env.alloc.deallocate(x);
  CHECK(env.alloc.checkpoint_graph_pool(graph).allocated_blocks() == 0);
  env.finish();
}

TEST_CASE(
    "K11: graphs with a side stream, captured and released in a loop, give back the side "
    "stream's segments before the next capture",
    "[core][graph][expandable]") {
  EACH_BACKEND(backend);
  side_env env(backend);
  for (int i = 0; i < 20; ++i) {
    const std::uint64_t graph = env.begin();
    void* x = env.alloc.allocate(8 * MiB, env.s);
    env.dev.launch(env.s, 5, {writes(x, 8 * MiB)});
    env.wait_stream(env.side, env.s);
    void* y = env.alloc.allocate(8 * MiB, env.side);
    env.dev.launch(env.side, 5, {reads(x, 8 * MiB), writes(y, 8 * MiB)});
    env.wait_stream(env.s, env.side);
    env.alloc.deallocate(y);
    env.alloc.deallocate(x);
    const auto dev_graph = env.dev.end_capture(env.s);
    env.alloc.notify_capture_end(env.s);
    env.dev.launch_graph(dev_graph, env.s);
    env.alloc.notify_graph_released(graph);
    // The pool's two segments (one per stream); those of released graphs went back.
    CHECK(env.alloc.stats().segment.current <= 2);
  }
  env.finish();
}

TEST_CASE("K11: a side stream in a capture is not handed a block the capturing stream freed",
          "[core][graph][race]") {
  EACH_BACKEND(backend);
  side_env env(backend);
  const std::uint64_t graph = env.begin();
  env.wait_stream(env.side, env.s);  // forked before the capturing stream's use below
  void* x = env.alloc.allocate(4 * KiB, env.s);
  env.dev.launch(env.s, 10, {writes(x, 4 * KiB)});
  env.alloc.deallocate(x);  // cached in the graph's pool, its use unordered with the side stream
  const std::uint64_t waits = env.alloc.stats().stream_waits;
  void* y = env.alloc.allocate(4 * KiB, env.side);
  // New memory; or (an expandable pool whose mapped chunk has room only in x's free block) x,
  // behind a wait of the side stream on the capturing stream inside the capture.
  if (y == x) CHECK(env.alloc.stats().stream_waits > waits);
  if (backend == backend_kind::cuda_malloc) CHECK(y != x);
  CHECK(env.in_pool(graph, y));
  env.wait_stream(env.s, env.side);
  env.dev.end_capture(env.s);
  env.alloc.notify_capture_end(env.s);
  env.alloc.deallocate(y);
  env.finish();
}

TEST_CASE("simulated device: a stream waiting on an event of a capture underway joins it",
          "[sim][graph]") {
  side_env env(backend_kind::cuda_malloc);
  env.dev.begin_capture(env.s);
  CHECK(env.dev.capture_id(env.side) == 0);
  env.wait_stream(env.side, env.s);
  CHECK(env.dev.capturing(env.side));
  CHECK(env.dev.capture_id(env.side) == env.dev.capture_id(env.s));
  CHECK_THROWS_AS(env.dev.end_capture(env.side), backend_error);  // only its origin ends it
  env.dev.clear_faults();
  env.wait_stream(env.s, env.side);
  env.dev.end_capture(env.s);
  CHECK_FALSE(env.dev.capturing(env.side));
  CHECK(env.dev.capture_id(env.side) == 0);
  env.finish();
}

TEST_CASE("K11: a block freed with a side stream's use serves the capture again once it joined",
          "[core][graph][race]") {
  EACH_BACKEND(backend);
  side_env env(backend);
  const std::uint64_t graph = env.begin();
  void* sink = env.alloc.allocate(512, env.s);
  void* buf = nullptr;
  void* data1 = env.free_with_side_use(buf);
  void* data2 = env.alloc.allocate(512, env.s);  // the side stream may still read data1
  CHECK(data2 != data1);
  env.wait_stream(env.s, env.side);  // join
  env.dev.launch(env.s, 10, {writes(sink, 512)});
  void* data3 = env.alloc.allocate(512, env.s);
  CHECK(data3 == data1);  // reused inside the capture, after the join
  env.dev.end_capture(env.s);
  env.alloc.notify_capture_end(env.s);
  CHECK(env.alloc.held_free_count() == 0);
  for (void* p : {sink, data2, data3, buf}) env.alloc.deallocate(p);
  CHECK(env.alloc.checkpoint_graph_pool(graph).allocated_blocks() == 0);
  env.finish();
}

TEST_CASE(
    "K11: with graph_capture_record_stream_reuse off, a block freed with a side stream's use is "
    "held until the capture ends",
    "[core][graph][config]") {
  EACH_BACKEND(backend);
  side_env env(backend);
  const runtime_options on = runtime_options::of(env.alloc.config());
  CHECK(on.graph_capture_record_stream_reuse);  // the default
  runtime_options off = on;
  off.graph_capture_record_stream_reuse = false;
  env.alloc.set_runtime_options(off);
  CHECK_FALSE(env.alloc.config().graph_capture_record_stream_reuse);
  env.begin();
  void* sink = env.alloc.allocate(512, env.s);
  void* buf = nullptr;
  void* data1 = env.free_with_side_use(buf);
  env.wait_stream(env.s, env.side);  // join
  env.dev.launch(env.s, 10, {writes(sink, 512)});
  void* data3 = env.alloc.allocate(512, env.s);
  CHECK(data3 != data1);  // held: PyTorch's graph_capture_record_stream_reuse:False
  CHECK(env.alloc.held_free_count() == 1);
  env.alloc.set_runtime_options(on);  // switched on inside the capture: the next allocation
  void* data4 = env.alloc.allocate(512, env.s);
  CHECK(data4 == data1);
  env.dev.end_capture(env.s);
  env.alloc.notify_capture_end(env.s);
  CHECK(env.alloc.held_free_count() == 0);
  for (void* p : {sink, data3, data4, buf}) env.alloc.deallocate(p);
  env.finish();
}

TEST_CASE("graph_capture_record_stream_reuse is parsed, shown and refused like the other options",
          "[core][config]") {
  CHECK(options{}.graph_capture_record_stream_reuse);
  CHECK_FALSE(
      options::parse("graph_capture_record_stream_reuse:False").graph_capture_record_stream_reuse);
  CHECK(options::parse("graph_capture_record_stream_reuse:true").graph_capture_record_stream_reuse);
  CHECK_THAT(options::parse("graph_capture_record_stream_reuse:false").to_string(),
             Catch::Contains("graph_capture_record_stream_reuse:False"));
  CHECK_THROWS_AS(options::parse("graph_capture_record_stream_reuse:maybe"), config_error);
}

TEST_CASE("simulated device: captured events carry the order of a capture's streams",
          "[sim][graph]") {
  side_env env(backend_kind::cuda_malloc);
  env.dev.begin_capture(env.s);
  env.wait_stream(env.side, env.s);
  env.dev.launch(env.side, 10, {});
  const std::vector<std::uintptr_t> at = env.dev.capture_position(env.side);
  CHECK_FALSE(env.dev.capture_follows(env.s, at));
  env.wait_stream(env.s, env.side);
  CHECK(env.dev.capture_follows(env.s, at));
  env.dev.launch(env.side, 10, {});  // later work of the side stream: not followed
  CHECK_FALSE(env.dev.capture_follows(env.s, env.dev.capture_position(env.side)));
  env.wait_stream(env.s, env.side);
  env.dev.end_capture(env.s);
  CHECK(env.dev.capture_position(env.s).empty());
  env.finish();
}
