// Case K8 on the simulated device: one thread drives work on two devices; a collective-like pair
// of kernels waits on each other (a hold on device 0 that only opens once the same thread has
// enqueued the other half on device 1); meanwhile the allocator's out-of-memory path wants to
// release memory. The backend here (support/blocking_host.hpp) blocks the host in
// synchronize_event / synchronize_device exactly as a GPU does, so a host wait on the held stream
// is a real hang; every such scenario runs on its own thread with a bounded join, and a hang
// becomes a failure (the test then opens the hold itself).
//
// Expected: with empty_cache:defer the allocation returns without any host wait (out_of_memory
// naming the bytes behind fences, or success from memory whose fence already completed); with
// empty_cache:wait the host waits on exactly the fenced streams, without holding the allocator's
// lock (another thread allocates, frees and reads statistics meanwhile).
#include "support/blocking_host.hpp"
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <exception>
#include <future>
#include <string>
#include <thread>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

using namespace std::chrono_literals;

// Runs body on its own thread. If it has not returned within `limit` (it is blocked for good, as
// a GPU host wait on an unopened collective would be), calls unstick() so that it can finish,
// then joins. Rethrows what body threw; returns whether it finished in time.
template <class Body, class Unstick>
bool finishes_within(std::chrono::milliseconds limit, Body body, Unstick unstick) {
  std::promise<void> done;
  std::future<void> finished = done.get_future();
  std::exception_ptr error;
  std::thread t([&] {
    try {
      body();
    } catch (...) {
      error = std::current_exception();
    }
    done.set_value();
  });
  const bool in_time = finished.wait_for(limit) == std::future_status::ready;
  if (!in_time) unstick();
  t.join();
  if (error) std::rethrow_exception(error);
  return in_time;
}

// One simulated device seen through the blocking host backend, with its allocator.
struct blocking_device {
  sim::simulated_device dev;
  blocking_host_backend host;
  caching_allocator alloc;
  blocking_device(options o, int device, bool free_segment_synchronizes = false)
      : dev(config(device, free_segment_synchronizes)), host(dev), alloc(host, o) {}
  static sim::device_config config(int device, bool free_segment_synchronizes) {
    sim::device_config c = sim_config(8 * GiB, device);
    c.free_segment_synchronizes = free_segment_synchronizes;  // cudaFree waits for the device
    return c;
  }
};

// Allocates, or notes what was thrown in `error` (Catch2 assertions are not thread-safe).
void* try_allocate(caching_allocator& alloc, std::size_t size, stream_handle stream,
                   std::string& error) {
  try {
    return alloc.allocate(size, stream);
  } catch (const std::exception& e) {
    error = e.what();
    return nullptr;
  }
}

// A read of p on stream `on`, ordered after the work enqueued on `after`, recorded with
// record_stream.
void read_on(blocking_device& d, void* p, std::size_t size, stream_handle after, stream_handle on) {
  const event_handle ev = d.dev.create_event();
  d.dev.record_event(ev, after);
  d.dev.stream_wait_event(on, ev);
  d.dev.launch(on, 10, {reads(p, size)}, "a read on another stream");
  d.alloc.record_stream(p, on);
  d.dev.destroy_event(ev);
}

// One thread: holds stream c (the waiting half of a collective), allocates 70 MiB on stream 0
// (the result or the error goes to got / error), then opens the hold (the other half arrives).
// Returns whether that thread finished in time.
bool allocate_during_collective(blocking_device& d, stream_handle c, void*& got,
                                std::string& error) {
  const std::uint64_t collective = d.dev.hold(c, "collective: waits for another device");
  return finishes_within(
      10s,
      [&] {
        got = try_allocate(d.alloc, 70 * MiB, 0, error);
        d.dev.open(collective);
      },
      [&] { d.dev.open(collective); });
}

options k8_options(backend_kind backend, fence_scope scope, empty_cache_mode mode) {
  options o = make_options(backend, scope, mode);
  o.memory_limit_bytes = 100 * MiB;
  return o;
}

}  // namespace

