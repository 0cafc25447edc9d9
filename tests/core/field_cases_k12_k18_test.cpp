// Failure cases from the field K12-K15 and K18 (shared/cases/CASES.md), on the simulated
// device. K16 is in stream_callback_free_test.cpp, K17 (front ends over several devices) in
// field_cases_frontends_test.cpp. K13 runs on the simulated device's peer access sets, K18 on
// its pinned host memory.
#include "support/forwarding_device.hpp"
#include "support/sim_faults.hpp"
#include "support/sim_fixture.hpp"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define STREAMSAFE_TEST_ASAN 1
#endif
#endif
#ifndef STREAMSAFE_TEST_ASAN
#define STREAMSAFE_TEST_ASAN 0
#endif

#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

std::uint64_t driver_calls(const sim::counters& c) {
  return c.segment_allocs + c.segment_frees + c.maps + c.unmaps;
}

// ---- K12 ------------------------------------------------------------------------------------

struct k12_result {
  std::size_t ooms = 0;
  std::string first_oom;
  std::int64_t reserved_peak = 0;
  std::uint64_t late_driver_calls = 0;  // in the last 1,000 steps
  std::size_t faults = 0;
};

enum class k12_variant { plain, live_block, graphs };

k12_result run_k12(backend_kind backend, k12_variant variant) {
  options o = make_options(backend);
  o.memory_limit_bytes = 512 * MiB;
  sim_env env(o);
  const auto s = env.dev.create_stream();
  void* kept = variant == k12_variant::live_block ? env.alloc.allocate(16 * MiB, s) : nullptr;
  // Each step's kernel is short (5 us, and the clock advances 5 us a step), and the host runs ten
  // steps ahead of the device, as a training loop's host does: a fence recorded at a step
  // completes ten steps later. (With the clock standing still no fence would ever complete, and
  // only a host wait, which allocate makes in its out-of-memory retry alone, could give memory
  // back.)
  env.dev.launch(s, 50, {}, "the host runs ten steps ahead");
  k12_result r;
  sim::counters at_half{};
  for (int i = 0; i < 2000; ++i) {
    if (i == 1000) at_half = env.dev.counters();
    const std::size_t n = 64 * MiB + static_cast<std::size_t>(i) * 64 * KiB;
    try {
      if (variant == k12_variant::graphs) {
        env.alloc.notify_capture_begin(s);
        env.dev.begin_capture(s);
        void* p = nullptr;
        try {
          p = env.alloc.allocate(n, s);
        } catch (...) {
          env.dev.end_capture(s);
          env.alloc.notify_capture_end(s);
          throw;
        }
        env.dev.launch(s, 5, {writes(p, n)}, "captured step");
        env.alloc.deallocate(p);
        const auto graph = env.dev.end_capture(s);
        const auto id = env.alloc.notify_capture_end(s);
        env.dev.launch_graph(graph, s);  // replayed once
        env.alloc.notify_graph_released(id);
      } else {
        void* p = env.alloc.allocate(n, s);
        env.dev.launch(s, 5, {writes(p, n)}, "step");
        env.alloc.deallocate(p);
      }
      env.dev.advance(5);
    } catch (const out_of_memory& e) {
      if (r.ooms++ == 0) r.first_oom = std::to_string(i) + ": " + e.what();
    }
  }
  r.late_driver_calls = driver_calls(env.dev.counters()) - driver_calls(at_half);
  r.reserved_peak = env.alloc.stats().reserved_bytes.peak;
  env.dev.run_until_idle();
  r.faults = env.dev.fault_count();
  if (kept) env.alloc.deallocate(kept);
  env.alloc.check_invariants();
  return r;
}

}  // namespace

TEST_CASE(
    "K12: 2,000 requests growing by 64 KiB under a 512 MiB cap: no out_of_memory, reserved about "
    "twice the "
    "largest request, driver calls per step tend to zero",
    "[core][cases][K12]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  const k12_variant variant = GENERATE(k12_variant::plain, k12_variant::live_block);
  INFO("backend " << name_of(backend)
                  << (variant == k12_variant::live_block ? ", a 16 MiB block live" : ""));
  const auto r = run_k12(backend, variant);
  constexpr std::int64_t largest = 64 * MiB + 1999 * 64 * KiB;
  INFO("out_of_memory " << r.ooms << " (first " << r.first_oom << "), reserved peak "
                        << r.reserved_peak / MiB << " MiB, driver calls in the last 1,000 steps "
                        << r.late_driver_calls);
  CHECK(r.ooms == 0);
  CHECK(r.reserved_peak <= 2 * largest + static_cast<std::int64_t>(40 * MiB));
  CHECK(r.late_driver_calls <= 100);  // at most one driver call per ten steps
  CHECK(r.faults == 0);
}

