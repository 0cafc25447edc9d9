// The release worker (options::release_worker on, release_worker.cpp): in defer mode
// empty_cache fences and queues the whole batch and returns; a worker thread gives the memory
// back once its fence has completed. Checked on the simulated device (thread-safe): no unmap or
// free_segment on the calling thread, the memory comes back after the fence and not before, the
// fence scope still decides safety, an allocation at the limit waits for the release in flight
// (and one that fits does not), failures put memory back, captures silence the worker,
// destruction and fork are clean.
#include "support/forwarding_device.hpp"
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <thread>

using namespace streamsafe;
using namespace streamsafe::test;
using namespace std::chrono_literals;

namespace {

// Counts the releasing calls (unmap, free_segment) made on the thread that built it and on
// others; a gate, when closed, holds every releasing call (outside the device) until opened.
class release_watch final : public forwarding_device {
 public:
  explicit release_watch(sim::simulated_device& dev)
      : forwarding_device(dev), home_(std::this_thread::get_id()) {}

  std::size_t calls_on_home() const { return home_calls_.load(); }
  std::size_t calls_elsewhere() const { return other_calls_.load(); }
  bool in_release() const { return in_release_.load(); }
  void close_gate() {
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = true;
  }
  void open_gate() {
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = false;
    cv_.notify_all();
  }
  // Waits until a releasing call sits at the closed gate.
  bool wait_in_release(std::chrono::milliseconds timeout) {
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (!in_release_.load()) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(1ms);
    }
    return true;
  }

  void free_segment(void* b, std::size_t n) override {
    note();
    dev_.free_segment(b, n);
  }
  void unmap(void* p, std::size_t n) override {
    note();
    dev_.unmap(p, n);
  }

 private:
  void note() {
    (std::this_thread::get_id() == home_ ? home_calls_ : other_calls_).fetch_add(1);
    std::unique_lock<std::mutex> lk(mu_);
    if (closed_) {
      in_release_ = true;
      cv_.wait(lk, [&] { return !closed_; });
      in_release_ = false;
    }
  }
  const std::thread::id home_;
  std::atomic<std::size_t> home_calls_{0}, other_calls_{0};
  std::atomic<bool> in_release_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  bool closed_ = false;
};

options worker_options(backend_kind backend, release_worker_mode worker = release_worker_mode::on,
                       fence_scope scope = fence_scope::all_streams) {
  options o = make_options(backend, scope, empty_cache_mode::defer);
  o.release_worker = worker;
  return o;
}

struct worker_env {
  sim::simulated_device dev;
  release_watch watch{dev};
  std::unique_ptr<caching_allocator> alloc;
  explicit worker_env(options o, sim::device_config c = sim_config())
      : dev(c), alloc(std::make_unique<caching_allocator>(watch, o)) {}
  std::int64_t reserved() const { return alloc->stats().reserved_bytes.current; }
  bool settle() { return alloc->wait_for_release_worker_idle(5s); }
  // 64 MiB on s, read by a kernel of s that runs 1000 us (an optimizer tail), freed, and
  // empty_cache in defer mode: the memory waits in the release queue behind that kernel.
  void queue_behind_tail(stream_handle s) {
    void* p = alloc->allocate(64 * MiB, s);
    dev.launch(s, 1000, {reads(p, 64 * MiB)}, "optimizer tail");
    alloc->deallocate(p);
    CHECK(alloc->empty_cache() == 0);  // queued behind the running kernel
    REQUIRE(settle());
    REQUIRE(alloc->pending_release_bytes() >= 64 * MiB);
  }
};

}  // namespace

TEST_CASE("release_worker is an option: on, off, auto (the default; the core treats it as off)",
          "[core][worker]") {
  CHECK(options{}.release_worker == release_worker_mode::automatic);
  CHECK(options::parse("release_worker:on").release_worker == release_worker_mode::on);
  CHECK(options::parse("release_worker:off").release_worker == release_worker_mode::off);
  CHECK(options::parse("release_worker:auto").release_worker == release_worker_mode::automatic);
  CHECK_THROWS_AS(options::parse("release_worker:yes"), config_error);
  CHECK_THAT(options::parse("empty_cache:defer,release_worker:on").to_string(),
             Catch::Contains("release_worker:on"));
  // auto in the core: the calling thread releases what is safe now, as without a worker.
  worker_env env(worker_options(backend_kind::expandable, release_worker_mode::automatic));
  const auto s = env.dev.create_stream();
  env.alloc->deallocate(env.alloc->allocate(64 * MiB, s));
  CHECK(env.alloc->empty_cache() > 0);
  CHECK(env.watch.calls_on_home() > 0);
  CHECK(env.watch.calls_elsewhere() == 0);
}

