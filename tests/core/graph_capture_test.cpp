// Case K11, releasing during CUDA graph capture (shared/cases/CASES.md), on the simulated
// device: while a stream captures, the allocator makes no releasing, synchronising or
// event-query call (the simulated device records a capture_violation and invalidates the
// capture for any), serves the capture only from capture-safe memory or throws out_of_memory,
// and keeps memory the graph may touch away from other users until the graph is released.
#include "support/sim_faults.hpp"
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

// The backend calls that are illegal while a stream captures.
struct unsafe_calls {
  std::uint64_t frees = 0, unmaps = 0, queries = 0, syncs = 0, device_syncs = 0;
  explicit unsafe_calls(const sim::simulated_device& dev) {
    const auto c = dev.counters();
    frees = c.segment_frees;
    unmaps = c.unmaps;
    queries = c.event_queries;
    syncs = c.event_syncs;
    device_syncs = c.device_syncs;
  }
  bool operator==(const unsafe_calls& o) const {
    return frees == o.frees && unmaps == o.unmaps && queries == o.queries && syncs == o.syncs &&
           device_syncs == o.device_syncs;
  }
};

// The allocator over a simulated device, with the stream s that captures and a second stream,
// `other`, that the allocator knows (it holds a small block there).
struct capture_env : sim_env {
  stream_handle s, other;
  explicit capture_env(backend_kind backend) : capture_env(make_options(backend)) {}
  explicit capture_env(options o, sim::device_config c = sim_config())
      : sim_env(o, std::move(c)), s(dev.create_stream()), other(dev.create_stream()) {
    alloc.allocate(4 * KiB, other);
  }
  void begin() {
    alloc.notify_capture_begin(s);
    dev.begin_capture(s);
  }
  struct ended {
    std::uint64_t graph, id;  // the simulated device's graph, the allocator's id
  };
  ended end() {
    const std::uint64_t graph = dev.end_capture(s);
    return {graph, alloc.notify_capture_end(s)};
  }
  // Runs the device dry and checks that nothing faulted and the allocator is consistent.
  void finish() {
    dev.run_until_idle();
    CHECK(dev.fault_count() == 0);
    INFO(fault_text(dev));
    alloc.check_invariants();
  }
};

}  // namespace

TEST_CASE(
    "K11: cap M, fill 0.9 M, free 0.3 M, capture S, ask 0.25 M: out_of_memory, no release, sync or "
    "query, "
    "the capture stays valid",
    "[core][graph][cases][K11]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  const empty_cache_mode mode = GENERATE(empty_cache_mode::wait, empty_cache_mode::defer);
  INFO("backend " << name_of(backend) << ", empty_cache "
                  << (mode == empty_cache_mode::wait ? "wait" : "defer"));
  constexpr std::size_t M = 1000 * MiB;
  options o = make_options(backend, fence_scope::all_streams, mode);
  o.memory_limit_bytes = M;
  capture_env env(o);
  const auto s = env.s;
  std::vector<void*> blocks;
  for (int i = 0; i < 9; ++i) {  // 0.9 M
    blocks.push_back(env.alloc.allocate(M / 10, s));
    env.dev.launch(s, 100, {writes(blocks.back(), M / 10, 0x11)}, "fill");
  }
  for (int i : {1, 4, 7})
    env.alloc.deallocate(blocks[static_cast<std::size_t>(i)]);  // 0.3 M, not adjacent
  env.dev.run_until_idle();
  REQUIRE(env.alloc.stats().reserved_bytes.current ==
          static_cast<std::int64_t>(9 * (M / 10) + 2 * MiB));

  env.begin();
  const unsafe_calls before(env.dev);
  CHECK_THROWS_AS(env.alloc.allocate(M / 4, s), out_of_memory);
  try {
    env.alloc.allocate(M / 4, s);
  } catch (const out_of_memory& e) {
    CHECK_THAT(e.what(), Catch::Contains("CUDA graph capture underway"));
  }
  CHECK(env.alloc.empty_cache() == 0);  // asked for during the capture: later
  CHECK(env.alloc.reclaim() == 0);
  CHECK(unsafe_calls(env.dev) == before);
  CHECK(env.dev.fault_count() == 0);
  INFO(fault_text(env.dev));
  env.alloc.check_invariants();
  REQUIRE_NOTHROW(env.end());  // still valid: cudaStreamEndCapture succeeds

  // After the capture the cache is released again (the empty_cache asked for during the capture
  // ran when it ended, behind the fence) and the same request is served.
  env.alloc.empty_cache();
  CHECK(env.alloc.stats().reserved_bytes.current ==
        static_cast<std::int64_t>(6 * (M / 10) + 2 * MiB));
  void* p = env.alloc.allocate(M / 4, env.dev.create_stream());
  CHECK(p != nullptr);
  env.finish();
}

