// The reference "could serve" (support/could_serve.hpp) on hand-made cases: the new memory a
// growth takes, the bytes a snapshot keeps (segments or granules that hold a live block), the
// free block of the request's own pool, resume, and the device's own view (recording_device)
// of segments, chunks, aliases and unmaps.
#include "support/could_serve.hpp"
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <string>
#include <utility>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

constexpr std::uintptr_t k_base = std::uintptr_t{1} << 40;

block_snapshot blk(std::uintptr_t a, std::size_t n, snapshot_block_state s, stream_handle st = 1) {
  block_snapshot b;
  b.address = a;
  b.size_bytes = n;
  b.state = s;
  b.stream = st;
  return b;
}

// A cudaMalloc segment at `a` tiled by `blocks` (sizes and states in address order).
segment_snapshot seg(std::uintptr_t a, stream_handle st,
                     std::vector<std::pair<std::size_t, snapshot_block_state>> blocks,
                     snapshot_pool pool = snapshot_pool::large) {
  segment_snapshot s;
  s.address = a;
  s.stream = st;
  s.pool = pool;
  std::uintptr_t at = a;
  for (const auto& [n, state] : blocks) {
    s.blocks.push_back(blk(at, n, state, st));
    at += n;
    s.size_bytes += n;
  }
  s.mapped_bytes = s.size_bytes;
  return s;
}

oracle_request req(std::size_t n, stream_handle s = 1, std::string tag = {}) {
  oracle_request r;
  r.size_bytes = n;
  r.stream = s;
  r.tag = std::move(tag);
  return r;
}

using st = snapshot_block_state;

}  // namespace

TEST_CASE("the oracle rounds a request as a new segment or a new mapping would take it",
          "[core][oracle]") {
  const auto cm = backend_kind::cuda_malloc;
  const auto ex = backend_kind::expandable;
  CHECK(oracle_rounded(1) == 512);
  CHECK(oracle_rounded(513) == 1024);
  CHECK(oracle_new_bytes(cm, 1) == 2 * MiB);
  CHECK(oracle_new_bytes(cm, MiB) == 2 * MiB);
  CHECK(oracle_new_bytes(cm, MiB + 1) == 20 * MiB);
  CHECK(oracle_new_bytes(cm, 10 * MiB - 512) == 20 * MiB);
  CHECK(oracle_new_bytes(cm, 10 * MiB) == 10 * MiB);
  CHECK(oracle_new_bytes(cm, 11 * MiB + 1) == 12 * MiB);
  CHECK(oracle_new_bytes(ex, 1) == 2 * MiB);
  CHECK(oracle_new_bytes(ex, 3 * MiB) == 4 * MiB);
  CHECK(oracle_new_bytes(ex, 64 * MiB) == 64 * MiB);
  CHECK(oracle_is_small(MiB));
  CHECK_FALSE(oracle_is_small(MiB + 1));
}

TEST_CASE("cuda_malloc: only segments holding a live block are kept; the rest can go back",
          "[core][oracle]") {
  memory_snapshot s;
  // A live 1 MiB block in a 64 MiB segment; a cached, a pending and a queued 64 MiB segment.
  s.segments.push_back(seg(k_base, 1, {{MiB, st::active}, {63 * MiB, st::inactive}}));
  s.segments.push_back(seg(k_base + GiB, 2, {{64 * MiB, st::inactive}}));
  s.segments.push_back(seg(k_base + 2 * GiB, 3, {{64 * MiB, st::pending_free}}));
  s.segments.push_back(seg(k_base + 3 * GiB, 2, {{64 * MiB, st::releasing}}));
  CHECK(oracle_kept_bytes(s) == 64 * MiB);
  const auto cm = backend_kind::cuda_malloc;
  // 64 kept + 192 new = 256: fits exactly.
  CHECK(oracle_from_snapshot(s, cm, 256 * MiB, req(192 * MiB, 4)).could_serve);
  const oracle_verdict no = oracle_from_snapshot(s, cm, 256 * MiB, req(192 * MiB + 1, 4));
  CHECK_FALSE(no.could_serve);
  CHECK(no.kept_bytes == 64 * MiB);
  CHECK(no.new_bytes == 194 * MiB);
  // Stream 4 has no segment: only a growth serves it.
  // A 2 MiB request fits 64 + 20 (its new segment) in a limit of 84 MiB, not 83.
  CHECK(oracle_from_snapshot(s, cm, 84 * MiB, req(2 * MiB, 4)).could_serve);
  CHECK_FALSE(oracle_from_snapshot(s, cm, 83 * MiB, req(2 * MiB, 4)).could_serve);
  CHECK_FALSE(oracle_from_snapshot(s, cm, 256 * MiB, req(0, 4)).could_serve);
}