TEST_CASE(
    "release_worker:on: empty_cache in defer mode makes no unmap or free_segment call on the "
    "calling thread",
    "[core][worker]") {
  const backend_kind backend = GENERATE(backend_kind::expandable, backend_kind::cuda_malloc);
  INFO(to_string(backend));
  SECTION("control: with the worker off the calling thread releases") {
    worker_env env(worker_options(backend, release_worker_mode::off));
    const auto s = env.dev.create_stream();
    env.alloc->deallocate(env.alloc->allocate(64 * MiB, s));
    CHECK(env.alloc->empty_cache() >= 64 * MiB);
    CHECK(env.watch.calls_on_home() > 0);
  }
  SECTION("fence already complete: queued for the worker, which gives it back") {
    worker_env env(worker_options(backend));
    const auto s = env.dev.create_stream();
    env.alloc->deallocate(env.alloc->allocate(64 * MiB, s));
    CHECK(env.alloc->empty_cache() == 0);  // returns at once
    REQUIRE(env.settle());
    CHECK(env.reserved() == 0);
    CHECK(env.watch.calls_on_home() == 0);
    CHECK(env.watch.calls_elsewhere() > 0);
    CHECK(env.alloc->stats().release_worker_releases >= 1);
    CHECK(env.alloc->release_worker_idle());
    env.alloc->check_invariants();
  }
  SECTION("fence pending: nothing goes back until it completes, then the worker releases") {
    worker_env env(worker_options(backend));
    const auto s = env.dev.create_stream();
    void* p = env.alloc->allocate(64 * MiB, s);
    env.dev.launch(s, 1000, {reads(p, 64 * MiB)}, "reader");
    env.alloc->deallocate(p);
    CHECK(env.alloc->empty_cache() == 0);
    REQUIRE(env.settle());
    CHECK(env.alloc->pending_release_bytes() >= 64 * MiB);
    CHECK(env.alloc->stats().release_queued_bytes >= 64 * MiB);
    CHECK(env.reserved() >= static_cast<std::int64_t>(64 * MiB));
    CHECK_FALSE(env.alloc->release_worker_idle());
    env.dev.advance(500);
    REQUIRE(env.settle());
    CHECK(env.reserved() >= static_cast<std::int64_t>(64 * MiB));  // still running
    env.dev.advance(600);
    REQUIRE(env.settle());
    CHECK(env.reserved() == 0);
    CHECK(env.alloc->pending_release_bytes() == 0);
    CHECK(env.alloc->stats().release_queued_bytes == 0);
    CHECK(env.watch.calls_on_home() == 0);
    CHECK(env.dev.fault_count() == 0);
    CHECK(env.dev.counters().event_syncs == 0);  // polled, never waited on
    CHECK(env.dev.counters().device_syncs == 0);
    env.alloc->check_invariants();
  }
}

TEST_CASE(
    "release_worker:on keeps the fence scope's safety: no release under pending work on a fenced "
    "stream; "
    "the allocation_stream scope (control) faults",
    "[core][worker]") {
  const backend_kind backend = GENERATE(backend_kind::expandable, backend_kind::cuda_malloc);
  const fence_scope scope = GENERATE(fence_scope::all_streams, fence_scope::allocation_stream);
  INFO(to_string(backend) << " " << to_string(scope));
  worker_env env(worker_options(backend, release_worker_mode::on, scope));
  const auto a = env.dev.create_stream();
  const auto b = env.dev.create_stream();
  env.alloc->deallocate(env.alloc->allocate(4 * KiB, b));  // the allocator has seen b
  void* p = env.alloc->allocate(64 * MiB, a);
  env.dev.launch(b, 1000, {reads(p, 64 * MiB)},
                 "unrecorded use on b");  // FSDP2-style, no record_stream
  env.alloc->deallocate(p);
  CHECK(env.alloc->empty_cache() == 0);
  REQUIRE(env.settle());
  env.dev.advance(100);
  REQUIRE(env.settle());
  if (scope == fence_scope::all_streams) {
    CHECK(env.dev.fault_count() == 0);
    CHECK(env.alloc->pending_release_bytes() >= 64 * MiB);
    env.dev.advance(1000);
    REQUIRE(env.settle());
    CHECK(env.alloc->pending_release_bytes() == 0);
    CHECK(env.dev.fault_count() == 0);
  } else {
    CHECK(env.dev.fault_count() > 0);  // the worker released under b's kernel, as the scope allows
  }
  CHECK(env.watch.calls_on_home() == 0);
}

