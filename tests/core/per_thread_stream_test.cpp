// cudaStreamPerThread passed to the core caching_allocator directly, on the
// simulated device. The handle (2) names a different stream in every host thread; the backend
// marks it (device_backend::stream_is_per_thread). The core must either give it a per-thread
// identity (a block freed by one thread's per-thread stream reaches another thread's only
// behind an ordering) or refuse it with std::invalid_argument naming cudaStreamPerThread. The
// tests accept either fix. per_thread_device models the CUDA meaning of the handle: every call
// that names stream 2 acts on the calling thread's own simulated stream.
#include "support/per_thread_device.hpp"
#include "support/sim_faults.hpp"
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <string>
#include <thread>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

bool names_per_thread(const std::string& what) {
  return what.find("cudaStreamPerThread") != std::string::npos ||
         what.find("per-thread") != std::string::npos;
}

}  // namespace

TEST_CASE(
    "cudaStreamPerThread in the core: a block one thread's per-thread stream still writes is not "
    "handed to "
    "another thread's per-thread stream without an ordering (or the handle is refused)",
    "[core][per-thread-stream]") {
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
    "[core][per-thread-stream]") {
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
          "[core][per-thread-stream]") {
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

// ---- cudaStreamPerThread in the core: each thread's per-thread stream is its own stream -------

TEST_CASE(
    "cudaStreamPerThread in the core: a use recorded from another thread is that thread's "
    "per-thread stream, and a host free from the allocating thread fences it",
    "[core][per-thread-stream]") {
  // A allocates on its per-thread stream; B reads the block on B's per-thread stream and says
  // so (record_stream(p, cudaStreamPerThread) on B); A frees it. A's next allocation must not
  // write it before B's read: the use names B's stream, which only B can name to the driver,
  // so A's free records its event on the legacy stream (ordered after every per-thread stream).
  per_thread_env env;
  std::uint64_t hold = 0;
  std::thread a([&] {
    const auto mine = env.backend.own_stream();
    void* mine_p = env.alloc.allocate(32 * MiB, k_per_thread);
    std::thread b([&] {
      const auto theirs = env.backend.own_stream();
      hold = env.dev.hold(theirs, "B's stream busy");
      env.dev.launch(theirs, 10, {reads(mine_p, 32 * MiB)}, "B reads A's block");
      env.alloc.record_stream(mine_p, k_per_thread);  // B's per-thread stream
    });
    b.join();
    env.alloc.deallocate(mine_p);  // host free on A: the event for B's use goes on stream 0
    void* again = env.alloc.allocate(32 * MiB, k_per_thread);
    env.dev.launch(mine, 10, {writes(again, 32 * MiB, 0xA1)}, "A writes its next block");
    env.alloc.deallocate(again);
  });
  a.join();
  check_no_fault_around(env.dev, hold);
  env.alloc.check_invariants();
}

TEST_CASE(
    "cudaStreamPerThread in the core: a stream-ordered free on another thread's per-thread "
    "stream orders the allocating thread's reuse after it",
    "[core][per-thread-stream]") {
  per_thread_env env;
  std::uint64_t hold = 0;
  std::thread a([&] {
    const auto mine = env.backend.own_stream();
    void* p = env.alloc.allocate(32 * MiB, k_per_thread);
    std::thread b([&] {
      const auto theirs = env.backend.own_stream();
      hold = env.dev.hold(theirs, "B's stream busy");
      env.dev.launch(theirs, 10, {writes(p, 32 * MiB, 0xB0)}, "B writes A's block");
      env.alloc.deallocate(p, k_per_thread);  // the last use is on B's per-thread stream
    });
    b.join();
    void* q = env.alloc.allocate(32 * MiB, k_per_thread);
    env.dev.launch(mine, 10, {writes(q, 32 * MiB, 0xA0)}, "A writes its next block");
    env.alloc.deallocate(q);
  });
  a.join();
  check_no_fault_around(env.dev, hold);
  env.alloc.check_invariants();
}

TEST_CASE(
    "cudaStreamPerThread in the core: a host free from another thread returns the block to "
    "the allocating thread's per-thread stream only",
    "[core][per-thread-stream]") {
  per_thread_env env;
  void* p = nullptr;
  std::uint64_t hold = 0;
  std::thread a([&] {
    const auto mine = env.backend.own_stream();
    p = env.alloc.allocate(32 * MiB, k_per_thread);
    hold = env.dev.hold(mine, "A's stream busy");
    env.dev.launch(mine, 10, {writes(p, 32 * MiB, 0xA0)}, "A writes p");
  });
  a.join();
  void* q = nullptr;
  std::thread b([&] {
    const auto mine = env.backend.own_stream();
    env.alloc.deallocate(p);  // B frees A's block: the last use is on A's stream
    q = env.alloc.allocate(32 * MiB, k_per_thread);
    env.dev.launch(mine, 10, {writes(q, 32 * MiB, 0xB0)}, "B writes q");
  });
  b.join();
  // p's segment is A's: B gets it only as a whole segment moved behind an event wait (a growth
  // past the peak takes another stream's free segment first), never straight from A's pool.
  CHECK((q != p || env.alloc.stats().segments_moved > 0));
  check_no_fault_around(env.dev, hold);
  env.alloc.deallocate(q);
  env.alloc.check_invariants();
}

TEST_CASE(
    "cudaStreamPerThread in the core: empty_cache on another thread fences every thread's "
    "per-thread stream",
    "[core][per-thread-stream]") {
  sim::simulated_device dev{sim_config()};
  per_thread_device backend{dev};
  caching_allocator alloc{backend, make_options(backend_kind::cuda_malloc, fence_scope::all_streams,
                                                empty_cache_mode::defer)};
  std::uint64_t hold = 0;
  std::thread a([&] {
    const auto mine = backend.own_stream();
    void* p = alloc.allocate(32 * MiB, k_per_thread);
    hold = dev.hold(mine, "A's stream busy");
    dev.launch(mine, 10, {writes(p, 32 * MiB, 0xA0)}, "A writes p");
    alloc.deallocate(p);
  });
  a.join();
  const auto legacy_before = backend.legacy_actions();
  CHECK(alloc.empty_cache() == 0);                  // A's write is pending: nothing goes back yet
  CHECK(backend.legacy_actions() > legacy_before);  // fenced through the legacy stream
  INFO(fault_text(dev));
  CHECK(dev.fault_count() == 0);
  CHECK(alloc.stats().reserved_bytes.current == 32 * MiB);
  dev.open(hold);
  dev.run_until_idle();
  alloc.reclaim();
  CHECK(alloc.stats().reserved_bytes.current == 0);
  CHECK(dev.fault_count() == 0);
  alloc.check_invariants();
}

TEST_CASE(
    "cudaStreamPerThread in the core: a segment moved from one thread's per-thread stream to "
    "another's is ordered after the first",
    "[core][per-thread-stream]") {
  // A 48 MiB device: B's 32 MiB request fits only in A's free segment, which moves to B's pool
  // behind a fence on A's stream (recorded on the legacy stream: B cannot name A's stream).
  sim::simulated_device dev{sim_config(48 * MiB)};
  per_thread_device backend{dev};
  caching_allocator alloc{backend, options{}};
  std::uint64_t hold = 0;
  std::thread a([&] {
    const auto mine = backend.own_stream();
    void* p = alloc.allocate(32 * MiB, k_per_thread);
    hold = dev.hold(mine, "A's stream busy");
    dev.launch(mine, 10, {writes(p, 32 * MiB, 0xA0)}, "A writes p");
    alloc.deallocate(p);
  });
  a.join();
  void* q = nullptr;
  std::thread b([&] {
    const auto mine = backend.own_stream();
    q = alloc.allocate(32 * MiB, k_per_thread);
    dev.launch(mine, 10, {writes(q, 32 * MiB, 0xB0)}, "B writes q");
  });
  b.join();
  check_no_fault_around(dev, hold);
  std::thread([&] { alloc.deallocate(q); }).join();
  alloc.check_invariants();
}