TEST_CASE("K11: an empty_cache asked for during a capture runs, deferred, when the capture ends",
          "[core][graph][cases][K11]") {
  EACH_BACKEND(backend);
  capture_env env(backend);
  env.alloc.deallocate(env.alloc.allocate(64 * MiB, env.other));
  const auto reserved = env.alloc.stats().reserved_bytes.current;
  env.begin();
  CHECK(env.alloc.empty_cache() == 0);
  CHECK(env.alloc.stats().reserved_bytes.current == reserved);
  REQUIRE_NOTHROW(env.end());
  CHECK(env.alloc.stats().reserved_bytes.current < reserved);  // released when the capture ended
  env.finish();
}

TEST_CASE(
    "K11: memory cached before a capture is not handed to it (a replay on another stream would "
    "race with its "
    "old uses)",
    "[core][graph][cases][K11]") {
  EACH_BACKEND(backend);
  capture_env env(backend);
  void* p = env.alloc.allocate(64 * MiB, env.s);
  const auto h = env.dev.hold(env.s);
  env.dev.launch(env.s, 10, {writes(p, 64 * MiB, 0x01)}, "eager write behind a hold");
  env.alloc.deallocate(p);  // same-stream free: p is cached on s at once

  env.begin();
  void* q = env.alloc.allocate(64 * MiB, env.s);
  CHECK(q != p);
  env.dev.launch(env.s, 10, {writes(q, 64 * MiB, 0x02)}, "captured write");
  const auto ended = env.end();

  env.dev.launch_graph(ended.graph, env.other);  // a replay while the eager write is pending
  CHECK(count_faults(env.dev, sim::fault_kind::cross_stream_race) == 0);
  INFO(fault_text(env.dev));
  env.dev.open(h);
  env.alloc.deallocate(q);
  env.alloc.notify_graph_released(ended.id);
  env.finish();
}

TEST_CASE(
    "K11: a block freed during the capture is reused inside it on the capturing stream, and by no "
    "one else "
    "until the graph is released",
    "[core][graph][cases][K11]") {
  EACH_BACKEND(backend);
  capture_env env(backend);
  const auto s = env.s, t = env.other;
  env.begin();
  void* a = env.alloc.allocate(8 * MiB, s);
  env.dev.launch(s, 10, {writes(a, 8 * MiB, 0xAA)}, "captured write a");
  env.alloc.deallocate(a);
  void* b = env.alloc.allocate(8 * MiB, s);
  CHECK(b == a);  // stream order inside the graph puts a's old use first
  env.dev.launch(s, 10, {reads(b, 8 * MiB), writes(b, 8 * MiB, 0xBB)}, "captured use of b");
  void* other = env.alloc.allocate(8 * MiB, t);  // another stream, during the capture
  CHECK(other != a);
  env.alloc.deallocate(b);
  const auto ended = env.end();
  CHECK(env.dev.graph_kernel_count(ended.graph) == 2);

  // After the capture: the graph pool serves neither s nor t while the graph may replay.
  std::vector<void*> eager;
  for (auto stream : {s, t, s, t}) {
    void* p = env.alloc.allocate(8 * MiB, stream);
    CHECK(p != a);
    env.dev.launch(stream, 10, {writes(p, 8 * MiB, 0x33)}, "eager write");
    eager.push_back(p);
  }
  env.dev.launch_graph(ended.graph, t);  // replays while the eager work still runs
  env.dev.launch_graph(ended.graph, t);
  env.dev.run_until_idle();
  env.dev.launch_graph(ended.graph, s);
  env.finish();
  CHECK(env.dev.value_at(addr(a)) == std::optional<std::uint8_t>(0xBB));
  for (void* p : eager) CHECK(env.dev.value_at(addr(p)) == std::optional<std::uint8_t>(0x33));

  // Released: its private pool goes back to the driver with the next empty_cache.
  for (void* p : eager) env.alloc.deallocate(p);
  env.alloc.deallocate(other);
  env.alloc.empty_cache();
  const auto held = env.alloc.stats().reserved_bytes.current;
  CHECK(held > 0);  // the graph's pool
  env.alloc.notify_graph_released(ended.id);
  env.alloc.empty_cache();
  CHECK(env.alloc.stats().reserved_bytes.current < held);
  env.finish();
}