TEST_CASE(
    "release_worker:on: an allocation at the memory limit waits for the release in flight; one "
    "that fits "
    "does not wait",
    "[core][worker]") {
  const backend_kind backend = GENERATE(backend_kind::expandable, backend_kind::cuda_malloc);
  INFO(to_string(backend));
  options o = worker_options(backend);
  o.memory_limit_bytes = 256 * MiB;
  worker_env env(o);
  const auto s = env.dev.create_stream();
  env.alloc->deallocate(env.alloc->allocate(200 * MiB, s));
  env.watch.close_gate();
  CHECK(env.alloc->empty_cache() == 0);
  REQUIRE(env.watch.wait_in_release(5000ms));  // the worker sits in unmap / free_segment
  const statistics during = env.alloc->stats();
  CHECK(during.release_worker_bytes >= 200 * MiB);
  CHECK(env.alloc->pending_release_bytes() >= 200 * MiB);
  CHECK_FALSE(env.alloc->release_worker_idle());
  // Fits beside the memory being released: served at once, while the gate is still closed.
  void* small = env.alloc->allocate(2 * MiB, s);
  CHECK(env.watch.in_release());
  // Needs the memory being released: waits for the worker, then succeeds.
  auto big = std::async(std::launch::async, [&] { return env.alloc->allocate(200 * MiB, s); });
  // reclaim() returns once the worker's release in flight has ended (never a fence wait).
  auto reclaimed = std::async(std::launch::async, [&] { return env.alloc->reclaim(); });
  CHECK(big.wait_for(100ms) == std::future_status::timeout);
  CHECK(reclaimed.wait_for(0ms) == std::future_status::timeout);
  env.watch.open_gate();
  REQUIRE(reclaimed.wait_for(5s) == std::future_status::ready);
  CHECK(env.alloc->stats().release_worker_bytes == 0);
  REQUIRE(big.wait_for(5s) == std::future_status::ready);
  void* p = nullptr;
  CHECK_NOTHROW(p = big.get());
  CHECK(p != nullptr);
  const statistics after = env.alloc->stats();
  CHECK(after.num_ooms == 0);
  CHECK(after.release_worker_bytes == 0);
  CHECK(after.release_worker_releases >= 1);
  CHECK(env.watch.calls_on_home() == 0);
  env.alloc->deallocate(p);
  env.alloc->deallocate(small);
  env.alloc->check_invariants();
  CHECK(env.dev.fault_count() == 0);
}

TEST_CASE(
    "release_worker:on: an allocation that needs memory behind a pending fence throws "
    "out_of_memory "
    "without waiting on the fence (K8)",
    "[core][worker]") {
  options o = worker_options(backend_kind::expandable);
  o.memory_limit_bytes = 256 * MiB;
  worker_env env(o);
  const auto s = env.dev.create_stream();
  const auto h = env.dev.hold(s, "collective waiting for the host");
  void* live = env.alloc->allocate(50 * MiB, s);
  void* p = env.alloc->allocate(200 * MiB, s);
  env.dev.launch(s, 10, {reads(p, 200 * MiB)});
  env.alloc->deallocate(p);
  CHECK(env.alloc->empty_cache() == 0);
  // The 200 MiB queued behind the held fence serve at most 200 MiB of it (reclaimed behind a
  // device-side wait); 220 MiB needs 20 MiB more, past the limit: out_of_memory, no host wait.
  CHECK_THROWS_AS(env.alloc->allocate(220 * MiB, env.dev.create_stream()), out_of_memory);
  CHECK(env.dev.counters().event_syncs == 0);
  CHECK(env.dev.counters().device_syncs == 0);
  env.dev.open(h);
  env.dev.run_until_idle();
  env.alloc->deallocate(live);
  env.alloc->empty_cache();
  REQUIRE(env.settle());
  CHECK(env.reserved() == 0);
  CHECK(env.dev.fault_count() == 0);
}

TEST_CASE(
    "release_worker:on: a failed driver call in the worker puts the memory back and the worker "
    "goes on",
    "[core][worker]") {
  worker_env env(worker_options(backend_kind::expandable));
  const auto s = env.dev.create_stream();
  env.alloc->deallocate(env.alloc->allocate(64 * MiB, s));
  const auto reserved = env.reserved();
  env.dev.fail_next(sim::call::unmap, 1);
  CHECK(env.alloc->empty_cache() == 0);
  REQUIRE(env.settle());
  env.alloc->check_invariants();
  CHECK(env.reserved() <= reserved);
  CHECK(env.alloc->pending_release_bytes() == 0);
  CHECK(env.alloc->empty_cache() == 0);  // the memory is cached again: a second try gives it back
  REQUIRE(env.settle());
  CHECK(env.reserved() == 0);
  CHECK(env.watch.calls_on_home() == 0);
  env.alloc->check_invariants();
}

