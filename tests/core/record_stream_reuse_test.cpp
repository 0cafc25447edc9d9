// A block freed while a stream named by record_stream still has work on it comes back to its
// stream's next allocation of that size as soon as that work has completed (as PyTorch's
// allocator does: its event query at the start of each allocation), even when another free
// block could serve the request, and never while the work may still touch it.
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

struct side_copy {
  void* block = nullptr;   // freed on the side stream, read last on the main stream
  std::uint64_t hold = 0;  // keeps the main stream's read running until opened
};

// A small block of the side stream, written there, then read on the main stream (after a stream
// wait, named by record_stream) and freed by the host while that read is held open.
side_copy copy_through_side_stream(sim_env& env, stream_handle main, stream_handle side) {
  side_copy c;
  c.block = env.alloc.allocate(16, side);
  env.dev.launch(side, 1, {writes(c.block, 16)});
  const auto e = env.dev.create_event();
  env.dev.record_event(e, side);
  env.dev.stream_wait_event(main, e);
  env.alloc.record_stream(c.block, main);
  c.hold = env.dev.hold(main);
  env.dev.launch(main, 1, {reads(c.block, 16)});
  env.alloc.deallocate(c.block);
  env.dev.destroy_event(e);
  return c;
}

}  // namespace

TEST_CASE(
    "A block freed with a recorded use is reused by its stream's next allocation once that use "
    "has completed, and not before",
    "[core][pending]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  CAPTURE(backend);
  sim_env env(make_options(backend));
  const auto main = env.dev.create_stream();
  const auto side = env.dev.create_stream();
  void* result = env.alloc.allocate(16, main);
  const side_copy c = copy_through_side_stream(env, main, side);

  // The read on the main stream may still run: another block, however many times asked. The
  // first request splits a free block, so it asks whether the pending block is done (one query);
  // the others get the block just freed, exactly their size, and ask nothing.
  const auto queries_before = env.dev.counters().event_queries;
  for (int i = 0; i < 10; ++i) {
    void* early = env.alloc.allocate(16, side);
    CHECK(early != c.block);
    env.dev.launch(side, 1, {writes(early, 16)});
    env.alloc.deallocate(early);
  }
  CHECK(env.dev.counters().event_queries - queries_before == 1);
  void* kept = env.alloc.allocate(16, side);  // held across the reuse below, as a tensor would be
  CHECK(kept != c.block);
  env.dev.launch(side, 1, {writes(kept, 16)});

  env.dev.open(c.hold);
  env.dev.run_until_idle();  // the host synchronizes: the recorded use has completed
  void* again = env.alloc.allocate(16, side);
  CHECK(again == c.block);
  env.dev.launch(side, 1, {writes(again, 16)});

  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  env.alloc.deallocate(again);
  env.alloc.deallocate(kept);
  env.alloc.deallocate(result);
  env.alloc.check_invariants();
}
