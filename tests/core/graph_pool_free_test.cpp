// Frees during a CUDA graph capture of blocks that belong to another graph's private pool,
// on the simulated device. The rule under test: a free during a capture of
// memory the capture may use is held until that graph is released, whichever pool the block
// belongs to (the stream's ordinary pool or an earlier graph's private pool); memory a graph
// may still replay over is never unmapped; releasing a graph whose pool still holds live blocks
// is reported.
#include "support/sim_faults.hpp"
#include "support/sim_fixture.hpp"

#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>
#include <catch2/catch.hpp>

#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

// The "streamsafe" logger's messages of level warn and above, while the capture lives (its
// other sinks are detached meanwhile, so that nothing reaches stderr).
class log_capture {
 public:
  log_capture() : logger_(spdlog::get("streamsafe")), sink_(std::make_shared<sink>()) {
    if (!logger_) return;
    saved_sinks_ = logger_->sinks();
    saved_level_ = logger_->level();
    logger_->sinks() = {sink_};
    logger_->set_level(spdlog::level::warn);
  }
  ~log_capture() {
    if (!logger_) return;
    logger_->sinks() = saved_sinks_;
    logger_->set_level(saved_level_);
  }
  log_capture(const log_capture&) = delete;
  log_capture& operator=(const log_capture&) = delete;

  bool attached() const { return logger_ != nullptr; }
  std::vector<std::string> lines() const {
    std::lock_guard<std::mutex> lk(sink_->lines_mu);
    return sink_->lines;
  }
  std::string text() const {
    std::string all;
    for (const auto& l : lines()) all += l + "\n";
    return all;
  }

 private:
  struct sink final : spdlog::sinks::base_sink<std::mutex> {
    mutable std::mutex lines_mu;
    std::vector<std::string> lines;
    void sink_it_(const spdlog::details::log_msg& msg) override {
      std::lock_guard<std::mutex> lk(lines_mu);
      lines.emplace_back(msg.payload.data(), msg.payload.size());
    }
    void flush_() override {}
  };
  std::shared_ptr<spdlog::logger> logger_;
  std::shared_ptr<sink> sink_;
  std::vector<spdlog::sink_ptr> saved_sinks_;
  spdlog::level::level_enum saved_level_ = spdlog::level::off;
};

// Stream s captures the graphs; `other` is a second stream the allocator knows.
struct graphs_env : sim_env {
  stream_handle s, other;
  std::int64_t baseline_reserved = 0;  // the small block on `other`
  explicit graphs_env(backend_kind backend)
      : sim_env(make_options(backend)), s(dev.create_stream()), other(dev.create_stream()) {
    alloc.allocate(4 * KiB, other);
    baseline_reserved = alloc.stats().reserved_bytes.current;
  }
  struct graph {
    std::uint64_t dev_id = 0, id = 0;  // the simulated device's graph, the allocator's id
  };
  void begin() {
    alloc.notify_capture_begin(s);
    dev.begin_capture(s);
  }
  graph end() {
    graph g;
    g.dev_id = dev.end_capture(s);
    g.id = alloc.notify_capture_end(s);
    return g;
  }
};

}  // namespace

TEST_CASE(
    "A block of graph 1's pool freed during graph 2's capture is held until graph 2 is released",
    "[core][graph]") {
  EACH_BACKEND(backend);
  graphs_env env(backend);
  env.begin();
  void* w = env.alloc.allocate(64 * MiB, env.s);  // W: graph 1's private pool
  env.dev.launch(env.s, 10, {writes(w, 64 * MiB, 0x11)}, "graph 1 writes W");
  const auto g1 = env.end();

  env.begin();
  env.dev.launch(env.s, 10, {reads(w, 64 * MiB), writes(w, 64 * MiB, 0x22)}, "graph 2 uses W");
  env.alloc.deallocate(w);  // graph 2 replays over W later: held for graph 2
  CHECK(env.alloc.held_free_count() == 1);
  const auto g2 = env.end();
  CHECK(env.alloc.held_free_count() == 1);
  CHECK(env.alloc.stats().allocated_bytes.current >=
        static_cast<std::int64_t>(64 * MiB));  // counts as allocated

  env.alloc.notify_graph_released(g1.id);
  CHECK(env.alloc.held_free_count() == 1);  // graph 1's release does not end graph 2's hold
  env.alloc.notify_graph_released(g2.id);
  CHECK(env.alloc.held_free_count() == 0);
  env.dev.run_until_idle();
  env.alloc.empty_cache();
  CHECK(env.alloc.stats().reserved_bytes.current == env.baseline_reserved);
  CHECK(env.dev.fault_count() == 0);
  INFO(fault_text(env.dev));
  env.alloc.check_invariants();
}

