// empty_cache() and memory held by blocks still pending their recorded streams' events (a block
// freed after record_stream while the other stream's kernel runs), on the simulated device (both
// backends, both empty_cache modes, release worker on and off):
//  * once the side kernel completes, the memory is back with the driver (wait mode: when
//    empty_cache() returns; defer mode: after reclaim() or the worker);
//  * while the side kernel still runs, nothing is released or reused under it (the simulator
//    reports a race or an access to unmapped memory as a fault).
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <chrono>

using namespace streamsafe;
using namespace streamsafe::test;
using namespace std::chrono_literals;

namespace {

constexpr std::size_t k_bytes = 200 * MiB;  // a whole segment, ten whole expandable chunks

struct scene {
  sim::simulated_device dev{sim_config(4 * GiB)};
  caching_allocator alloc;
  stream_handle main_stream;
  stream_handle side;
  stream_handle other;
  event_handle ev;
  scene(backend_kind backend, empty_cache_mode mode, bool worker,
        fence_scope scope = fence_scope::all_streams)
      : alloc(dev,
              [&] {
                options o = make_options(backend, scope, mode);
                o.release_worker = worker ? release_worker_mode::on : release_worker_mode::off;
                return o;
              }()),
        main_stream(dev.create_stream()), side(dev.create_stream()), other(dev.create_stream()),
        ev(dev.create_event()) {}
  ~scene() { dev.destroy_event(ev); }
  scene(const scene&) = delete;
  scene& operator=(const scene&) = delete;

  // A block of main_stream freed while a kernel of `side` (recorded with record_stream) reads it;
  // the side kernel runs `side_us`, or until the returned hold is opened when side_us is 0.
  std::uint64_t free_while_side_reads(std::uint64_t side_us) {
    void* p = alloc.allocate(k_bytes, main_stream);
    dev.launch(main_stream, 10, {writes(p, k_bytes)}, "produce");
    dev.record_event(ev, main_stream);
    dev.stream_wait_event(side, ev);
    std::uint64_t hold = 0;
    if (side_us == 0) hold = dev.hold(side, "side kernel still running");
    dev.launch(side, side_us == 0 ? 1 : side_us, {reads(p, k_bytes)}, "side kernel");
    alloc.record_stream(p, side);
    alloc.deallocate(p);
    dev.advance(20);  // main_stream's own work is done: only the side use is pending
    return hold;
  }
};

}  // namespace

TEST_CASE("empty_cache gives back memory of blocks pending their recorded streams' events",
          "[core][pending][release]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  const empty_cache_mode mode = GENERATE(empty_cache_mode::wait, empty_cache_mode::defer);
  const bool worker = GENERATE(false, true);
  const fence_scope scope = GENERATE(fence_scope::all_streams, fence_scope::allocation_stream);
  INFO(to_string(backend) << ", " << (mode == empty_cache_mode::wait ? "wait" : "defer")
                          << ", release worker " << (worker ? "on" : "off") << ", fence "
                          << (scope == fence_scope::all_streams ? "all_streams"
                                                                : "allocation_stream"));
  scene s(backend, mode, worker, scope);
  s.free_while_side_reads(5000);
  const std::int64_t before = s.alloc.stats().reserved_bytes.current;
  s.alloc.empty_cache();
  if (mode == empty_cache_mode::defer) {
    s.dev.run_until_idle();  // the side kernel completes
    s.alloc.reclaim();
    if (worker) s.alloc.wait_for_release_worker_idle(5s);
  }
  const std::int64_t after = s.alloc.stats().reserved_bytes.current;
  CHECK(before - after >= static_cast<std::int64_t>(k_bytes));
  CHECK(s.alloc.pending_release_bytes() == 0);
  s.dev.run_until_idle();
  CHECK(s.dev.fault_count() == 0);
  s.alloc.check_invariants();
}

