// The safety property, randomized: thousands of random programs (allocations, host and
// stream-ordered frees, record_stream, work on random streams touching blocks, empty_cache in both
// modes, reclaim, clock advances) run on the simulated device against the real allocator. After
// every step the invariants hold and no two live blocks overlap; at the end, no simulated fault
// occurred under any safe fence scope, while the unsafe allocation_stream scope faults.
//
// Uses on another stream are either recorded (record_stream) or, where the scope promises to
// cover them, unrecorded as FSDP2 does them: the program orders the allocation stream after the
// use before it next allocates there, but nothing orders the release.
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <random>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

struct live_block {
  void* ptr;
  std::size_t size;
  stream_handle stream;
  std::vector<stream_handle> users;
};

struct program_outcome {
  std::size_t faults = 0;
  std::string first_fault;
  std::size_t operations = 0;
};

program_outcome run_program(std::uint64_t seed, backend_kind backend, fence_scope scope,
                            empty_cache_mode mode, bool unrecorded_uses, int steps) {
  std::mt19937_64 rng(seed);
  auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  sim::simulated_device dev(sim_config(2 * GiB));
  options o = make_options(backend, scope, mode);
  o.memory_limit_bytes = 256 * MiB;  // reach the out-of-memory and cross-stream paths
  caching_allocator alloc(dev, o);
  std::vector<stream_handle> streams = {0, dev.create_stream(), dev.create_stream(),
                                        dev.create_stream()};
  // The all_streams scope covers the streams the allocator has seen: each stream allocates once.
  for (stream_handle s : streams) alloc.deallocate(alloc.allocate(512, s));
  std::vector<live_block> live;
  std::map<stream_handle, std::vector<event_handle>> owed;  // user ordering for unrecorded uses
  std::vector<event_handle> events;
  auto new_event = [&] {
    events.push_back(dev.create_event());
    return events.back();
  };
  auto order_after = [&](stream_handle waiter, stream_handle on) {
    if (waiter == on) return;
    event_handle e = new_event();
    dev.record_event(e, on);
    dev.stream_wait_event(waiter, e);
  };
  auto settle = [&](stream_handle s) {
    for (event_handle e : owed[s]) dev.stream_wait_event(s, e);
    owed[s].clear();
  };
  auto overlaps_live = [&](void* p, std::size_t n) {
    for (auto& b : live) {
      if (addr(p) < addr(b.ptr) + b.size && addr(b.ptr) < addr(p) + n) return true;
    }
    return false;
  };
  program_outcome out;
  for (int step = 0; step < steps; ++step) {
    const std::size_t op = pick(100);
    ++out.operations;
    if (op < 30 || live.empty()) {
      const stream_handle s = streams[pick(streams.size())];
      settle(s);
      std::size_t size = pick(10) < 8 ? 1 + pick(3 * MiB) : 10 * MiB + pick(80 * MiB);
      void* p = nullptr;
      try {
        p = alloc.allocate(size, s);
      } catch (const out_of_memory&) {
        continue;
      }
      REQUIRE_FALSE(overlaps_live(p, size));
      dev.launch(s, 1 + pick(300), {writes(p, size)}, "write after allocate");
      live.push_back({p, size, s, {}});
    } else if (op < 50) {
      auto& b = live[pick(live.size())];
      stream_handle t = streams[pick(streams.size())];
      if (t == b.stream) continue;
      order_after(t, b.stream);
      for (stream_handle u : b.users) order_after(t, u);
      dev.launch(t, 1 + pick(3000), {pick(2) ? writes(b.ptr, b.size) : reads(b.ptr, b.size)},
                 "use on another stream");
      if (unrecorded_uses && pick(2)) {
        event_handle e = new_event();
        dev.record_event(e, t);
        owed[b.stream].push_back(e);
        alloc.record_stream(b.ptr, b.stream);  // a no-op record: keeps the stream set equal
      } else {
        alloc.record_stream(b.ptr, t);
      }
      b.users.push_back(t);
    } else if (op < 65) {
      const std::size_t i = pick(live.size());
      alloc.deallocate(live[i].ptr);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (op < 75) {
      const std::size_t i = pick(live.size());
      auto& b = live[i];
      stream_handle t = streams[pick(streams.size())];
      order_after(t, b.stream);
      for (stream_handle u : b.users) order_after(t, u);
      dev.launch(t, 1 + pick(500), {reads(b.ptr, b.size)}, "last use before a stream-ordered free");
      alloc.deallocate(b.ptr, t);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (op < 82) {
      alloc.empty_cache(pick(2) ? empty_cache_mode::wait : empty_cache_mode::defer);
    } else if (op < 88) {
      alloc.reclaim();
    } else {
      dev.advance(pick(2000));
    }
    alloc.check_invariants();
  }
  for (auto& b : live) alloc.deallocate(b.ptr);
  alloc.empty_cache(empty_cache_mode::wait);
  dev.run_until_idle();
  alloc.check_invariants();
  out.faults = dev.fault_count();
  if (out.faults) out.first_fault = dev.faults().front().message;
  for (event_handle e : events) dev.destroy_event(e);
  return out;
}

struct scope_case {
  fence_scope scope;
  bool unrecorded;
};

}  // namespace

TEST_CASE(
    "Random programs never release or reuse memory under pending work with a safe fence scope",
    "[core][property]") {
  const int programs = 250;  // per (scope, backend, mode): 4,000 programs in all
  std::size_t ops = 0;
  for (auto sc : {scope_case{fence_scope::all_streams, true}, scope_case{fence_scope::device, true},
                  scope_case{fence_scope::used_streams, false},
                  scope_case{fence_scope::all_streams, false}}) {
    for (auto backend : {backend_kind::cuda_malloc, backend_kind::expandable}) {
      for (auto mode : {empty_cache_mode::wait, empty_cache_mode::defer}) {
        for (int i = 0; i < programs; ++i) {
          const std::uint64_t seed = 1000003u * static_cast<std::uint64_t>(i) +
                                     7u * static_cast<std::uint64_t>(sc.scope) +
                                     static_cast<std::uint64_t>(backend) * 31u +
                                     static_cast<std::uint64_t>(mode);
          auto out = run_program(seed, backend, sc.scope, mode, sc.unrecorded, 120);
          ops += out.operations;
          INFO("seed " << seed << " scope " << to_string(sc.scope) << " backend "
                       << to_string(backend) << " mode " << to_string(mode) << ": "
                       << out.first_fault);
          REQUIRE(out.faults == 0);
        }
      }
    }
  }
  CHECK(ops >= 400000);
}

TEST_CASE("The same random programs fault under the unsafe allocation_stream scope",
          "[core][property]") {
  std::size_t faulty_programs = 0;
  for (auto backend : {backend_kind::cuda_malloc, backend_kind::expandable}) {
    for (int i = 0; i < 100; ++i) {
      auto out = run_program(77u + static_cast<std::uint64_t>(i), backend,
                             fence_scope::allocation_stream, empty_cache_mode::wait, true, 120);
      if (out.faults) ++faulty_programs;
    }
  }
  INFO(faulty_programs << " of 200 programs faulted");
  CHECK(faulty_programs > 0);
}