TEST_CASE(
    "release_worker:on: the worker makes no query or release while a CUDA graph capture is "
    "underway",
    "[core][worker]") {
  worker_env env(worker_options(backend_kind::expandable));
  const auto capturing = env.dev.create_stream();
  const auto s = env.dev.create_stream();
  env.alloc->deallocate(env.alloc->allocate(4 * KiB, capturing));
  void* p = env.alloc->allocate(64 * MiB, s);
  env.dev.launch(s, 100, {reads(p, 64 * MiB)});
  env.alloc->deallocate(p);
  CHECK(env.alloc->empty_cache() == 0);
  REQUIRE(env.settle());
  const auto graph = env.alloc->notify_capture_begin(capturing);
  env.dev.begin_capture(capturing);
  env.dev.advance(200);  // the fence completes during the capture
  REQUIRE(env.settle());
  REQUIRE(env.settle());
  CHECK(env.alloc->pending_release_bytes() >= 64 * MiB);
  CHECK(env.dev.fault_count() == 0);  // a query or unmap now would be a capture_violation
  env.dev.end_capture(capturing);
  env.alloc->notify_capture_end(capturing);
  REQUIRE(env.settle());
  CHECK(env.alloc->pending_release_bytes() == 0);
  CHECK(env.dev.fault_count() == 0);
  env.alloc->notify_graph_released(graph);
}

TEST_CASE(
    "release_worker:on: destroying the allocator with queued work and with a release in flight is "
    "clean",
    "[core][worker]") {
  const backend_kind backend = GENERATE(backend_kind::expandable, backend_kind::cuda_malloc);
  INFO(to_string(backend));
  SECTION("queued behind a fence") {
    worker_env env(worker_options(backend));
    const auto s = env.dev.create_stream();
    void* p = env.alloc->allocate(64 * MiB, s);
    env.dev.launch(s, 1000, {reads(p, 64 * MiB)});
    env.alloc->deallocate(p);
    CHECK(env.alloc->empty_cache() == 0);
    env.alloc.reset();  // joins the worker, then waits on the fence
    CHECK(env.dev.bytes_in_use() == 0);
    CHECK(env.dev.fault_count() == 0);
    CHECK(env.dev.counters().events_created == env.dev.counters().events_destroyed);
  }
  SECTION("in flight") {
    worker_env env(worker_options(backend));
    const auto s = env.dev.create_stream();
    env.alloc->deallocate(env.alloc->allocate(64 * MiB, s));
    env.watch.close_gate();
    CHECK(env.alloc->empty_cache() == 0);
    REQUIRE(env.watch.wait_in_release(5000ms));
    std::thread opener([&] {
      std::this_thread::sleep_for(50ms);
      env.watch.open_gate();
    });
    env.alloc.reset();
    opener.join();
    CHECK(env.dev.bytes_in_use() == 0);
    CHECK(env.dev.fault_count() == 0);
  }
}

TEST_CASE(
    "release_worker:on: a child forked while the worker polls has no worker, and neither hangs nor "
    "joins it",
    "[core][worker][fork]") {
  worker_env env(worker_options(backend_kind::expandable));
  const auto s = env.dev.create_stream();
  void* p = env.alloc->allocate(64 * MiB, s);
  env.dev.launch(s, 1000, {reads(p, 64 * MiB)});
  env.alloc->deallocate(p);
  CHECK(env.alloc->empty_cache() == 0);  // the worker polls the pending fence
  for (int i = 0; i < 20; ++i) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::alarm(5);
      int code = 0;
      try {
        // The child's allocator is inherited (core/fork.cpp): an allocation is refused with a
        // backend_error, a release does nothing, and there is no worker to wait for.
        try {
          env.alloc->allocate(4 * MiB, s);
          code = 4;
        } catch (const backend_error&) {
        }
        if (env.alloc->empty_cache() != 0) code = 5;
        if (code == 0) code = env.alloc->wait_for_release_worker_idle(1s) ? 0 : 2;
        env.alloc.reset();  // neither joins nor destroys the parent's thread
      } catch (...) {
        code = 3;
      }
      ::_exit(code);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    INFO("child " << i << " status " << status);
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
  env.dev.advance(2000);
  REQUIRE(env.settle());
  CHECK(env.alloc->pending_release_bytes() == 0);
  CHECK(env.dev.fault_count() == 0);
}

