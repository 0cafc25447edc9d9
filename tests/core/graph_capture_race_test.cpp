// Case K11 on the simulated device with cudaFree semantics: the sequence of the GPU test "K11 on
// the GPU: a graph that allocates, frees and launches kernels is captured while empty_cache
// runs, and replays exactly" (graph_capture_gpu_test.cpp), with the cuda_malloc backend and
// device_config::free_segment_synchronizes set (free_segment waits for the whole device, as
// cudaFree does, so defer-mode releases of segments wait for every stream to be idle). Another
// thread calls empty_cache, reclaim, allocate and free on stream t during the capture and
// after it; the allocator's invariants are checked after every step of the capturing thread.
#include "support/forwarding_device.hpp"
#include "support/sim_faults.hpp"
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

sim::device_config cuda_free_config() {
  sim::device_config c = sim_config();
  c.free_segment_synchronizes = true;  // cudaFree: waits for the device
  c.reuse_freed_addresses = true;      // cudaMalloc may return a range cudaFree just gave back
  return c;
}

// The simulated device, with a hook that runs right after the n-th free_segment returns, while
// the allocator that called it has its device lock dropped: what another thread may do there.
class hooked_device final : public forwarding_device {
 public:
  explicit hooked_device(sim::simulated_device& dev) : forwarding_device(dev) {}
  std::function<void()> after_free;  // runs once, after free_segment call number free_index
  int free_index = -1;
  std::chrono::microseconds free_delay{0};  // host time each free_segment takes (cudaFree waits)

  void free_segment(void* base, std::size_t n) override {
    dev_.free_segment(base, n);
    if (free_delay.count() != 0) std::this_thread::sleep_for(free_delay);
    if (frees_++ == free_index && after_free) after_free();
  }

 private:
  std::atomic<int> frees_{0};
};

// The GPU test's sequence, once. `other_rounds` rounds of the other thread run during the
// capture (0: no other thread, single-threaded). Returns a description of the first failed step
// ("" when none failed).
struct k11_run {
  struct parts {
    sim::simulated_device dev{cuda_free_config()};
    hooked_device hooked{dev};
    caching_allocator alloc{hooked, make_options(backend_kind::cuda_malloc)};
  } env;
  stream_handle s = env.dev.create_stream();
  stream_handle t = env.dev.create_stream();

  std::string step;  // the step that ran last (for the failure message)
  void checked(const char* what) {
    step = what;
    env.alloc.check_invariants();
  }

  // One round of the other thread: empty_cache, reclaim, eager work on t.
  void other_round(int round) {
    env.alloc.empty_cache();
    env.alloc.reclaim();
    const std::size_t bytes = 4 * MiB + static_cast<std::size_t>(round % 4) * MiB;
    void* p = env.alloc.allocate(bytes, t);
    env.dev.launch(t, 20, {writes(p, 4 * MiB, 0x55)}, "fill on t");
    env.alloc.deallocate(p);
    env.dev.advance(25);  // the device makes progress meanwhile: t is idle again
  }

  // Cached memory on both streams, which an empty_cache during the capture would release.
  void prepare() {
    for (std::size_t bytes : {2 * MiB, 24 * MiB, 96 * MiB}) {
      void* p = env.alloc.allocate(bytes, t);
      env.dev.launch(t, 50, {writes(p, bytes, 0x77)}, "fill on t");
      env.alloc.deallocate(p);
      void* q = env.alloc.allocate(bytes, s);
      env.dev.launch(s, 50, {writes(q, bytes, 0x66)}, "fill on s");
      env.dev.launch(s, 50, {reads(q, bytes)}, "sum on s");
      env.dev.launch(s, 100, {}, "spin on s");
      env.alloc.deallocate(q);
    }
    env.dev.run_until_idle();
    checked("before the capture");
  }

  // The capturing thread's part, between begin and end of the capture. `between` runs after
  // each step (the deterministic interleavings put the other thread's rounds there).
  template <class Between>
  void capture_body(void*& a, void*& c, Between&& between) {
    // Allocates `bytes` on s in the capture and captures a fill with `value` and a sum of it.
    auto captured = [&](std::size_t bytes, std::uint8_t value, const char* what) {
      void* p = env.alloc.allocate(bytes, s);
      checked(what);
      env.dev.launch(s, 10, {writes(p, bytes, value)}, "captured fill");
      env.dev.launch(s, 10, {reads(p, bytes)}, "captured sum");
      between();
      return p;
    };
    auto then = [&](auto&& call, const char* what) {
      call();
      checked(what);
      between();
    };
    a = captured(8 * MiB, 1, "allocate a (8 MiB) in the capture");
    then([&] { env.alloc.deallocate(a); }, "free a in the capture");
    then([&] { env.alloc.empty_cache(); }, "empty_cache in the capture");
    env.dev.launch(s, 50, {}, "captured spin");
    void* b = captured(8 * MiB, 2, "allocate b (8 MiB, a's block) in the capture");
    CHECK(b == a);
    c = captured(64 * MiB, 3, "allocate c (64 MiB, growth) in the capture");
    then([&] { env.alloc.deallocate(b); }, "free b in the capture");
    then([&] { env.alloc.deallocate(c); }, "free c in the capture");
  }