TEST_CASE(
    "K8: with empty_cache:defer, an allocation that needs the cache released returns out_of_memory "
    "without "
    "waiting on a stream held by a collective",
    "[core][cases][K8]") {
  for (auto backend : {backend_kind::cuda_malloc, backend_kind::expandable}) {
    INFO("backend " << to_string(backend));
    const options o = k8_options(backend, fence_scope::all_streams, empty_cache_mode::defer);
    blocking_device d0(o, 0), d1(o, 1);
    const auto s = d0.dev.create_stream();
    const auto c0 = d0.dev.create_stream();  // device 0's collective stream
    const auto c1 = d1.dev.create_stream();  // device 1's
    void* on_c0 = d0.alloc.allocate(4 * KiB,
                                    c0);  // the collective's stream is one the allocator has seen
    d0.alloc.deallocate(on_c0);
    void* a = d0.alloc.allocate(60 * MiB, s);
    d0.dev.launch(s, 10, {writes(a, 60 * MiB, 0x11)}, "compute");
    d0.alloc.deallocate(a);  // cached on s
    d0.dev.run_until_idle();
    void* peer_buffer = d1.alloc.allocate(8 * MiB, c1);

    // One thread: the waiting half of the collective on device 0, then an allocation on device 0
    // that only fits if the cache is released, then the other half on device 1.
    const std::uint64_t wait_half = d0.dev.hold(c0, "collective on device 0: waits for device 1");
    std::string oom;
    void* got = nullptr;
    const bool in_time = finishes_within(
        10s,
        [&] {
          got = try_allocate(d0.alloc, 70 * MiB, 0, oom);
          d1.dev.launch(c1, 10, {reads(peer_buffer, 8 * MiB)},
                        "collective on device 1: signals device 0");
          d0.dev.open(wait_half);  // device 1's signal arrives
        },
        [&] { d0.dev.open(wait_half); });
    CHECK(in_time);
    CHECK(d0.host.blocking_calls() == 0);
    CHECK(d0.dev.counters().segment_frees + d0.dev.counters().unmaps == 0);
    INFO(oom);
    if (backend == backend_kind::expandable) {
      // The queued chunks are mapped again for stream 0 behind a device-side wait on their
      // fence (reclaim.cpp): no host wait, no new memory beyond the limit, no out_of_memory.
      CHECK(got != nullptr);
      CHECK(d0.alloc.pending_release_bytes() == 0);
      CHECK(d0.alloc.stats().reserved_bytes.peak <= static_cast<std::int64_t>(100 * MiB));
    } else {
      CHECK(got == nullptr);
      CHECK(oom.find("out of memory on device 0") != std::string::npos);
      CHECK(oom.find("62.00 MiB (65011712 bytes) waiting behind release fences") !=
            std::string::npos);
      CHECK(oom.find("reclaim()") != std::string::npos);
      CHECK(oom.find("empty_cache:wait") != std::string::npos);
      CHECK(d0.alloc.pending_release_bytes() == 62 * MiB);
    }

    if (got) d0.alloc.deallocate(got);
    // Once the collective completed, reclaim finishes the queued release and the request fits.
    d0.dev.run_until_idle();
    d1.dev.run_until_idle();
    CHECK(d0.alloc.reclaim() == (backend == backend_kind::expandable ? 0 : 62 * MiB));
    void* p = d0.alloc.allocate(70 * MiB, 0);
    d0.alloc.deallocate(p);
    d1.alloc.deallocate(peer_buffer);
    CHECK(d0.host.blocking_calls() == 0);
    CHECK(d0.dev.fault_count() == 0);
    CHECK(d1.dev.fault_count() == 0);
    d0.alloc.check_invariants();
    d1.alloc.check_invariants();
  }
}