TEST_CASE(
    "K12: each growing step captured in a graph, replayed once and released: no out_of_memory, "
    "nothing a "
    "graph references released",
    "[core][graph][cases][K12]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  INFO("backend " << name_of(backend));
  const auto r = run_k12(backend, k12_variant::graphs);
  INFO("out_of_memory " << r.ooms << " (first " << r.first_oom << "), reserved peak "
                        << r.reserved_peak / MiB << " MiB");
  CHECK(r.ooms == 0);
  CHECK(r.faults == 0);
  CHECK(r.reserved_peak <= static_cast<std::int64_t>(512 * MiB));
}

// ---- K13 ------------------------------------------------------------------------------------
// On the simulated device (sim::device_config::peers): map() grants access to the device and to
// every peer that can access it, and reports a chunk whose access set differs from the other
// chunks of its reserved range (fault_kind::access_mismatch). What needs two GPUs (a kernel on
// device 1 writing through the peer pointer, a peer copy) is in docs/cases.md.

namespace {

struct k13_env {
  sim::simulated_device dev;
  caching_allocator alloc;
  stream_handle s;
  explicit k13_env(sim::device_config c)
      : dev(c), alloc(dev, make_options(backend_kind::expandable)), s(dev.create_stream()) {}
  static sim::device_config config() {
    sim::device_config c = sim_config();
    c.peers = {{1, true}, {2, false}};  // device 2 has no peer capability
    return c;
  }
  // Chunks of [p, p + n) whose access set is not {0, 1}.
  std::size_t chunks_without_peer(const void* p, std::size_t n) const {
    std::size_t bad = 0;
    for (std::uintptr_t a = addr(p); a < addr(p) + n; a += dev.map_granularity_bytes())
      bad += dev.access_devices(a) != std::vector<int>{0, 1} ? 1 : 0;
    return bad;
  }
};

// K13's scenario: a live block keeps the head of the pool's range mapped; a 64 MiB block spans
// the chunks mapped for an earlier block and those a later growth maps; it is freed, the cache
// emptied (its chunks unmapped) and allocated again at the same addresses (mapped again), three
// times. omit_peer: the last remapping leaves device 1 out (a backend that forgets a peer).
std::size_t run_k13(k13_env& env, bool omit_peer) {
  void* keep = env.alloc.allocate(20 * MiB, env.s);
  void* first = env.alloc.allocate(30 * MiB, env.s);
  env.alloc.deallocate(first);
  void* p = env.alloc.allocate(64 * MiB, env.s);  // over first's chunks and new ones
  std::size_t bad = env.chunks_without_peer(p, 64 * MiB) + env.chunks_without_peer(keep, 20 * MiB);
  for (int round = 0; round < 3; ++round) {
    env.dev.launch(env.s, 5, {writes(p, 64 * MiB)}, "device 1 writes through the peer pointer");
    env.alloc.deallocate(p);
    env.dev.run_until_idle();
    env.alloc.empty_cache();
    if (omit_peer && round == 2) env.dev.omit_peer_on_next_maps(1, 100);
    void* again = env.alloc.allocate(64 * MiB, env.s);
    CHECK(again == p);  // the same addresses, mapped again
    p = again;
    bad += env.chunks_without_peer(p, 64 * MiB);
  }
  env.alloc.deallocate(p);
  env.alloc.deallocate(keep);
  env.alloc.check_invariants();
  return bad;
}

}  // namespace

TEST_CASE(
    "K13: every chunk of an expandable segment carries the same peer access, first mapping or "
    "remapping; a device without peer capability does not fail a map",
    "[core][cases][K13]") {
  k13_env env(k13_env::config());
  CHECK(run_k13(env, false) == 0);
  const auto faults = env.dev.faults();
  INFO((faults.empty() ? std::string() : faults.front().message));
  CHECK(env.dev.fault_count() == 0);
  CHECK(env.dev.counters().maps >= 4);  // first mapping, a later growth, three remappings
}

TEST_CASE(
    "Control (K13): a remapping that leaves a peer out is seen by the check and by the access "
    "sets",
    "[core][cases][K13]") {
  k13_env env(k13_env::config());
  CHECK(run_k13(env, true) > 0);
  const auto faults = env.dev.faults();
  REQUIRE(!faults.empty());
  CHECK(faults.front().kind == sim::fault_kind::access_mismatch);
  INFO(faults.front().message);
  CHECK(faults.front().message.find("{0}") != std::string::npos);
}