TEST_CASE(
    "K11: a block from before the capture, freed inside it, is the graph's until the graph is "
    "released",
    "[core][graph][cases][K11]") {
  EACH_BACKEND(backend);
  capture_env env(backend);
  const auto s = env.s;
  void* x = env.alloc.allocate(16 * MiB, s);
  env.dev.launch(s, 10, {writes(x, 16 * MiB, 0x10)}, "eager init of x");
  env.dev.run_until_idle();  // (the user's duty: inputs of a graph are ready before it replays)

  env.begin();
  env.dev.launch(s, 10, {reads(x, 16 * MiB)}, "captured read of x");
  env.alloc.deallocate(x);  // the graph still reads x at every replay
  CHECK(env.alloc.held_free_count() == 1);
  CHECK_THROWS_AS(env.alloc.deallocate(x), invalid_pointer);  // a double free, named as such
  try {
    env.alloc.deallocate(x);
  } catch (const invalid_pointer& e) {
    CHECK_THAT(e.what(), Catch::Contains("already freed during a CUDA graph capture"));
  }
  const auto ended = env.end();
  CHECK(env.alloc.held_free_count() == 1);  // still the graph's

  void* y = env.alloc.allocate(16 * MiB, s);
  CHECK(y != x);
  env.dev.launch(s, 10, {writes(y, 16 * MiB, 0x20)}, "eager write of y");
  env.dev.launch_graph(ended.graph, env.other);
  CHECK(env.dev.fault_count() == 0);
  INFO(fault_text(env.dev));

  env.alloc.notify_graph_released(ended.id);  // x is freed behind events on every stream
  CHECK(env.alloc.held_free_count() == 0);
  env.alloc.deallocate(y);
  for (int i = 0; i < 2; ++i) {
    void* z = env.alloc.allocate(16 * MiB, s);
    env.dev.launch(s, 10, {writes(z, 16 * MiB, 0x30)}, "eager write after the release");
    env.alloc.deallocate(z);
  }
  env.finish();
}

TEST_CASE(
    "K11: expandable growth that runs out of device memory part-way during a capture unmaps "
    "nothing",
    "[core][graph][cases][K11]") {
  // 100 MiB device, 60 MiB of it taken outside the allocator (and 2 MiB by the other stream):
  // mapping 60 MiB in 20 MiB chunks runs out after one chunk. Outside a capture they would be
  // unmapped again; during one that is illegal, so they stay mapped in the graph's pool.
  capture_env env(make_options(backend_kind::expandable), sim_config(100 * MiB));
  REQUIRE(env.dev.allocate_segment(60 * MiB) != nullptr);
  env.begin();
  CHECK_THROWS_AS(env.alloc.allocate(60 * MiB, env.s), out_of_memory);
  CHECK(env.dev.counters().unmaps == 0);
  CHECK(env.dev.fault_count() == 0);
  void* p = env.alloc.allocate(16 * MiB, env.s);  // served from the chunk kept
  CHECK(env.dev.is_mapped(addr(p), 16 * MiB));
  env.alloc.deallocate(p);
  REQUIRE_NOTHROW(env.end());
  env.finish();
}

TEST_CASE("K11: frees that need events during a capture are held until it ends",
          "[core][graph][cases][K11]") {
  sim_env env(make_options(backend_kind::cuda_malloc));
  auto s = env.dev.create_stream();
  auto t = env.dev.create_stream();
  auto u = env.dev.create_stream();
  void* p = env.alloc.allocate(4 * MiB, t);
  env.alloc.record_stream(p, u);
  env.dev.launch(u, 10, {reads(p, 4 * MiB)}, "use on u");
  void* q = env.alloc.allocate(4 * MiB, t);

  env.alloc.notify_capture_begin(s);
  env.dev.begin_capture(s);
  const auto recorded = env.dev.counters().events_recorded;
  env.alloc.deallocate(p);     // needs an event on u: held
  env.alloc.deallocate(q, u);  // stream-ordered free on another stream: held
  CHECK(env.alloc.held_free_count() == 2);
  CHECK(env.dev.counters().events_recorded == recorded);
  env.alloc.check_invariants();
  REQUIRE_NOTHROW(env.dev.end_capture(s));
  env.alloc.notify_capture_end(s);
  CHECK(env.alloc.held_free_count() == 0);
  CHECK(env.dev.counters().events_recorded > recorded);  // the frees completed, with their events
  env.dev.run_until_idle();
  env.alloc.reclaim();
  CHECK(env.alloc.stats().allocated_bytes.current == 0);
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}

