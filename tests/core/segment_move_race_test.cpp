// Segment moves against the fast path: a free cuda_malloc segment moved to another stream's pool
// (the slow path, device lock held) must still be free when it moves. Its owner stream's fast
// path takes only that stream's lock, so between the search that picks the segment and the move
// it may allocate from it; the move must see that and leave the segment alone, or the segment's
// active block ends up owned by the wrong stream (the [threads] stress test failed this way now
// and then: "active block missing from its stream's active map", "double free ... is active").
//
// Two threads allocate and free one 12 MiB block each on their own stream, with room for one
// such segment only, so each allocation either reuses the segment on the fast path or moves it
// from the other stream's pool. Many held segments on a third stream make the search long. The
// two threads must never hold the same address at once.
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <array>
#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;

TEST_CASE(
    "a free segment moved to another stream is not allocated meanwhile by its owner's fast path",
    "[core][threads][segment-move]") {
  constexpr std::size_t k_block = 12 * MiB;  // its own segment, exactly this size
  constexpr int k_held = 256;                // held segments the search walks past
  constexpr int k_rounds = 100000;
  sim::device_config c = sim_config(4 * GiB);
  c.reuse_freed_addresses = true;  // a released segment comes back at the lowest address
  sim::simulated_device dev(c);
  options o = make_options(backend_kind::cuda_malloc, fence_scope::allocation_stream);
  o.memory_limit_bytes = (k_held + 1) * k_block;
  caching_allocator alloc(dev, o);

  const std::array<stream_handle, 2> own{dev.create_stream(), dev.create_stream()};
  const stream_handle other = dev.create_stream();
  alloc.deallocate(alloc.allocate(k_block, own[0]));  // the shared segment, first in address order
  std::vector<void*> held;
  for (int i = 0; i < k_held; ++i) held.push_back(alloc.allocate(k_block, other));

  std::array<std::atomic<void*>, 2> holding{};
  std::mutex error_mu;
  std::string error;
  std::atomic<bool> failed{false};
  auto fail = [&](const std::string& what) {
    std::lock_guard<std::mutex> lk(error_mu);
    if (error.empty()) error = what;
    failed = true;
  };
  std::atomic<int> ready{0};
  auto worker = [&](int id) {
    ready.fetch_add(1);
    while (ready.load() < 2) std::this_thread::yield();  // both run at once
    try {
      for (int i = 0; i < k_rounds && !failed; ++i) {
        void* p = nullptr;
        try {
          p = alloc.allocate(k_block, own[static_cast<std::size_t>(id)]);
        } catch (const out_of_memory&) {
          continue;  // the other thread holds the segment
        }
        holding[static_cast<std::size_t>(id)] = p;
        if (holding[static_cast<std::size_t>(1 - id)] == p)
          fail("both threads hold the block at the same address");
        holding[static_cast<std::size_t>(id)] = nullptr;
        alloc.deallocate(p);
      }
    } catch (const std::exception& e) {
      fail("thread " + std::to_string(id) + ": " + e.what());
    }
  };
  std::thread a(worker, 0), b(worker, 1);
  a.join();
  b.join();
  // Each allocation reuses the segment, moves it, or (when the move finds it taken) fails or
  // regrows after a release: how often each happens depends on the scheduling.
  INFO(alloc.stats().segments_moved << " segment moves");
  CHECK(error.empty());
  if (!error.empty()) FAIL_CHECK(error);
  for (void* p : held) alloc.deallocate(p);
  dev.run_until_idle();
  alloc.check_invariants();
  CHECK(alloc.stats().allocated_bytes.current == 0);
  const auto reserved = static_cast<std::size_t>(alloc.stats().reserved_bytes.current);
  CHECK(alloc.empty_cache() == reserved);
  CHECK(dev.bytes_in_use() == 0);
}