// ---- K14 ------------------------------------------------------------------------------------

TEST_CASE(
    "K14: a free goes to the allocator instance that made the block, whatever instance is asked",
    "[core][cases][K14]") {
  sim::simulated_device dev(sim_config());
  caching_allocator whole(dev, make_options(backend_kind::cuda_malloc));
  caching_allocator expandable(dev, make_options(backend_kind::expandable));
  const auto s = dev.create_stream();
  void* a = whole.allocate(8 * MiB, s);
  void* b = expandable.allocate(8 * MiB, s);
  void* b2 = expandable.allocate(4 * MiB, s);  // in b's segment
  const auto whole_before = whole.stats().to_string();
  const auto expandable_before = expandable.stats().to_string();
  CHECK_THROWS_AS(whole.deallocate(b), invalid_pointer);  // another instance's block
  CHECK_THROWS_AS(expandable.deallocate(a), invalid_pointer);
  CHECK_THROWS_AS(expandable.deallocate(static_cast<char*>(b) + 4096),
                  invalid_pointer);  // interior
  CHECK_THROWS_AS(whole.deallocate(static_cast<char*>(b2) + 512), invalid_pointer);
  CHECK(whole.stats().to_string() == whole_before);
  CHECK(expandable.stats().to_string() == expandable_before);
  whole.deallocate(a);
  expandable.deallocate(b);
  expandable.deallocate(b2);
  whole.empty_cache();
  expandable.empty_cache();
  CHECK(whole.stats().reserved_bytes.current == 0);
  CHECK(expandable.stats().reserved_bytes.current == 0);
  CHECK(dev.counters().segment_frees ==
        dev.counters().segment_allocs);  // each by its own primitive
  CHECK(dev.counters().unmaps >= 1);
  CHECK(dev.fault_count() == 0);
}
// Not covered here: the interposer and the C API switching a mode (cached, pass-through,
// expandable) while blocks are live; that needs the preload front end (frontend_preload_test).

// ---- K15 ------------------------------------------------------------------------------------

namespace {

// Counts the backend calls made in a process other than the one that built it (a forked
// child): every call on the parent's handles there is a violation, except the read-only ones.
class fork_watch final : public forwarding_device {
 public:
  explicit fork_watch(sim::simulated_device& dev) : forwarding_device(dev), parent_(::getpid()) {}
  std::size_t child_calls() const { return child_calls_.load(); }
  // Makes allocate_segment block (outside the device) until release_growth(): a parent thread
  // then sits inside an allocator call with its locks held.
  void block_growth() { blocking_ = true; }
  void release_growth() {
    std::lock_guard<std::mutex> lk(mu_);
    blocking_ = false;
    cv_.notify_all();
  }
  bool growth_blocked_now() const { return in_growth_.load(); }

  void* allocate_segment(std::size_t n) override {
    note();
    if (blocking_) {
      in_growth_ = true;
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return !blocking_; });
      in_growth_ = false;
    }
    return dev_.allocate_segment(n);
  }
  void free_segment(void* b, std::size_t n) override { note(), dev_.free_segment(b, n); }
  void release_address_range(void* b, std::size_t n) override {
    note(), dev_.release_address_range(b, n);
  }
  void unmap(void* p, std::size_t n) override { note(), dev_.unmap(p, n); }
  void record_event(event_handle e, stream_handle s) override { note(), dev_.record_event(e, s); }
  bool query_event(event_handle e) override { return note(), dev_.query_event(e); }
  void synchronize_event(event_handle e) override { note(), dev_.synchronize_event(e); }
  void stream_wait_event(stream_handle s, event_handle e) override {
    note(), dev_.stream_wait_event(s, e);
  }
  bool query_stream(stream_handle s) override { return note(), dev_.query_stream(s); }
  void synchronize_device() override { note(), dev_.synchronize_device(); }

 private:
  void note() {
    if (::getpid() != parent_) child_calls_.fetch_add(1);
  }
  const pid_t parent_;
  std::atomic<std::size_t> child_calls_{0};
  std::atomic<bool> blocking_{false}, in_growth_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

// Runs `child` in a forked child under a 5 s alarm; the child's return value is its exit
// status. Returns the status waitpid reports.
template <class Child>
int run_in_child(Child child) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(5);
    int code = 99;
    try {
      code = child();
    } catch (...) {
      code = 98;
    }
    ::_exit(code);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return "killed by signal " + std::to_string(WTERMSIG(status)) + " (14: the 5 s alarm: a hang)";
  return "status " + std::to_string(status);
}

