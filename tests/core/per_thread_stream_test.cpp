// cudaStreamPerThread passed to the core caching_allocator directly (issue 14 item 6), on the
// simulated device. The handle (2) names a different stream in every host thread; the backend
// marks it (device_backend::stream_is_per_thread). The core must either give it a per-thread
// identity (a block freed by one thread's per-thread stream reaches another thread's only
// behind an ordering) or refuse it with std::invalid_argument naming cudaStreamPerThread. The
// tests accept either fix. per_thread_device models the CUDA meaning of the handle: every call
// that names stream 2 acts on the calling thread's own simulated stream.
#include "support/forwarding_device.hpp"
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <thread>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

constexpr stream_handle k_per_thread = 2;  // cudaStreamPerThread

class per_thread_device final : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  // The calling thread's per-thread stream (created on first use). Threads are told apart by a
  // number of their own: std::thread::id values are reused once a thread has been joined.
  stream_handle own_stream() {
    static std::atomic<int> next_thread{0};
    thread_local const int me = next_thread.fetch_add(1);
    std::lock_guard<std::mutex> lk(mu_);
    auto [it, fresh] = streams_.try_emplace(me, 0);
    if (fresh) it->second = dev_.create_stream();
    return it->second;
  }
  void record_event(event_handle e, stream_handle s) override { dev_.record_event(e, resolve(s)); }
  void stream_wait_event(stream_handle s, event_handle e) override {
    dev_.stream_wait_event(resolve(s), e);
  }
  bool query_stream(stream_handle s) override { return dev_.query_stream(resolve(s)); }
  bool stream_is_capturing(stream_handle s) noexcept override {
    return dev_.stream_is_capturing(resolve(s));
  }
  bool stream_is_per_thread(stream_handle s) const noexcept override { return s == k_per_thread; }

 private:
  stream_handle resolve(stream_handle s) { return s == k_per_thread ? own_stream() : s; }
  std::mutex mu_;
  std::map<int, stream_handle> streams_;
};

struct per_thread_env {
  sim::simulated_device dev{sim_config()};
  per_thread_device backend{dev};
  caching_allocator alloc{backend, options{}};
};

bool names_per_thread(const std::string& what) {
  return what.find("cudaStreamPerThread") != std::string::npos ||
         what.find("per-thread") != std::string::npos;
}

}  // namespace

TEST_CASE(
    "cudaStreamPerThread in the core: a block one thread's per-thread stream still writes is not "
    "handed to "
    "another thread's per-thread stream without an ordering (or the handle is refused)",
    "[per-thread-stream][fixme14]") {
  per_thread_env env;
  void* p = nullptr;
  std::string refused;
  std::uint64_t hold = 0;
  std::thread a([&] {
    const auto mine = env.backend.own_stream();
    try {
      p = env.alloc.allocate(32 * MiB, k_per_thread);
    } catch (const std::invalid_argument& e) {
      refused = e.what();
      return;
    }
    hold = env.dev.hold(mine, "thread A's stream busy");
    env.dev.launch(mine, 10, {writes(p, 32 * MiB, 0xA0)}, "thread A writes p");
    env.alloc.deallocate(p);  // host free: the last use is on A's per-thread stream
  });
  a.join();
  if (!refused.empty()) {
    INFO(refused);
    CHECK(names_per_thread(refused));
    void* q = env.alloc.allocate(4 * KiB, env.dev.create_stream());
    CHECK_THROWS_AS(env.alloc.record_stream(q, k_per_thread), std::invalid_argument);
    CHECK_THROWS_AS(env.alloc.deallocate(q, k_per_thread), std::invalid_argument);
    env.alloc.deallocate(q);
    env.alloc.check_invariants();
    return;
  }
  std::thread b([&] {
    const auto mine = env.backend.own_stream();
    void* q = env.alloc.allocate(32 * MiB, k_per_thread);
    env.dev.launch(mine, 10, {writes(q, 32 * MiB, 0xB0)}, "thread B writes q");
    env.alloc.deallocate(q);
  });
  b.join();
  env.dev.open(hold);
  env.dev.run_until_idle();
  std::string faults;
  for (const auto& f : env.dev.faults()) faults += f.message + "\n";
  INFO(faults);
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}

TEST_CASE(
    "Control: two threads sharing one explicit stream handle while working on different streams "
    "race on the "
    "simulated device",
    "[per-thread-stream]") {
  // What the core does with cudaStreamPerThread today, written out with real handles: both
  // threads' blocks are keyed by one handle, their work runs on two streams.
  sim_env env;
  const auto shared_key = env.dev.create_stream();
  const auto a = env.dev.create_stream();
  const auto b = env.dev.create_stream();
  void* p = env.alloc.allocate(32 * MiB, shared_key);
  const auto h = env.dev.hold(a);
  env.dev.launch(a, 10, {writes(p, 32 * MiB, 0xA0)}, "A writes p");
  env.alloc.deallocate(p);
  void* q = env.alloc.allocate(32 * MiB, shared_key);
  CHECK(q == p);
  env.dev.launch(b, 10, {writes(q, 32 * MiB, 0xB0)}, "B writes q");
  CHECK(env.dev.fault_count() == 1);
  env.dev.open(h);
  env.dev.run_until_idle();
}

TEST_CASE("Control: the same two threads on their own explicit streams do not race",
          "[per-thread-stream]") {
  sim_env env;
  const auto a = env.dev.create_stream();
  const auto b = env.dev.create_stream();
  void* p = env.alloc.allocate(32 * MiB, a);
  const auto h = env.dev.hold(a);
  env.dev.launch(a, 10, {writes(p, 32 * MiB, 0xA0)}, "A writes p");
  env.alloc.deallocate(p);
  void* q = env.alloc.allocate(32 * MiB, b);
  env.dev.launch(b, 10, {writes(q, 32 * MiB, 0xB0)}, "B writes q");
  env.dev.open(h);
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  env.alloc.deallocate(q);
}
