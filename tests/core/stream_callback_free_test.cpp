// Case K16: a free from inside a stream callback (cudaLaunchHostFunc), on
// the simulated device. The simulated device has no host functions; host_function models one:
// a hold on S stands for the callback's place in S's queue (S's later work waits for it), the
// callback runs on its own thread once S's earlier work completed, and S goes on when it
// returns. CUDA forbids CUDA calls inside a host function (they may fail with
// cudaErrorNotPermitted or deadlock): callback_backend counts every backend call made from a
// callback thread and fails it with backend_error. Expected: a free in a callback does host
// bookkeeping only (no backend call; what must reach the driver is deferred to an ordinary
// thread), empty_cache in a callback returns at once, a growth in a callback fails fast, and
// no variant hangs (5 s watchdog: the blocking host gives up and the test fails).
#include "support/blocking_host.hpp"
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

thread_local bool in_host_function = false;

// Forwards to `inner`; a call from a host function is counted and fails.
class callback_backend final : public device_backend {
 public:
  explicit callback_backend(device_backend& inner) : inner_(inner) {}
  std::size_t calls_from_callbacks() const { return calls_.load(); }
  std::string first_call() const {
    std::lock_guard<std::mutex> lk(mu_);
    return first_;
  }

  int device() const noexcept override { return inner_.device(); }
  const char* name() const noexcept override { return inner_.name(); }
  void* allocate_segment(std::size_t n) override {
    return check("allocate_segment"), inner_.allocate_segment(n);
  }
  void free_segment(void* b, std::size_t n) override {
    check("free_segment"), inner_.free_segment(b, n);
  }
  bool free_segment_synchronizes() const noexcept override {
    return inner_.free_segment_synchronizes();
  }
  bool supports_expandable() const noexcept override { return inner_.supports_expandable(); }
  std::size_t map_granularity_bytes() const noexcept override {
    return inner_.map_granularity_bytes();
  }
  void* reserve_address_range(std::size_t n) override {
    return check("reserve_address_range"), inner_.reserve_address_range(n);
  }
  void release_address_range(void* b, std::size_t n) override {
    check("release_address_range"), inner_.release_address_range(b, n);
  }
  bool map(void* p, std::size_t n) override { return check("map"), inner_.map(p, n); }
  void unmap(void* p, std::size_t n) override { check("unmap"), inner_.unmap(p, n); }
  event_handle create_event() override { return check("create_event"), inner_.create_event(); }
  void destroy_event(event_handle e) noexcept override {
    if (in_host_function) note("destroy_event");
    inner_.destroy_event(e);
  }
  void record_event(event_handle e, stream_handle s) override {
    check("record_event"), inner_.record_event(e, s);
  }
  bool query_event(event_handle e) override { return check("query_event"), inner_.query_event(e); }
  void synchronize_event(event_handle e) override {
    check("synchronize_event"), inner_.synchronize_event(e);
  }
  void stream_wait_event(stream_handle s, event_handle e) override {
    check("stream_wait_event"), inner_.stream_wait_event(s, e);
  }
  bool query_stream(stream_handle s) override {
    return check("query_stream"), inner_.query_stream(s);
  }
  void synchronize_device() override { check("synchronize_device"), inner_.synchronize_device(); }
  void memory_info(std::size_t& f, std::size_t& t) override {
    check("memory_info"), inner_.memory_info(f, t);
  }
  bool stream_is_capturing(stream_handle s) noexcept override {
    if (in_host_function) note("stream_is_capturing");
    return inner_.stream_is_capturing(s);
  }
  bool stream_is_per_thread(stream_handle s) const noexcept override {
    return inner_.stream_is_per_thread(s);
  }

 private:
  void note(const char* what) {
    if (calls_.fetch_add(1) == 0) {
      std::lock_guard<std::mutex> lk(mu_);
      first_ = what;
    }
  }
  void check(const char* what) {
    if (!in_host_function) return;
    note(what);
    throw backend_error(
        std::string("callback_backend: ") + what +
        " from a stream callback: cudaErrorNotPermitted (CUDA calls are not allowed in a host "
        "function)");
  }
  device_backend& inner_;
  std::atomic<std::size_t> calls_{0};
  mutable std::mutex mu_;
  std::string first_;
};

struct callback_env {
  sim::simulated_device dev;
  blocking_host_backend host;
  callback_backend backend;
  caching_allocator alloc;
  stream_handle s, t;
  explicit callback_env(options o = {})
      : dev(sim_config(8 * GiB)), host(dev, std::chrono::seconds(5)), backend(host),
        alloc(backend, o), s(dev.create_stream()), t(dev.create_stream()) {}
};