TEST_CASE("K11: the capture stays valid while another thread calls empty_cache and reclaim",
          "[core][graph][cases][K11]") {
  EACH_BACKEND(backend);
  capture_env env(backend);
  const auto s = env.s, t = env.other;
  for (int i = 0; i < 4; ++i)
    env.alloc.deallocate(env.alloc.allocate(32 * MiB, t));  // cache to release

  env.begin();
  std::atomic<bool> stop{false}, finished{false};
  std::atomic<int> calls{0};
  std::thread other([&] {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    try {
      while (!stop.load() && std::chrono::steady_clock::now() < deadline) {
        env.alloc.empty_cache();
        env.alloc.reclaim();
        void* p = env.alloc.allocate(1 * MiB, t);  // eager work of another stream
        env.alloc.deallocate(p);
        ++calls;
      }
    } catch (...) {
      calls = -1000000;  // reported below
    }
    finished = true;
  });
  for (int i = 0; i < 200; ++i) {
    void* p = env.alloc.allocate((1 + i % 8) * MiB, s);
    env.dev.launch(s, 1, {writes(p, MiB)}, "captured");
    env.alloc.deallocate(p);
  }
  while (calls.load() >= 0 && calls.load() < 10 && !finished.load()) std::this_thread::yield();
  stop = true;
  other.join();
  CHECK(calls.load() >= 10);
  CHECK(env.dev.fault_count() == 0);
  INFO(fault_text(env.dev));
  REQUIRE_NOTHROW(env.end());
  env.finish();
}

TEST_CASE("K11: a capture the allocator was not told about is detected on the slow path",
          "[core][graph][cases][K11]") {
  sim_env env(make_options(backend_kind::cuda_malloc));
  auto s = env.dev.create_stream();
  auto t = env.dev.create_stream();
  env.alloc.deallocate(env.alloc.allocate(64 * MiB, t));
  env.alloc.allocate(4 * KiB, s);  // s is known
  env.dev.begin_capture(s);
  CHECK(env.alloc.empty_cache() == 0);  // detected: nothing released
  CHECK(env.alloc.capture_underway());
  const auto reserved = env.alloc.stats().reserved_bytes.current;
  void* p = env.alloc.allocate(256 * MiB, s);  // growth, from the graph's pool
  env.dev.launch(s, 10, {writes(p, 256 * MiB)}, "captured");
  env.alloc.deallocate(p);
  CHECK(env.dev.fault_count() == 0);
  INFO(fault_text(env.dev));
  REQUIRE_NOTHROW(env.dev.end_capture(s));
  env.alloc.reclaim();  // sees the capture ended; the empty_cache asked for then runs
  CHECK_FALSE(env.alloc.capture_underway());
  CHECK(env.alloc.stats().reserved_bytes.current < reserved + static_cast<std::int64_t>(256 * MiB));
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}

TEST_CASE("K11: capture calls with bad arguments are named errors",
          "[core][graph][bad-input][cases][K11]") {
  sim_env env;
  auto s = env.dev.create_stream();
  CHECK_THROWS_AS(env.alloc.notify_capture_begin(0), std::invalid_argument);
  CHECK_THROWS_AS(env.alloc.notify_capture_end(s), std::invalid_argument);
  const auto id = env.alloc.notify_capture_begin(s);
  CHECK(id > 0);
  CHECK_THROWS_WITH(env.alloc.notify_capture_begin(s), Catch::Contains("already capturing"));
  CHECK_THROWS_WITH(env.alloc.notify_graph_released(id), Catch::Contains("still being captured"));
  CHECK(env.alloc.notify_capture_end(s) == id);
  CHECK_THROWS_WITH(env.alloc.notify_graph_released(id + 100), Catch::Contains("no such graph"));
  env.alloc.notify_graph_released(id);
  CHECK_THROWS_WITH(env.alloc.notify_graph_released(id), Catch::Contains("no such graph"));
  env.alloc.check_invariants();
}