TEST_CASE("a free block of the request's own pool serves it, cached or pending other streams",
          "[core][oracle]") {
  const auto cm = backend_kind::cuda_malloc;
  for (const st state : {st::inactive, st::pending_free}) {
    INFO("state " << to_string(state));
    memory_snapshot s;
    s.segments.push_back(seg(k_base, 1, {{16 * MiB, st::active}, {48 * MiB, state}}));
    // Limit 64 MiB: no growth fits beside the kept segment.
    const oracle_verdict own = oracle_from_snapshot(s, cm, 64 * MiB, req(40 * MiB, 1));
    CHECK(own.could_serve);
    CHECK(own.fits_free_block);
    CHECK_FALSE(own.fits_growth());
    CHECK(own.fitting_block_bytes == 48 * MiB);
    CHECK_FALSE(oracle_from_snapshot(s, cm, 64 * MiB, req(49 * MiB, 1)).could_serve);
    // Another stream, another tag, the small pool: not its pool.
    CHECK_FALSE(oracle_from_snapshot(s, cm, 64 * MiB, req(40 * MiB, 2)).could_serve);
    CHECK_FALSE(oracle_from_snapshot(s, cm, 64 * MiB, req(40 * MiB, 1, "weights")).could_serve);
    CHECK_FALSE(oracle_from_snapshot(s, cm, 64 * MiB, req(512 * KiB, 1)).could_serve);
    oracle_request split = req(17 * MiB, 1);
    split.max_split_size_bytes = 20 * MiB;  // a 48 MiB block is kept whole for sizes near it
    CHECK_FALSE(oracle_from_snapshot(s, cm, 64 * MiB, split).could_serve);
  }
  memory_snapshot releasing;
  releasing.segments.push_back(seg(k_base, 1, {{16 * MiB, st::active}, {48 * MiB, st::releasing}}));
  CHECK_FALSE(oracle_from_snapshot(releasing, cm, 64 * MiB, req(40 * MiB, 1)).fits_free_block);
}

TEST_CASE("expandable: live blocks keep the 2 MiB granules they touch, paused chunks nothing",
          "[core][oracle][expandable][sleep]") {
  memory_snapshot s;
  segment_snapshot r;  // a 1 GiB range with 40 MiB mapped
  r.address = k_base;
  r.size_bytes = GiB;
  r.mapped_bytes = 40 * MiB;
  r.expandable = true;
  r.stream = 1;
  r.blocks.push_back(blk(k_base, KiB, st::active));                          // granule 0
  r.blocks.push_back(blk(k_base + KiB, 4 * MiB - 3 * KiB, st::inactive));    // granules 0, 1
  r.blocks.push_back(blk(k_base + 4 * MiB - 2 * KiB, 4 * KiB, st::active));  // granules 1 and 2
  r.blocks.push_back(blk(k_base + 4 * MiB + 2 * KiB, 36 * MiB - 2 * KiB, st::pending_free));
  r.blocks.push_back(blk(k_base + 40 * MiB, GiB - 40 * MiB, st::unmapped));
  s.segments.push_back(r);
  CHECK(oracle_kept_bytes(s) == 6 * MiB);
  const auto ex = backend_kind::expandable;
  CHECK(oracle_from_snapshot(s, ex, 64 * MiB, req(58 * MiB, 2)).could_serve);
  CHECK_FALSE(oracle_from_snapshot(s, ex, 64 * MiB, req(58 * MiB + 1, 2)).could_serve);
  // Its own stream: the 36 MiB pending block serves a 30 MiB request in place.
  CHECK(oracle_from_snapshot(s, ex, 32 * MiB, req(30 * MiB, 1)).could_serve);

  // Paused: its chunks went back (mapped 0), its live blocks keep nothing; resume needs them.
  memory_snapshot p = s;
  p.segments[0].tag = "kv";
  p.segments[0].mapped_bytes = 0;
  p.segments[0].paused_bytes = 40 * MiB;
  CHECK(oracle_kept_bytes(p) == 0);
  CHECK(oracle_resume_from_snapshot(p, 40 * MiB, "kv").could_serve);
  CHECK_FALSE(oracle_resume_from_snapshot(p, 40 * MiB - 1, "kv").could_serve);
  CHECK(oracle_resume_from_snapshot(p, 0, "other").could_serve);
}