// cudaLaunchHostFunc(s, fn) as described at the top. `meanwhile` runs on the calling thread while
// the callback may run (more work, host waits). Returns what the callback threw (empty: none)
// and whether it returned within 5 s.
struct callback_result {
  bool returned = false;
  std::string error;
};
callback_result launch_host_func(callback_env& env, stream_handle s,
                                 const std::function<void()>& fn,
                                 const std::function<void()>& meanwhile = {}) {
  const auto h = env.dev.hold(s, "host function");
  env.dev.advance(1000);  // S's earlier work completes; S now waits for the callback
  std::atomic<bool> done{false};
  callback_result r;
  std::thread cb([&] {
    in_host_function = true;
    try {
      fn();
    } catch (const std::exception& e) {
      r.error = e.what();
    }
    in_host_function = false;
    env.dev.open(h);
    done = true;
  });
  if (meanwhile) meanwhile();
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!done.load() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  r.returned = done.load();
  if (!r.returned)
    env.dev.open(h);  // cannot free a callback blocked in the allocator; the join says so
  cb.join();
  return r;
}

}  // namespace

TEST_CASE(
    "K16: a host free from a stream callback of a block used only on its stream makes no backend "
    "call",
    "[core][callback][cases][K16]") {
  callback_env env;
  void* p = env.alloc.allocate(8 * MiB, env.s);
  env.dev.launch(env.s, 10, {writes(p, 8 * MiB, 0x16)}, "kernel uses p");
  const auto r = launch_host_func(env, env.s, [&] { env.alloc.deallocate(p); });
  CHECK(r.returned);
  CHECK(r.error.empty());
  INFO(r.error);
  CHECK(env.backend.calls_from_callbacks() == 0);
  env.dev.run_until_idle();
  CHECK(env.alloc.allocate(8 * MiB, env.s) == p);  // reusable after the callback
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}

TEST_CASE(
    "K16: a host free from a stream callback of a block with a recorded use on another stream "
    "makes no "
    "backend call, and the block is reused only behind that use",
    "[core][callback][cases][K16]") {
  callback_env env;
  void* p = env.alloc.allocate(8 * MiB, env.s);
  auto ev = env.dev.create_event();
  env.dev.record_event(ev, env.s);
  env.dev.stream_wait_event(env.t, ev);
  const auto th = env.dev.hold(env.t, "t busy");
  env.dev.launch(env.t, 10, {reads(p, 8 * MiB)}, "read on t");
  env.alloc.record_stream(p, env.t);
  const auto r = launch_host_func(env, env.s, [&] { env.alloc.deallocate(p); });
  CHECK(r.returned);
  CHECK(r.error.empty());
  INFO(r.error << "; first backend call from the callback: " << env.backend.first_call());
  CHECK(env.backend.calls_from_callbacks() == 0);
  // An ordinary thread: p may come back only ordered after t's read.
  void* q = env.alloc.allocate(8 * MiB, env.s);
  env.dev.launch(env.s, 10, {writes(q, 8 * MiB)}, "write on s");
  env.dev.open(th);
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  env.alloc.deallocate(q);
  env.alloc.check_invariants();
}

TEST_CASE(
    "K16: a stream-ordered free on another stream from a stream callback makes no backend call",
    "[core][callback][cases][K16]") {
  callback_env env;
  void* p = env.alloc.allocate(8 * MiB, env.s);
  env.dev.launch(env.s, 10, {writes(p, 8 * MiB)}, "kernel uses p");
  const auto r = launch_host_func(env, env.s, [&] { env.alloc.deallocate(p, env.t); });
  CHECK(r.returned);
  CHECK(r.error.empty());
  INFO(r.error << "; first backend call from the callback: " << env.backend.first_call());
  CHECK(env.backend.calls_from_callbacks() == 0);
  env.dev.run_until_idle();
  env.alloc.reclaim();
  CHECK(env.alloc.stats().allocated_bytes.current == 0);
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}

TEST_CASE("K16: empty_cache from a stream callback returns at once and makes no backend call",
          "[core][callback][cases][K16]") {
  callback_env env;
  env.alloc.deallocate(env.alloc.allocate(64 * MiB, env.s));
  void* p = env.alloc.allocate(8 * MiB, env.s);
  env.dev.launch(env.s, 10, {writes(p, 8 * MiB)}, "kernel uses p");
  const auto r = launch_host_func(env, env.s, [&] {
    // CUDA cannot tell the allocator it runs in a host function: the callback says so.
    streamsafe::callback_scope in_callback;
    env.alloc.deallocate(p);
    env.alloc.empty_cache();  // the fence on s would wait for this very callback
  });
  CHECK(r.returned);
  CHECK(r.error.empty());
  INFO(r.error << "; first backend call from the callback: " << env.backend.first_call());
  CHECK(env.backend.calls_from_callbacks() == 0);
  env.dev.run_until_idle();
  env.alloc.empty_cache();  // from an ordinary thread: everything goes
  CHECK(env.alloc.stats().reserved_bytes.current == 0);
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}