  // After the capture: replays beside eager work on t, then the graph's release.
  template <class Between>
  void after_capture(std::uint64_t graph, std::uint64_t id, void* a, void* c, Between&& between) {
    for (int replay = 0; replay < 5; ++replay) {
      env.dev.launch_graph(graph, s);
      void* p = env.alloc.allocate(8 * MiB, t);
      checked("eager allocate 8 MiB on t beside a replay");
      void* q = env.alloc.allocate(64 * MiB, t);
      checked("eager allocate 64 MiB on t beside a replay");
      CHECK(p != a);
      CHECK(p != c);
      CHECK(q != c);
      env.dev.launch(t, 10, {writes(p, 8 * MiB, 0xee)}, "eager fill p");
      env.dev.launch(t, 10, {writes(q, 64 * MiB, 0xee)}, "eager fill q");
      env.alloc.deallocate(p);
      env.alloc.deallocate(q);
      checked("eager frees on t");
      between();
      env.dev.run_until_idle();
      CHECK(env.dev.value_at(addr(a)) == std::optional<std::uint8_t>(2));
      CHECK(env.dev.value_at(addr(c)) == std::optional<std::uint8_t>(3));
    }
    checked("after the replays");
    env.alloc.notify_graph_released(id);
    checked("graph released");
    const auto reserved = env.alloc.stats().reserved_bytes.current;
    env.alloc.empty_cache();
    checked("empty_cache after the graph's release");
    CHECK(env.alloc.stats().reserved_bytes.current < reserved);  // the graph's pool went back too
    env.dev.run_until_idle();
    CHECK(env.dev.fault_count() == 0);
    INFO(fault_text(env.dev));
  }
};

}  // namespace

TEST_CASE(
    "K11 with cudaFree semantics: the GPU sequence (capture, empty_cache and eager work on another "
    "thread, "
    "replays) keeps the allocator consistent",
    "[core][graph][cases][K11]") {
  constexpr int k_iterations = 200;
  for (int iteration = 0; iteration < k_iterations; ++iteration) {
    k11_run run;
    run.env.hooked.free_delay = std::chrono::microseconds(
        200);  // others run meanwhile, as on a GPU
    INFO("iteration " << iteration);
    run.prepare();
    const std::uint64_t id = run.env.alloc.notify_capture_begin(run.s);
    run.env.dev.begin_capture(run.s);

    std::atomic<bool> stop{false};
    std::atomic<int> rounds{0};
    std::string other_error;  // written by the other thread, read after the join
    std::thread other([&] {
      try {
        while (!stop.load()) {
          run.other_round(rounds.load());
          ++rounds;
        }
      } catch (const std::exception& e) {
        other_error = e.what();
      }
    });
    void* a = nullptr;
    void* c = nullptr;
    std::string error;
    try {
      run.capture_body(a, c, [] { std::this_thread::yield(); });
      while (rounds.load() < 5 && other_error.empty()) std::this_thread::yield();
      const std::uint64_t graph = run.env.dev.end_capture(run.s);
      CHECK(run.env.alloc.notify_capture_end(run.s) == id);
      run.checked("capture ended");
      // The other thread goes on a while after the capture (as on the GPU, until it is stopped).
      const int at_end = rounds.load();
      while (rounds.load() < at_end + 3 && other_error.empty()) std::this_thread::yield();
      stop = true;
      other.join();
      run.checked("other thread joined");
      run.after_capture(graph, id, a, c, [] {});
    } catch (const std::exception& e) {
      error = "step '" + run.step + "': " + e.what();
      stop = true;
      if (other.joinable()) other.join();
    }
    INFO("other thread: " << other_error << "; rounds " << rounds.load());
    REQUIRE(other_error.empty());
    INFO(error);
    REQUIRE(error.empty());
  }
}

TEST_CASE(
    "K11 with cudaFree semantics: the GPU sequence, single-threaded, with the other thread's round "
    "inside "
    "each segment free in turn (the device lock dropped, the freed range handed out again)",
    "[core][graph][cases][K11]") {
  // The rounds of the other thread run at fixed points, and one more inside the n-th
  // free_segment call, for every n the sequence reaches.
  int frees_seen = 0;
  for (int n = 0; n == 0 || n < frees_seen; ++n) {
    k11_run run;
    INFO("round inside free_segment call " << n);
    int round = 0;
    run.env.hooked.free_index = n;
    run.env.hooked.after_free = [&] {
      run.other_round(round++);
      run.checked("the other thread's round inside a segment free");
    };
    auto between = [&] { run.other_round(round++); };
    std::string error;
    try {
      run.prepare();
      const std::uint64_t id = run.env.alloc.notify_capture_begin(run.s);
      run.env.dev.begin_capture(run.s);
      void* a = nullptr;
      void* c = nullptr;
      run.capture_body(a, c, between);
      const std::uint64_t graph = run.env.dev.end_capture(run.s);
      CHECK(run.env.alloc.notify_capture_end(run.s) == id);
      run.checked("capture ended");
      for (int i = 0; i < 3; ++i) between();
      run.checked("the other thread's rounds after the capture");
      run.after_capture(graph, id, a, c, between);
    } catch (const std::exception& e) {
      error = "step '" + run.step + "': " + e.what();
    }
    INFO(error);
    REQUIRE(error.empty());
    if (n == 0) frees_seen = static_cast<int>(run.env.dev.counters().segment_frees);
  }
  CHECK(frees_seen > 3);
}