TEST_CASE("empty_cache neither releases nor hands out memory a recorded stream still reads",
          "[core][pending][release]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  const bool worker = GENERATE(false, true);
  // allocation_stream: the release fence itself does not cover the recorded stream.
  const fence_scope scope = GENERATE(fence_scope::all_streams, fence_scope::allocation_stream);
  INFO(to_string(backend) << ", release worker " << (worker ? "on" : "off") << ", fence "
                          << (scope == fence_scope::all_streams ? "all_streams"
                                                                : "allocation_stream"));
  scene s(backend, empty_cache_mode::defer, worker, scope);
  const std::uint64_t hold = s.free_while_side_reads(0);
  s.alloc.empty_cache();
  s.alloc.reclaim();
  if (worker) s.alloc.wait_for_release_worker_idle(50ms);
  // Another stream's request of the same size while the side kernel still reads the block:
  // served (reused behind a wait, or new memory), never under the side kernel.
  void* q = s.alloc.allocate(k_bytes, s.other);
  s.dev.launch(s.other, 10, {writes(q, k_bytes)}, "other stream writes");
  s.alloc.reclaim();
  s.dev.open(hold);
  s.dev.run_until_idle();
  CHECK(s.dev.fault_count() == 0);
  // After the side kernel: the block's memory went back or was reused by the other stream's
  // request, not kept cached beside it.
  s.alloc.deallocate(q);
  s.dev.run_until_idle();
  s.alloc.reclaim();
  if (worker) s.alloc.wait_for_release_worker_idle(5s);
  CHECK(s.alloc.stats().reserved_bytes.current <= static_cast<std::int64_t>(k_bytes + 20 * MiB));
  CHECK(s.dev.fault_count() == 0);
  s.alloc.check_invariants();
}

TEST_CASE("empty_cache in wait mode waits for a recorded stream's kernel, then releases",
          "[core][pending][release]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  const bool worker = GENERATE(false, true);
  INFO(to_string(backend) << ", release worker " << (worker ? "on" : "off"));
  scene s(backend, empty_cache_mode::wait, worker);
  s.free_while_side_reads(100000);  // far longer than anything else: still running at the call
  const std::int64_t before = s.alloc.stats().reserved_bytes.current;
  s.alloc.empty_cache();
  CHECK(before - s.alloc.stats().reserved_bytes.current >= static_cast<std::int64_t>(k_bytes));
  s.dev.run_until_idle();
  CHECK(s.dev.fault_count() == 0);
  s.alloc.check_invariants();
}

TEST_CASE(
    "empty_cache in defer mode: once the pending block retires, reclaim releases its memory and "
    "nothing that was cached after the empty_cache",
    "[core][pending][release]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  const bool worker = GENERATE(false, true);
  INFO(to_string(backend) << ", release worker " << (worker ? "on" : "off"));
  scene s(backend, empty_cache_mode::defer, worker);
  const std::uint64_t hold = s.free_while_side_reads(0);
  s.alloc.empty_cache();  // the block is pending the side kernel: marked, not released
  // Cached after the empty_cache, on another stream: PyTorch's allocator would keep it.
  void* q = s.alloc.allocate(64 * MiB, s.other);
  s.dev.launch(s.other, 10, {writes(q, 64 * MiB)}, "later work");
  s.alloc.deallocate(q);
  s.dev.open(hold);
  s.dev.run_until_idle();
  const std::int64_t before = s.alloc.stats().reserved_bytes.current;
  s.alloc.reclaim();
  if (worker) REQUIRE(s.alloc.wait_for_release_worker_idle(5s));
  const std::int64_t after = s.alloc.stats().reserved_bytes.current;
  CHECK(before - after >= static_cast<std::int64_t>(k_bytes));  // the retired block's memory
  CHECK(after >= static_cast<std::int64_t>(64 * MiB));          // q's stays cached
  void* again = s.alloc.allocate(64 * MiB, s.other);            // and serves the next request
  CHECK(s.alloc.stats().reserved_bytes.current == after);
  s.alloc.deallocate(again);
  s.dev.run_until_idle();
  CHECK(s.dev.fault_count() == 0);
  s.alloc.check_invariants();
}