// 200 blocks cached over 3 streams, a kernel on one of them still writing a cached block.
struct fork_env {
  sim::simulated_device dev{sim_config()};
  fork_watch backend{dev};
  std::unique_ptr<caching_allocator> alloc = std::make_unique<caching_allocator>(backend,
                                                                                 options{});
  std::vector<stream_handle> streams;
  fork_env() {
    for (int i = 0; i < 3; ++i) streams.push_back(dev.create_stream());
    std::vector<void*> blocks;
    for (int i = 0; i < 200; ++i) {
      blocks.push_back(
          alloc->allocate((1 + i % 7) * 512 * KiB, streams[static_cast<std::size_t>(i % 3)]));
    }
    dev.launch(streams[0], 100, {writes(blocks[0], 512 * KiB, 0x15)},
               "kernel writing a cached block");
    for (void* p : blocks) alloc->deallocate(p);
  }
};

}  // namespace

TEST_CASE(
    "K15: a forked child neither frees, unmaps nor synchronises the parent's memory and handles, "
    "and exits "
    "normally",
    "[core][fork][cases][K15]") {
  fork_env env;
  const auto status = run_in_child([&] {
    env.alloc
        ->empty_cache();  // the child's allocator must have reset itself: nothing of the parent's
    env.alloc.reset();    // destroying it releases nothing of the parent's either
    return env.backend.child_calls() == 0 ? 0 : 1;
  });
  INFO(describe(status) << " (1: the child made backend calls on the parent's handles)");
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  // The parent goes on: its cached block's contents are intact and its cache works.
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  void* p = env.alloc->allocate(512 * KiB, env.streams[0]);
  CHECK(p != nullptr);
  env.alloc->deallocate(p);
  env.alloc->check_invariants();
}

TEST_CASE(
    "Control: the same empty_cache in the parent makes the release calls the child must not make",
    "[core][fork][cases][K15]") {
  fork_env env;
  const auto frees = env.dev.counters().segment_frees;
  env.alloc->empty_cache();
  CHECK(env.dev.counters().segment_frees > frees);
  CHECK(env.backend.child_calls() == 0);  // (in the parent nothing counts)
}

TEST_CASE(
    "K15: a child forked while a parent thread holds an allocator lock does not hang in the "
    "allocator",
    "[core][fork][cases][K15]") {
  fork_env env;
  env.backend.block_growth();
  std::thread grower([&] {
    void* p = env.alloc->allocate(512 * MiB,
                                  env.streams[1]);  // blocks in allocate_segment, locks held
    env.alloc->deallocate(p);
  });
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!env.backend.growth_blocked_now() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  REQUIRE(env.backend.growth_blocked_now());
  const auto status = run_in_child([&] {
    try {
      void* p = env.alloc->allocate(4 * KiB, env.streams[2]);  // returns or throws; never hangs
      env.alloc->deallocate(p);
    } catch (const std::exception&) {
    }
    env.alloc->empty_cache();
    return 0;
  });
  env.backend.release_growth();
  grower.join();
  INFO(describe(status));
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  env.dev.run_until_idle();
  env.alloc->check_invariants();
}