TEST_CASE(
    "K8: with empty_cache:defer, the out-of-memory path releases what is already safe and queues "
    "the rest, "
    "without waiting",
    "[core][cases][K8]") {
  for (auto backend : {backend_kind::cuda_malloc, backend_kind::expandable}) {
    INFO("backend " << to_string(backend));
    blocking_device d(k8_options(backend, fence_scope::used_streams, empty_cache_mode::defer), 0);
    const auto s = d.dev.create_stream();
    const auto t = d.dev.create_stream();
    const auto c = d.dev.create_stream();     // the collective's stream
    void* a = d.alloc.allocate(60 * MiB, s);  // never touched by c: safe to release once s is idle
    void* b = d.alloc.allocate(20 * MiB, t);  // read on c once: its segment's fence covers c
    read_on(d, b, 20 * MiB, t, c);
    d.alloc.deallocate(a);
    d.alloc.deallocate(b);
    d.dev.run_until_idle();
    d.alloc.reclaim();  // b's use on c is over: b is cached on t

    void* got = nullptr;
    std::string error;
    // 80 MiB reserved + 70 > 100: a's 60 MiB must go.
    const bool in_time = allocate_during_collective(d, c, got, error);
    CHECK(in_time);
    INFO(error);
    CHECK(got != nullptr);
    CHECK(d.host.blocking_calls() == 0);
    if (backend == backend_kind::expandable) {
      // a's idle chunks go back to the driver; b's, behind c's fence, are mapped again for the
      // request behind a device-side wait (reclaim.cpp): nothing stays queued.
      CHECK(d.alloc.pending_release_bytes() == 0);
      CHECK(d.alloc.stats().bytes_released == 60 * MiB);
      d.dev.run_until_idle();
      CHECK(d.alloc.reclaim() == 0);
    } else {
      CHECK(d.alloc.pending_release_bytes() == 20 * MiB);  // b's segment waits for c
      CHECK(d.alloc.stats().bytes_released == 60 * MiB);
      d.dev.run_until_idle();
      CHECK(d.alloc.reclaim() == 20 * MiB);
    }
    if (got) d.alloc.deallocate(got);
    CHECK(d.dev.fault_count() == 0);
    d.alloc.check_invariants();
  }
}

TEST_CASE(
    "K8: with empty_cache:wait, the out-of-memory path waits on exactly the fenced streams and "
    "another "
    "thread keeps using the allocator meanwhile",
    "[core][cases][K8]") {
  // cuda_malloc only: the expandable backend serves this request from the cached chunks behind
  // a device-side wait, without any host wait (the test below).
  for (auto backend : {backend_kind::cuda_malloc}) {
    INFO("backend " << to_string(backend));
    blocking_device d(k8_options(backend, fence_scope::used_streams, empty_cache_mode::wait), 0);
    const auto s = d.dev.create_stream();
    const auto c = d.dev.create_stream();  // used the memory once; now runs a collective
    const auto u = d.dev.create_stream();  // never touched the memory; runs another collective
    void* a = d.alloc.allocate(60 * MiB, s);
    read_on(d, a, 60 * MiB, s, c);
    void* live_on_u = d.alloc.allocate(4 * KiB, u);  // keeps u's small segment out of the release
    d.alloc.deallocate(a);
    d.dev.run_until_idle();
    d.alloc.reclaim();  // a is cached on s, its segment used on s and c
    const std::uint64_t on_c = d.dev.hold(c, "collective on c");
    const std::uint64_t on_u = d.dev.hold(u, "collective on u (unrelated to the memory)");

    void* got = nullptr;
    std::string error;
    std::thread allocating([&] {
      got = try_allocate(d.alloc, 70 * MiB, 0,
                         error);  // 62 + 70 > 100: a's segment must go, behind s and c
    });
    const bool blocked = d.host.wait_until_blocked(10s);
    // Meanwhile another thread allocates (slow path, a new stream), frees and reads statistics:
    // none of it may wait for the blocked host wait (the device lock is not held across it).
    bool others_ran = false;
    if (blocked) {
      others_ran = finishes_within(
          10s,
          [&] {
            const auto w = d.dev.create_stream();
            void* x = d.alloc.allocate(8 * KiB, w);
            d.alloc.deallocate(x);
            (void)d.alloc.stats();
            (void)d.alloc.reclaim();
            (void)d.alloc.pending_release_bytes();
          },
          [&] { d.dev.open(on_c); });
    }
    d.dev.open(on_c);  // the collective on c completes; the one on u is still held
    const bool returned = finishes_within(
        10s, [&] { allocating.join(); }, [&] { d.dev.open(on_u); });
    CHECK(blocked);
    CHECK(others_ran);
    CHECK(returned);
    INFO(error);
    CHECK(got != nullptr);
    std::vector<stream_handle> waited = d.host.waited_streams();
    std::sort(waited.begin(), waited.end());
    waited.erase(std::unique(waited.begin(), waited.end()), waited.end());
    std::vector<stream_handle> fenced{s, c};
    std::sort(fenced.begin(), fenced.end());
    CHECK(waited == fenced);  // never u, never the whole device
    CHECK(d.alloc.stats().num_sync_all_streams == 0);
    d.dev.open(on_u);
    d.dev.run_until_idle();
    if (got) d.alloc.deallocate(got);
    d.alloc.deallocate(live_on_u);
    CHECK(d.dev.fault_count() == 0);
    d.alloc.check_invariants();
  }
}