TEST_CASE(
    "A growth takes memory back from the release queue of its own pool instead of mapping more",
    "[core][worker]") {
  // empty_cache in defer mode right after a step, while the step's kernels still run: the
  // memory waits in the release queue for its fence. The next step's allocation on the same
  // stream gets that memory back (stream order makes it safe there, as before empty_cache)
  // rather than reserving as much again while the queued copy waits to be unmapped.
  const backend_kind backend = GENERATE(backend_kind::expandable, backend_kind::cuda_malloc);
  const release_worker_mode mode = GENERATE(release_worker_mode::on, release_worker_mode::off);
  INFO(to_string(backend) << ", release_worker " << to_string(mode));
  worker_env env(worker_options(backend, mode));
  const auto s = env.dev.create_stream();
  env.queue_behind_tail(s);
  const auto maps_before = env.dev.counters().maps + env.dev.counters().segment_allocs;
  SECTION("the same stream: the queued memory serves it, nothing more is reserved") {
    void* q = env.alloc->allocate(64 * MiB, s);
    env.dev.launch(s, 10, {writes(q, 64 * MiB)}, "next step");
    CHECK(env.dev.counters().maps + env.dev.counters().segment_allocs == maps_before);
    CHECK(env.reserved() == static_cast<std::int64_t>(64 * MiB));
    CHECK(env.alloc->pending_release_bytes() == 0);
    CHECK(env.alloc->stats().release_queued_bytes == 0);
    env.alloc->deallocate(q);
    env.dev.advance(2000);
    CHECK(env.dev.fault_count() == 0);
    env.alloc->check_invariants();
  }
  SECTION("another stream's pool takes it behind a wait on its fence, nothing more reserved") {
    const auto s2 = env.dev.create_stream();
    void* q = env.alloc->allocate(64 * MiB, s2);
    env.dev.launch(s2, 10, {writes(q, 64 * MiB)}, "next step on another stream");
    CHECK(env.dev.counters().maps + env.dev.counters().segment_allocs == maps_before);
    CHECK(env.reserved() == static_cast<std::int64_t>(64 * MiB));
    CHECK(env.alloc->pending_release_bytes() == 0);
    env.alloc->deallocate(q);
    env.dev.advance(2000);
    env.alloc->empty_cache(empty_cache_mode::wait);
    REQUIRE(env.settle());
    CHECK(env.reserved() == 0);
    CHECK(env.dev.fault_count() == 0);
    env.alloc->check_invariants();
  }
}

TEST_CASE(
    "finish_releases: the host waits on the fences of what empty_cache queued and gives it back; "
    "cached memory no call asked to release stays cached",
    "[core][worker]") {
  const backend_kind backend = GENERATE(backend_kind::expandable, backend_kind::cuda_malloc);
  const release_worker_mode mode = GENERATE(release_worker_mode::on, release_worker_mode::off);
  INFO(to_string(backend) << ", release_worker " << to_string(mode));
  worker_env env(worker_options(backend, mode));
  const auto s = env.dev.create_stream();
  const auto s2 = env.dev.create_stream();
  void* q = env.alloc->allocate(8 * MiB, s2);  // live through the empty_cache
  env.queue_behind_tail(s);
  env.alloc->deallocate(q);  // cached after the empty_cache: not queued, finish_releases leaves it
  const std::int64_t cached_q = env.reserved() - static_cast<std::int64_t>(64 * MiB);
  REQUIRE(cached_q >= static_cast<std::int64_t>(8 * MiB));

  CHECK(env.alloc->reclaim() == 0);  // control: reclaim never waits, the kernel still runs
  CHECK(env.alloc->pending_release_bytes() >= 64 * MiB);
  (void)env.alloc->finish_releases();  // with the worker on, the worker may be the one to unmap
  CHECK(env.alloc->pending_release_bytes() == 0);
  CHECK(env.alloc->release_worker_idle());
  CHECK(env.reserved() == cached_q);          // the queued 64 MiB went back, q's segment stayed
  CHECK(env.dev.counters().event_syncs > 0);  // it waited on the fence
  CHECK(env.dev.fault_count() == 0);          // and nothing went back under the kernel
  CHECK(env.alloc->finish_releases() == 0);   // nothing queued: returns at once
  env.alloc->check_invariants();
}