TEST_CASE("the device's view keeps the whole segments and chunks a live range touches",
          "[core][oracle][expandable]") {
  sim::simulated_device dev(sim_config());
  recording_device rec(dev);
  // Two segments; a live range in the first.
  void* a = rec.allocate_segment(20 * MiB);
  void* b = rec.allocate_segment(2 * MiB);
  REQUIRE(a != nullptr);
  REQUIRE(b != nullptr);
  CHECK(rec.bytes() == 22 * MiB);
  CHECK(rec.kept_bytes({{addr(a) + MiB, 512}}) == 20 * MiB);
  CHECK(rec.kept_bytes({{addr(a), 512}, {addr(a) + 512, 512}}) == 20 * MiB);
  CHECK(rec.kept_bytes({}) == 0);
  rec.free_segment(a, 20 * MiB);
  CHECK(rec.bytes() == 2 * MiB);
  CHECK(rec.peak_bytes() == 22 * MiB);
  CHECK(rec.kept_bytes({{addr(a) + MiB, 512}}) == 0);
  rec.free_segment(b, 2 * MiB);

  // Chunks: a 20 MiB chunk and a 2 MiB chunk in one range; a range touching both keeps 22 MiB.
  void* r = rec.reserve_address_range(GiB);
  const std::uintptr_t base = addr(r);
  REQUIRE(rec.map(r, 20 * MiB));
  REQUIRE(rec.map(reinterpret_cast<void*>(base + 20 * MiB), 2 * MiB));
  CHECK(rec.kept_bytes({{base + 19 * MiB, 2 * MiB}}) == 22 * MiB);
  CHECK(rec.kept_bytes({{base + 21 * MiB, 512}}) == 2 * MiB);
  // An alias of the 20 MiB chunk at a second address is the same memory: counted once.
  void* r2 = rec.reserve_address_range(GiB);
  REQUIRE(rec.map_alias(r2, r, 20 * MiB));
  CHECK(rec.bytes() == 22 * MiB);
  CHECK(dev.bytes_in_use() == 22 * MiB);
  CHECK(rec.kept_bytes({{addr(r2), 512}, {base, 512}}) == 20 * MiB);
  // The old address goes; the alias keeps the memory until it goes too.
  rec.unmap(r, 20 * MiB);
  CHECK(rec.bytes() == 22 * MiB);
  CHECK(rec.kept_bytes({{addr(r2), 512}}) == 20 * MiB);
  CHECK(rec.kept_bytes({{base, 512}}) == 0);
  rec.unmap(r2, 20 * MiB);
  rec.unmap(reinterpret_cast<void*>(base + 20 * MiB), 2 * MiB);
  CHECK(rec.bytes() == 0);
  CHECK(dev.bytes_in_use() == 0);
  const oracle_verdict v = rec.verdict({}, backend_kind::expandable, 64 * MiB, 64 * MiB);
  CHECK(v.could_serve);
  rec.release_address_range(r, GiB);
  rec.release_address_range(r2, GiB);
}