TEST_CASE(
    "K8, expandable, empty_cache:wait: a request at the limit takes cached chunks behind a "
    "device-side wait and never waits on the host for a held collective",
    "[core][expandable][cases][K8]") {
  blocking_device d(
      k8_options(backend_kind::expandable, fence_scope::used_streams, empty_cache_mode::wait), 0);
  const auto s = d.dev.create_stream();
  const auto c = d.dev.create_stream();  // used the memory once; now runs a collective
  void* a = d.alloc.allocate(60 * MiB, s);
  read_on(d, a, 60 * MiB, s, c);
  d.alloc.deallocate(a);
  d.dev.run_until_idle();
  d.alloc.reclaim();  // a is cached on s, its segment used on s and c
  const std::uint64_t on_c = d.dev.hold(c, "collective on c");
  void* got = nullptr;
  std::string error;
  const bool in_time = finishes_within(
      10s,
      [&] {
        got = try_allocate(d.alloc, 70 * MiB, 0, error);  // 60 + 70 > 100
        d.dev.launch(0, 10, {writes(got, 70 * MiB)}, "uses the memory");
        d.dev.open(on_c);
      },
      [&] { d.dev.open(on_c); });
  CHECK(in_time);
  INFO(error);
  CHECK(got != nullptr);
  CHECK(d.host.blocking_calls() == 0);
  CHECK(d.alloc.stats().reserved_bytes.peak <= static_cast<std::int64_t>(100 * MiB));
  d.dev.run_until_idle();
  d.alloc.reclaim();
  if (got) d.alloc.deallocate(got);
  CHECK(d.dev.fault_count() == 0);
  d.alloc.check_invariants();
}

TEST_CASE(
    "K8: with empty_cache:defer and a free_segment that waits for the whole device (cudaFree), no "
    "segment "
    "is freed while a collective runs on a stream the allocator knows",
    "[core][cases][K8]") {
  for (auto scope : {fence_scope::used_streams, fence_scope::all_streams}) {
    INFO("release_fence " << to_string(scope));
    blocking_device d(k8_options(backend_kind::cuda_malloc, scope, empty_cache_mode::defer), 0,
                      true);
    const auto s = d.dev.create_stream();
    const auto c = d.dev.create_stream();  // the collective's stream
    void* on_c = d.alloc.allocate(4 * KiB, c);
    d.alloc.deallocate(on_c);
    void* a = d.alloc.allocate(60 * MiB, s);  // never touched by c
    d.dev.launch(s, 10, {writes(a, 60 * MiB, 0x11)}, "compute");
    d.alloc.deallocate(a);
    if (scope == fence_scope::all_streams) {
      // An earlier empty_cache queued the cache behind s's kernel; that fence completes before
      // the collective starts, so only the device-wide wait of cudaFree could still block.
      CHECK(d.alloc.empty_cache() == 0);
      CHECK(d.alloc.pending_release_bytes() == 62 * MiB);
    }
    d.dev.run_until_idle();

    void* got = nullptr;
    std::string error;
    const bool in_time = allocate_during_collective(d, c, got, error);  // 62 + 70 > 100
    CHECK(in_time);
    CHECK(d.host.blocking_calls() == 0);
    INFO(error);
    CHECK(got == nullptr);
    CHECK(error.find("waiting behind release fences") != std::string::npos);
    CHECK(d.dev.counters().segment_frees == 0);
    if (got) d.alloc.deallocate(got);
    d.dev.run_until_idle();
    CHECK(d.alloc.reclaim() == 62 * MiB);  // every stream idle: the queue drains without waiting
    CHECK(d.host.blocking_calls() == 2);   // the two cudaFree-like calls, on an idle device
    CHECK(d.host.blocked_calls() == 0);
    CHECK(d.dev.fault_count() == 0);
    d.alloc.check_invariants();
  }
}