TEST_CASE("simulated device: calls forbidden during a capture fault and invalidate it",
          "[sim][graph]") {
  sim::simulated_device dev(sim_config());
  auto s = dev.create_stream();
  auto t = dev.create_stream();
  void* seg = dev.allocate_segment(2 * MiB);
  auto outside = dev.create_event();
  dev.record_event(outside, t);

  dev.begin_capture(s);
  CHECK(dev.stream_is_capturing(s));
  CHECK_FALSE(dev.stream_is_capturing(t));
  CHECK(dev.launch(s, 10, {writes(seg, 2 * MiB, 7)}) == 0);  // recorded, not run
  CHECK(dev.stream_idle(s));
  void* grown = dev.allocate_segment(2 * MiB);  // growth stays legal
  CHECK(grown != nullptr);
  CHECK(dev.fault_count() == 0);
  CHECK_THROWS_AS(dev.query_event(outside), backend_error);  // from any thread, any event
  CHECK(count_faults(dev, sim::fault_kind::capture_violation) == 1);
  CHECK_THROWS_AS(dev.end_capture(s), backend_error);  // invalidated

  dev.clear_faults();
  dev.begin_capture(s);
  CHECK_THROWS_AS(dev.free_segment(grown, 2 * MiB), backend_error);
  CHECK_THROWS_AS(dev.stream_wait_event(s, outside), backend_error);  // needs cudaEventWaitExternal
  CHECK_THROWS_AS(dev.synchronize_device(), backend_error);
  CHECK(count_faults(dev, sim::fault_kind::capture_violation) == 3);
  CHECK_THROWS_AS(dev.end_capture(s), backend_error);

  dev.clear_faults();
  dev.begin_capture(s);
  auto captured = dev.create_event();
  dev.record_event(captured, s);
  dev.stream_wait_event(s, captured);  // inside its own capture: fine
  dev.launch(s, 10, {writes(seg, 2 * MiB, 9)});
  const auto graph = dev.end_capture(s);
  CHECK(dev.fault_count() == 0);
  CHECK_THROWS_AS(dev.query_event(captured), backend_error);  // last recorded in a capture
  CHECK_THROWS_AS(dev.stream_wait_event(t, captured), backend_error);
  dev.clear_faults();
  dev.free_segment(grown, 2 * MiB);  // legal again
  dev.launch_graph(graph, t);
  dev.launch_graph(graph, t);
  dev.run_until_idle();
  CHECK(dev.value_at(addr(seg)) == std::optional<std::uint8_t>(9));
  CHECK(dev.counters().graph_launches == 2);
  CHECK(dev.fault_count() == 0);
}

TEST_CASE(
    "K11: a stream the allocator never saw, capturing while another capture is announced, is "
    "served from a private pool: its block is not reused while its graph may replay",
    "[core][graph][cases][K11]") {
  capture_env env(GENERATE(backend_kind::cuda_malloc, backend_kind::expandable));
  INFO("backend " << name_of(env.alloc.config().backend));
  env.begin();                             // the announced capture on s
  const auto t = env.dev.create_stream();  // unknown to the allocator until it allocates
  env.dev.begin_capture(t);
  void* p = env.alloc.allocate(64 * KiB, t);  // inside t's capture
  env.dev.launch(t, 10, {writes(p, 64 * KiB)}, "captured write");
  env.alloc.deallocate(p);
  const std::uint64_t graph = env.dev.end_capture(t);
  env.end();
  env.alloc.reclaim();  // sees t's capture ended
  const auto replay = env.dev.create_stream();
  env.dev.launch_graph(graph, replay);  // the graph writes p again, on another stream
  void* q = env.alloc.allocate(64 * KiB, t);
  env.dev.launch(t, 10, {writes(q, 64 * KiB)}, "next owner");
  CHECK(q != p);
  env.finish();
}

TEST_CASE("snapshot(): a segment of a graph's private pool names the graph, others 0",
          "[core][graph][snapshot]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  INFO("backend " << name_of(backend));
  capture_env env(backend);
  env.begin();
  void* in_graph = env.alloc.allocate(4 * MiB, env.s);
  const auto ended = env.end();
  std::size_t graph_bytes = 0, other_bytes = 0;
  for (const segment_snapshot& seg : env.alloc.snapshot().segments) {
    const bool holds = !seg.blocks.empty() &&
                       seg.address <= reinterpret_cast<std::uintptr_t>(in_graph) &&
                       reinterpret_cast<std::uintptr_t>(in_graph) < seg.address + seg.size_bytes;
    if (holds) {
      CHECK(seg.graph_pool == ended.id);
      graph_bytes += seg.mapped_bytes;
    } else {
      CHECK(seg.graph_pool == 0);
      other_bytes += seg.mapped_bytes;
    }
  }
  CHECK(graph_bytes >= 4 * MiB);
  CHECK(other_bytes > 0);  // the 4 KiB block on `other`
  std::ostringstream json;
  env.alloc.snapshot().to_json(json);
  CHECK_THAT(json.str(), Catch::Contains("\"graph_pool\":" + std::to_string(ended.id)));
  env.alloc.deallocate(in_graph);
  env.alloc.notify_graph_released(ended.id);
  env.finish();
}