TEST_CASE(
    "After graph 1 is released, empty_cache leaves mapped the graph-1 block that graph 2 replays "
    "over",
    "[core][graph]") {
  EACH_BACKEND(backend);
  graphs_env env(backend);
  env.begin();
  void* w = env.alloc.allocate(64 * MiB, env.s);
  env.dev.launch(env.s, 10, {writes(w, 64 * MiB, 0x11)}, "graph 1 writes W");
  const auto g1 = env.end();
  env.begin();
  env.dev.launch(env.s, 10, {reads(w, 64 * MiB), writes(w, 64 * MiB, 0x22)}, "graph 2 uses W");
  env.alloc.deallocate(w);
  const auto g2 = env.end();

  env.alloc.notify_graph_released(g1.id);
  env.alloc.empty_cache();
  CHECK(env.dev.is_mapped(addr(w), 64 * MiB));
  env.dev.launch_graph(g2.dev_id, env.s);  // graph 2 may replay: W must still be backed
  env.dev.run_until_idle();
  CHECK(count_faults(env.dev, sim::fault_kind::access_unmapped) == 0);
  CHECK(env.dev.fault_count() == 0);
  INFO(fault_text(env.dev));
  CHECK(env.dev.value_at(addr(w)) == std::optional<std::uint8_t>(0x22));

  env.alloc.notify_graph_released(g2.id);
  env.alloc.empty_cache();
  CHECK(env.alloc.stats().reserved_bytes.current == env.baseline_reserved);
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}

TEST_CASE(
    "Control: the same sequence with W from the stream's ordinary pool is held and the replay is "
    "safe",
    "[core][graph]") {
  EACH_BACKEND(backend);
  graphs_env env(backend);
  void* w = env.alloc.allocate(64 * MiB, env.s);  // before any capture: s's own pool
  env.dev.launch(env.s, 10, {writes(w, 64 * MiB, 0x11)}, "eager write of W");
  env.dev.run_until_idle();
  env.begin();
  env.dev.launch(env.s, 10, {reads(w, 64 * MiB), writes(w, 64 * MiB, 0x22)}, "graph 2 uses W");
  env.alloc.deallocate(w);
  CHECK(env.alloc.held_free_count() == 1);
  const auto g2 = env.end();
  CHECK(env.alloc.held_free_count() == 1);
  env.alloc.empty_cache();
  CHECK(env.dev.is_mapped(addr(w), 64 * MiB));
  env.dev.launch_graph(g2.dev_id, env.s);
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  INFO(fault_text(env.dev));
  env.alloc.notify_graph_released(g2.id);
  CHECK(env.alloc.held_free_count() == 0);
  env.dev.run_until_idle();
  env.alloc.empty_cache();
  CHECK(env.alloc.stats().reserved_bytes.current == env.baseline_reserved);
  env.alloc.check_invariants();
}

TEST_CASE(
    "Control: a graph replayed over memory released under it faults as access_unmapped on the "
    "simulated device",
    "[core][graph]") {
  // Shows that the replay checks above can fail: the user frees a block graph 2 reads after its
  // capture (which the allocator cannot see), empty_cache releases it, the replay faults.
  EACH_BACKEND(backend);
  graphs_env env(backend);
  void* w = env.alloc.allocate(64 * MiB, env.s);
  env.begin();
  env.dev.launch(env.s, 10, {reads(w, 64 * MiB)}, "graph reads W");
  const auto g = env.end();
  env.alloc.deallocate(w);  // outside any capture: completes, not held
  CHECK(env.alloc.held_free_count() == 0);
  env.alloc.empty_cache();
  CHECK_FALSE(env.dev.is_mapped(addr(w), 64 * MiB));
  env.dev.launch_graph(g.dev_id, env.s);
  CHECK(count_faults(env.dev, sim::fault_kind::access_unmapped) == 1);
  env.dev.clear_faults();
  env.dev.run_until_idle();
  env.alloc.notify_graph_released(g.id);
}