TEST_CASE(
    "K16: an allocation that needs growth from a stream callback fails fast and leaves the "
    "allocator "
    "consistent",
    "[core][callback][cases][K16]") {
  callback_env env;
  void* p = env.alloc.allocate(8 * MiB, env.s);
  const auto start = std::chrono::steady_clock::now();
  const auto r = launch_host_func(env, env.s, [&] { env.alloc.allocate(256 * MiB, env.s); });
  CHECK(r.returned);
  CHECK_FALSE(r.error.empty());  // a clear error, not a hang or a half-made segment
  INFO(r.error);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(2));
  env.dev.run_until_idle();
  env.alloc.deallocate(p);
  void* q = env.alloc.allocate(256 * MiB, env.s);  // from an ordinary thread it works
  CHECK(q != nullptr);
  env.alloc.deallocate(q);
  env.alloc.check_invariants();
}

TEST_CASE(
    "K16: in a callback_scope, an allocation that needs growth throws at once and makes no backend "
    "call",
    "[core][callback][cases][K16]") {
  callback_env env;
  void* p = env.alloc.allocate(8 * MiB, env.s);
  void* small = nullptr;
  const auto r = launch_host_func(env, env.s, [&] {
    streamsafe::callback_scope in_callback;
    small = env.alloc.allocate(2 * MiB, env.s);  // from the cached remainder: no backend call
    env.alloc.allocate(256 * MiB, env.s);
  });
  CHECK(r.returned);
  CHECK_THAT(r.error, Catch::Contains("stream callback"));
  INFO(r.error << "; first backend call from the callback: " << env.backend.first_call());
  CHECK(env.backend.calls_from_callbacks() == 0);
  CHECK_FALSE(streamsafe::callback_scope::active());
  env.dev.run_until_idle();
  if (small) env.alloc.deallocate(small);
  env.alloc.deallocate(p);
  env.alloc.check_invariants();
}

TEST_CASE(
    "K16: a callback frees while another thread waits in empty_cache on the callback's stream: no "
    "deadlock",
    "[core][callback][cases][K16]") {
  callback_env env;
  env.alloc.deallocate(env.alloc.allocate(64 * MiB, env.s));
  void* p = env.alloc.allocate(8 * MiB, env.s);
  std::string waiter_error;
  const auto r = launch_host_func(
      env, env.s,
      [&] {
        env.host.wait_until_blocked(
            std::chrono::milliseconds(2000));  // the other thread waits on s
        env.alloc.deallocate(p);
      },
      [&] {
        try {
          env.alloc.empty_cache();  // wait mode: waits on s's fence, behind the callback, holding
                                    // no lock
        } catch (const std::exception& e) {
          waiter_error = e.what();
        }
      });
  CHECK(r.returned);
  CHECK(r.error.empty());
  CHECK(waiter_error.empty());
  INFO(r.error << " / " << waiter_error);
  CHECK(env.backend.calls_from_callbacks() == 0);
  env.dev.run_until_idle();
  env.alloc.empty_cache();
  CHECK(env.alloc.stats().reserved_bytes.current == 0);
  env.alloc.check_invariants();
}

TEST_CASE("Control: callback_backend fails a backend call made from a stream callback",
          "[core][callback][cases][K16]") {
  callback_env env;
  const auto r = launch_host_func(env, env.s, [&] { env.backend.create_event(); });
  CHECK(r.returned);
  CHECK_THAT(r.error, Catch::Contains("cudaErrorNotPermitted"));
  CHECK(env.backend.calls_from_callbacks() == 1);
}

TEST_CASE(
    "A free with a recorded use, from an ordinary thread whose last allocation was on a third "
    "stream, records "
    "its events at the free (only a thread that never allocated here is treated as a callback)",
    "[core][callback][K16]") {
  // The PyTorch pattern behind this test: x allocated on s, y = f(x) allocated on t (so t is the
  // thread's last stream), x.record_stream(t), del x. The free takes the device-locked path; the
  // thread has allocated from the allocator, so it is not a stream callback and the use's event
  // is recorded now, not at some later slow path.
  sim_env env;
  auto s = env.dev.create_stream();
  auto t = env.dev.create_stream();
  void* x = env.alloc.allocate(1 * MiB, s);
  void* y = env.alloc.allocate(1 * MiB, t);
  env.alloc.record_stream(x, t);
  const auto before = env.alloc.stats().events_recorded;
  env.alloc.deallocate(x);
  CHECK(env.alloc.stats().events_recorded == before + 1);
  // Control: the same free from a thread that never allocated here defers the event.
  void* x2 = env.alloc.allocate(1 * MiB, s);
  env.alloc.record_stream(x2, t);
  const auto before2 = env.alloc.stats().events_recorded;
  std::thread other([&] { env.alloc.deallocate(x2); });
  other.join();
  CHECK(env.alloc.stats().events_recorded == before2);
  env.alloc.reclaim();  // an ordinary call records the deferred event
  CHECK(env.alloc.stats().events_recorded == before2 + 1);
  env.alloc.deallocate(y);
  env.dev.run_until_idle();
  env.alloc.check_invariants();
  CHECK(env.dev.fault_count() == 0);
}