TEST_CASE(
    "K15: a process exits with status 0 from a non-main thread with 200 blocks cached over 3 "
    "streams just "
    "after a hold was opened",
    "[core][fork][cases][K15]") {
#if defined(__SANITIZE_ADDRESS__) || STREAMSAFE_TEST_ASAN
  // LeakSanitizer's check at exit() stops the other threads with ptrace; called from a thread
  // that is not the forked child's main thread, it does not return in this sandbox (the child
  // hit the 5 s alarm). The plain, UBSan and TSan builds run the case.
  WARN(
      "skipped under AddressSanitizer: its exit-time leak check hangs when exit() runs on a "
      "non-main thread of a forked child");
  return;
#endif
  const auto status = run_in_child([] {
    // The allocator lives in static storage: exit() destroys it, waiting on its fences.
    static sim::simulated_device dev(sim_config());
    static caching_allocator alloc(dev, options{});
    std::vector<stream_handle> streams;
    for (int i = 0; i < 3; ++i) streams.push_back(dev.create_stream());
    const auto h = dev.hold(streams[1]);
    std::vector<void*> blocks;
    for (int i = 0; i < 200; ++i)
      blocks.push_back(alloc.allocate((1 + i % 5) * MiB, streams[static_cast<std::size_t>(i % 3)]));
    dev.launch(streams[1], 100, {writes(blocks[1], MiB)}, "pending work");
    for (void* p : blocks) alloc.deallocate(p);
    dev.open(h);
    std::thread([] { std::exit(dev.fault_count() == 0 ? 0 : 3); }).join();
    return 97;  // not reached
  });
  INFO(describe(status));
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

// ---- K18 ------------------------------------------------------------------------------------
// The pinned host allocator is a caching_allocator over the device's host backend
// (device_backend::host_backend(): cudaHostAlloc / cudaFreeHost on a GPU, the simulated device's
// allocate_host here), which shares the device's streams and events: a stream-ordered free or a
// recorded use keeps a host block from reuse, and empty_cache from cudaFreeHost, until its
// events complete.
TEST_CASE(
    "K18: pinned host memory freed under a pending copy is not handed out again before the copy",
    "[core][cases][K18]") {
  const bool record = GENERATE(false, true);
  CAPTURE(record);
  sim::simulated_device dev(sim_config());
  caching_allocator host(*dev.host_backend(), options{});
  caching_allocator device(dev, options{});
  const auto s = dev.create_stream();
  void* h = host.allocate(64 * MiB, 0);
  dev.launch(0, 1, {writes(h, 64 * MiB, 1)}, "fill h with 1");
  dev.run_until_idle();
  void* d = device.allocate(64 * MiB, s);
  const auto hold = dev.hold(s);
  dev.copy_async(d, h, 64 * MiB, s);  // h -> device, queued behind the hold
  if (record) {
    host.record_stream(h, s);
    host.deallocate(h);
  } else {
    host.deallocate(h, s);
  }
  void* h2 = host.allocate(64 * MiB, 0);
  // On stream 0: a race if h2 aliases h without waiting for the copy.
  dev.launch(0, 1, {writes(h2, 64 * MiB, 2)}, "fill h2 with 2");
  host.empty_cache(empty_cache_mode::defer);  // must not free h under the copy
  CHECK(dev.fault_count() == 0);
  dev.open(hold);
  dev.run_until_idle();
  CHECK(dev.value_at(addr(d)) == std::optional<std::uint8_t>(1));
  CHECK(dev.value_at(addr(d) + 64 * MiB - 1) == std::optional<std::uint8_t>(1));
  CHECK(dev.fault_count() == 0);
  CHECK(host.find_block_containing(static_cast<char*>(h2) + 4096).address == addr(h2));
  // The device-to-host variant: a copy into h3 pending, then h3 freed on its stream and a
  // new host block written at once: the copy is not overwritten out of order.
  void* h3 = host.allocate(32 * MiB, 0);
  dev.launch(s, 1, {writes(d, 32 * MiB, 7)}, "produce");
  const auto hold2 = dev.hold(s);
  dev.copy_async(h3, d, 32 * MiB, s);
  host.deallocate(h3, s);
  void* h4 = host.allocate(32 * MiB, 0);
  dev.launch(0, 1, {writes(h4, 32 * MiB, 8)}, "reuse");
  CHECK(dev.fault_count() == 0);
  dev.open(hold2);
  dev.run_until_idle();
  CHECK(dev.fault_count() == 0);
  host.deallocate(h2);
  host.deallocate(h4);
  device.deallocate(d);
  host.empty_cache();
  CHECK(dev.host_bytes_in_use() == 0);
  host.check_invariants();
}

TEST_CASE("K18 control: a host free that forgets the copy's stream lets the block be overwritten",
          "[core][cases][K18]") {
  sim::simulated_device dev(sim_config());
  caching_allocator host(*dev.host_backend(), options{});
  caching_allocator device(dev, options{});
  const auto s = dev.create_stream();
  void* h = host.allocate(64 * MiB, 0);
  void* d = device.allocate(64 * MiB, s);
  const auto hold = dev.hold(s);
  dev.copy_async(d, h, 64 * MiB, s);
  host.deallocate(h);  // no stream, no record_stream: reused at once on stream 0
  void* h2 = host.allocate(64 * MiB, 0);
  CHECK(h2 == h);
  dev.launch(0, 1, {writes(h2, 64 * MiB, 2)}, "fill h2 with 2");
  CHECK(dev.fault_count() > 0);  // the race the simulated device reports
  dev.open(hold);
  dev.run_until_idle();
  host.deallocate(h2);
  device.deallocate(d);
}