TEST_CASE(
    "Releasing a graph whose private pool still holds a live block is reported, and the block "
    "stays usable",
    "[core][graph]") {
  EACH_BACKEND(backend);
  graphs_env env(backend);
  env.begin();
  void* w = env.alloc.allocate(64 * MiB, env.s);  // live at the end of the capture, never freed
  env.dev.launch(env.s, 10, {writes(w, 64 * MiB, 0x11)}, "graph writes W");
  const auto g = env.end();

  std::string reported;
  {
    log_capture log;
    REQUIRE(log.attached());
    try {
      env.alloc.notify_graph_released(g.id);
    } catch (const std::exception& e) {  // an error is one acceptable report
      reported = e.what();
    }
    reported += log.text();  // a warning is another
  }
  INFO("report: " << reported);
  CHECK_THAT(reported, Catch::Contains("graph " + std::to_string(g.id)));  // names the graph
  CHECK_FALSE(reported.empty());

  // Whatever the report, the live block is not released under its user.
  env.alloc.empty_cache();
  CHECK(env.dev.is_mapped(addr(w), 64 * MiB));
  env.dev.launch(env.s, 10, {reads(w, 64 * MiB)}, "eager read of W after the release");
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  env.alloc.deallocate(w);
  env.dev.run_until_idle();
  env.alloc.empty_cache();
  CHECK(env.alloc.stats().reserved_bytes.current == env.baseline_reserved);
  env.alloc.check_invariants();
}

TEST_CASE("Control: the log capture of these tests sees the allocator's warnings",
          "[core][graph]") {
  log_capture log;
  REQUIRE(log.attached());
  sim_env env(make_options(backend_kind::cuda_malloc,
                           fence_scope::allocation_stream));  // warns: unsafe scope
  CHECK_FALSE(log.lines().empty());
}

TEST_CASE(
    "A block allocated in a capture, live at its end and freed after it, serves no one but its "
    "graph until "
    "the graph is released",
    "[core][graph]") {
  EACH_BACKEND(backend);
  graphs_env env(backend);
  env.begin();
  void* w = env.alloc.allocate(64 * MiB, env.s);
  env.dev.launch(env.s, 10, {writes(w, 64 * MiB, 0x11)}, "graph writes W");
  const auto g = env.end();
  env.alloc.deallocate(w);  // after the capture: back to the graph's pool
  std::vector<void*> eager;
  for (auto stream : {env.s, env.other}) {
    void* p = env.alloc.allocate(64 * MiB, stream);
    CHECK(p != w);
    env.dev.launch(stream, 10, {writes(p, 64 * MiB, 0x33)}, "eager write");
    eager.push_back(p);
  }
  env.alloc.empty_cache();
  CHECK(env.dev.is_mapped(addr(w), 64 * MiB));  // the graph may replay
  env.dev.launch_graph(g.dev_id, env.other);
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  INFO(fault_text(env.dev));
  for (void* p : eager) env.alloc.deallocate(p);
  env.alloc.notify_graph_released(g.id);
  env.alloc.empty_cache();
  CHECK(env.alloc.stats().reserved_bytes.current == env.baseline_reserved);
  env.alloc.check_invariants();
}

