// Reserved bytes by pool kind (small_pool, large_pool) follow the segments that hold the memory,
// on the simulated device: memory queued for release in one kind's pool and reclaimed by a pool
// of the other kind (expandable: mapped again at the new pool's address, reclaim.cpp) counts in
// the kind where it is mapped now, and every byte goes back in the kind it counts in, whether
// the new address goes first (a release, a pause) or the old one.
#include "support/sim_fixture.hpp"
#include "support/tagged_blocks.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <string>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

std::string name_of(backend_kind b) {
  return b == backend_kind::expandable ? "expandable" : "cuda_malloc";
}

// Each kind's reserved bytes: not negative, at least its allocated bytes (unless a paused tag's
// blocks hold no memory), adding up to every pool's; and the invariant check (each kind's reserved
// bytes and segments against the segments).
void check_kinds(sim_env& env, const char* step, bool paused = false) {
  INFO(step);
  const statistics s = env.alloc.stats();
  const std::int64_t small = s.small_pool.reserved_bytes.current;
  const std::int64_t large = s.large_pool.reserved_bytes.current;
  INFO("reserved: all " << s.reserved_bytes.current << ", small " << small << ", large " << large
                        << "; allocated: small " << s.small_pool.allocated_bytes.current
                        << ", large " << s.large_pool.allocated_bytes.current);
  CHECK(small >= (paused ? 0 : s.small_pool.allocated_bytes.current));
  CHECK(large >= (paused ? 0 : s.large_pool.allocated_bytes.current));
  CHECK(small + large == s.reserved_bytes.current);
  CHECK(s.small_pool.reserved_bytes.allocated + s.large_pool.reserved_bytes.allocated ==
        s.reserved_bytes.allocated);
  CHECK(s.small_pool.reserved_bytes.freed + s.large_pool.reserved_bytes.freed ==
        s.reserved_bytes.freed);
  CHECK(s.small_pool.reserved_bytes.peak >= small);
  CHECK(s.large_pool.reserved_bytes.peak >= large);
  CHECK_NOTHROW(env.alloc.check_invariants());
}

// The small and large pools' reserved bytes now.
void check_reserved(sim_env& env, std::size_t small, std::size_t large) {
  const statistics s = env.alloc.stats();
  CHECK(s.small_pool.reserved_bytes.current == static_cast<std::int64_t>(small));
  CHECK(s.large_pool.reserved_bytes.current == static_cast<std::int64_t>(large));
}

}  // namespace

TEST_CASE(
    "Reserved bytes by pool kind follow queued memory that a pool of the other kind reclaims: "
    "small to large to small, each kind back to zero",
    "[core][statistics][release][expandable]") {
  for (const backend_kind backend : {backend_kind::cuda_malloc, backend_kind::expandable}) {
    INFO(name_of(backend));
    const bool expandable = backend == backend_kind::expandable;
    sim_env env(make_options(backend, fence_scope::all_streams, empty_cache_mode::defer));
    const stream_handle t = env.dev.create_stream();
    const stream_handle s = env.dev.create_stream();  // the side stream
    const stream_handle u = env.dev.create_stream();

    // A small block on t, freed while t is held: empty_cache queues its memory, still reserved.
    void* a = env.alloc.allocate(512 * KiB, t);
    env.dev.launch(t, 10, {writes(a, 512 * KiB, 0x11)}, "use a");
    const std::uint64_t hold_t = env.dev.hold(t);
    env.alloc.deallocate(a);
    env.alloc.empty_cache();
    CHECK(env.alloc.pending_release_bytes() == 2 * MiB);
    check_kinds(env, "a small chunk queued");

    // 1 MiB + 512 bytes on the side stream: a large block. Expandable: the queued small chunk is
    // mapped again into the large pool's range (no new memory), so its 2 MiB are the large
    // pool's now. cuda_malloc: a whole segment moves only to a pool of its kind; a new one.
    void* b = env.alloc.allocate(MiB + 512, s);
    if (expandable) {
      CHECK(env.dev.counters().aliases == 1);
      check_reserved(env, 0, 2 * MiB);
    }
    check_kinds(env, "1 MiB + 512 bytes on the side stream");
    env.dev.open(hold_t);
    env.dev.run_until_idle();

    // b freed while its kernel runs: queued. Its kernel ends; nothing releases the queue yet.
    env.dev.launch(s, 10, {writes(b, MiB + 512, 0x22)}, "use b");
    env.alloc.deallocate(b);
    env.alloc.empty_cache();
    check_kinds(env, "the large block queued");
    env.dev.run_until_idle();

    // A small block on u reclaims the large pool's queued memory (expandable: mapped a third
    // time, the large address still queued); freed on an idle stream, it goes back at once,
    // before the large address's queued unmap, which then gives the memory back.
    void* c = env.alloc.allocate(512 * KiB, u);
    if (expandable) {
      CHECK(env.dev.counters().aliases == 2);
      check_reserved(env, 2 * MiB, 0);
    }
    check_kinds(env, "a small block on u");
    env.alloc.deallocate(c);
    env.alloc.empty_cache();
    check_kinds(env, "the small block on u released");

    env.dev.run_until_idle();
    env.alloc.reclaim();
    env.alloc.empty_cache();
    CHECK(env.alloc.pending_release_bytes() == 0);
    check_kinds(env, "all released");
    check_reserved(env, 0, 0);
    CHECK(env.dev.fault_count() == 0);
  }
}

TEST_CASE(
    "Reserved bytes by pool kind: a pause that unmaps memory the other kind's queued address "
    "still maps leaves that memory in the queued address's kind",
    "[core][statistics][sleep][expandable]") {
  sim_env env(sleep_options(fence_scope::all_streams, empty_cache_mode::defer));
  const stream_handle s = env.dev.create_stream();
  const stream_handle u = env.dev.create_stream();

  // A large block's memory queued for release, its fence complete, the queue not passed yet.
  void* b = env.alloc.allocate(MiB + 512, s);
  env.dev.launch(s, 10, {writes(b, MiB + 512, 0x22)}, "use b");
  env.alloc.deallocate(b);
  env.alloc.empty_cache();
  env.dev.run_until_idle();
  check_reserved(env, 0, 2 * MiB);

  // A tagged small block on u reclaims it (mapped again, its large address still queued).
  void* c = nullptr;
  {
    tag_scope kv("kinds.kv");
    c = env.alloc.allocate(512 * KiB, u);
  }
  CHECK(env.dev.counters().aliases == 1);
  check_reserved(env, 2 * MiB, 0);
  check_kinds(env, "a tagged small block on u");

  // The pause unmaps the small address first: the memory is the queued large address's again,
  // and goes back in the large kind when that address is unmapped.
  env.alloc.pause("kinds.kv", pause_mode::discard, empty_cache_mode::wait);
  check_kinds(env, "paused", true);
  check_reserved(env, 0, 2 * MiB);
  env.alloc.reclaim();
  check_kinds(env, "the queue passed", true);
  check_reserved(env, 0, 0);

  env.alloc.resume("kinds.kv");  // new memory at c's address: small
  check_reserved(env, 2 * MiB, 0);
  check_kinds(env, "resumed");
  env.alloc.deallocate(c);
  env.alloc.empty_cache("kinds.kv");
  env.dev.run_until_idle();
  env.alloc.reclaim();
  check_kinds(env, "all released");
  check_reserved(env, 0, 0);
  CHECK(env.dev.fault_count() == 0);
}