TEST_CASE("A later capture on the same stream is not served from an earlier graph's pool",
          "[core][graph]") {
  // Pools are private to one graph: streamsafe has no way to share a pool between graphs
  // (PyTorch's torch.cuda.graph(pool=...)); a block of graph 1's pool freed after its capture
  // must not serve graph 2, whose replays may overlap graph 1's.
  EACH_BACKEND(backend);
  graphs_env env(backend);
  env.begin();
  void* w = env.alloc.allocate(64 * MiB, env.s);
  env.dev.launch(env.s, 10, {writes(w, 64 * MiB, 0x11)}, "graph 1 writes W");
  const auto g1 = env.end();
  env.alloc.deallocate(w);
  env.begin();
  void* x = env.alloc.allocate(64 * MiB, env.s);
  CHECK(x != w);
  env.dev.launch(env.s, 10, {writes(x, 64 * MiB, 0x22)}, "graph 2 writes X");
  env.alloc.deallocate(x);
  const auto g2 = env.end();
  env.dev.launch_graph(g1.dev_id, env.s);
  env.dev.launch_graph(g2.dev_id, env.other);  // the two replays overlap in time
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  INFO(fault_text(env.dev));
  env.alloc.notify_graph_released(g1.id);
  env.alloc.notify_graph_released(g2.id);
  env.alloc.empty_cache();
  CHECK(env.alloc.stats().reserved_bytes.current == env.baseline_reserved);
  env.alloc.check_invariants();
}

TEST_CASE(
    "A capture sharing graph 1's pool reuses the block graph 1 freed, and the pool goes back with "
    "its last graph",
    "[core][graph]") {
  // torch.cuda.graph(pool=g1.pool()): the graphs replay one after another, never concurrently.
  EACH_BACKEND(backend);
  graphs_env env(backend);
  env.begin();
  void* w = env.alloc.allocate(64 * MiB, env.s);
  env.dev.launch(env.s, 10, {writes(w, 64 * MiB, 0x11)}, "graph 1 writes W");
  env.alloc.deallocate(w);  // freed in graph 1's capture: back to its pool
  const auto g1 = env.end();
  env.alloc.notify_capture_begin(env.s, g1.id);
  env.dev.begin_capture(env.s);
  void* x = env.alloc.allocate(64 * MiB, env.s);
  CHECK(x == w);  // the shared pool's free block
  env.dev.launch(env.s, 10, {writes(x, 64 * MiB, 0x22)}, "graph 2 writes X");
  const auto g2 = env.end();
  CHECK(env.alloc.held_free_count() == 0);
  env.dev.launch_graph(g1.dev_id, env.s);
  env.dev.launch_graph(g2.dev_id, env.s);  // one after the other, as a shared pool asks
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  INFO(fault_text(env.dev));
  env.alloc.notify_graph_released(g1.id);
  env.alloc.empty_cache();
  CHECK(env.dev.is_mapped(addr(x), 64 * MiB));  // graph 2 still holds the pool
  env.alloc.deallocate(x);
  env.alloc.notify_graph_released(g2.id);
  env.dev.run_until_idle();
  env.alloc.empty_cache();
  CHECK(env.alloc.stats().reserved_bytes.current == env.baseline_reserved);
  CHECK_THROWS_AS(env.alloc.notify_capture_begin(env.s, g1.id),
                  std::invalid_argument);  // every graph released
  env.alloc.check_invariants();
}

TEST_CASE(
    "Graphs captured, replayed and released in a loop give back their pools' memory and address "
    "ranges "
    "before the next capture",
    "[core][graph]") {
  EACH_BACKEND(backend);
  options o = make_options(backend);
  o.memory_limit_bytes = 256 * MiB;
  sim_env env(o);
  const auto s = env.dev.create_stream();
  for (int i = 0; i < 50; ++i) {
    env.alloc.notify_capture_begin(s);
    env.dev.begin_capture(s);
    void* p = env.alloc.allocate(100 * MiB, s);  // three graphs' pools would not fit under the cap
    env.dev.launch(s, 5, {writes(p, 100 * MiB)}, "captured step");
    env.alloc.deallocate(p);
    const auto graph = env.dev.end_capture(s);
    const auto id = env.alloc.notify_capture_end(s);
    env.dev.launch_graph(graph, s);
    env.alloc.notify_graph_released(id);
    CHECK(env.alloc.stats().segment.current <= 2);  // no reserved address range per graph ever made
  }
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}
