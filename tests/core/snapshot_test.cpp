// Memory snapshots (segments and blocks, JSON) and memory_summary(), on hand-built snapshots
// and statistics.
#include "support/json_check.hpp"

#include <streamsafe/core/snapshot.hpp>

#include <catch2/catch.hpp>

#include <sstream>
#include <stdexcept>

using namespace streamsafe;

namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;

block_snapshot blk(std::uintptr_t addr, std::size_t size, snapshot_block_state state,
                   std::size_t requested = 0, stream_handle stream = 0,
                   std::vector<stream_handle> waiting = {}) {
  block_snapshot b;
  b.address = addr;
  b.size_bytes = size;
  b.requested_bytes = requested;
  b.state = state;
  b.stream = stream;
  b.waiting_on = std::move(waiting);
  return b;
}

// A 2 MiB small segment on stream 0: active 4 KiB, pending 8 KiB waiting on stream 7, inactive
// rest; and an expandable large segment on stream 7: 20 MiB mapped (active 12 MiB, inactive 8 MiB),
// 44 MiB unmapped.
memory_snapshot sample() {
  memory_snapshot snap;
  snap.device = 1;
  snap.time_us = 1234;
  segment_snapshot small;
  small.address = 0x100000000;
  small.size_bytes = small.mapped_bytes = 2 * MiB;
  small.pool = snapshot_pool::small;
  small.blocks = {blk(0x100000000, 4 * KiB, snapshot_block_state::active, 4000),
                  blk(0x100001000, 8 * KiB, snapshot_block_state::pending_free, 8000, 0, {7}),
                  blk(0x100003000, 2 * MiB - 12 * KiB, snapshot_block_state::inactive)};
  segment_snapshot big;
  big.address = 0x200000000;
  big.size_bytes = 64 * MiB;
  big.mapped_bytes = 20 * MiB;
  big.stream = 7;
  big.expandable = true;
  big.blocks = {blk(0x200000000, 12 * MiB, snapshot_block_state::active, 12 * MiB - 100, 7),
                blk(0x200000000 + 12 * MiB, 8 * MiB, snapshot_block_state::inactive, 0, 7),
                blk(0x200000000 + 20 * MiB, 44 * MiB, snapshot_block_state::unmapped, 0, 7)};
  snap.segments = {small, big};
  snap.stats.allocated_bytes.increase(static_cast<std::int64_t>(4 * KiB + 12 * MiB));
  snap.stats.reserved_bytes.increase(static_cast<std::int64_t>(22 * MiB));
  return snap;
}

}  // namespace

TEST_CASE("A consistent snapshot passes its checks and sums bytes per state", "[core][snapshot]") {
  memory_snapshot snap = sample();
  REQUIRE_NOTHROW(snap.check_consistency());
  CHECK(snap.segments[0].bytes_in(snapshot_block_state::active) == 4 * KiB);
  CHECK(snap.segments[0].bytes_in(snapshot_block_state::pending_free) == 8 * KiB);
  CHECK(snap.segments[1].bytes_in(snapshot_block_state::unmapped) == 44 * MiB);
  CHECK(std::string(to_string(snapshot_block_state::pending_free)) == "pending_free");
  CHECK(std::string(to_string(snapshot_pool::small)) == "small");
}

TEST_CASE("Snapshot checks name the segment whose blocks do not tile it", "[core][snapshot]") {
  memory_snapshot snap = sample();
  snap.segments[0].blocks[1].address += 512;
  CHECK_THROWS_WITH(snap.check_consistency(),
                    Catch::Contains("segment 0x100000000") && Catch::Contains("tile"));

  snap = sample();
  snap.segments[0].blocks.pop_back();
  CHECK_THROWS_WITH(snap.check_consistency(), Catch::Contains("cover"));

  snap = sample();
  snap.segments[1].mapped_bytes = 22 * MiB;
  CHECK_THROWS_WITH(snap.check_consistency(), Catch::Contains("mapped_bytes"));

  snap = sample();
  snap.segments[0].blocks[2].state = snapshot_block_state::unmapped;
  snap.segments[0].mapped_bytes = 12 * KiB;
  CHECK_THROWS_WITH(snap.check_consistency(), Catch::Contains("not expandable"));

  snap = sample();
  snap.segments[0].blocks[0].waiting_on = {3};
  CHECK_THROWS_WITH(snap.check_consistency(), Catch::Contains("waits on streams"));

  snap = sample();
  std::swap(snap.segments[0], snap.segments[1]);
  CHECK_THROWS_WITH(snap.check_consistency(), Catch::Contains("precedes"));
}

TEST_CASE("Snapshot JSON is valid and uses PyTorch's segment and block keys", "[core][snapshot]") {
  std::ostringstream os;
  sample().to_json(os);
  const std::string json = os.str();
  INFO(json);
  CHECK(test::json_error(json).empty());
  CHECK(json.rfind(
            "{\"device\":1,\"time_us\":1234,\"stats\":{\"allocated_bytes.all.current\":12587008,",
            0) == 0);
  // The small segment: allocated = active block, active = active + pending, requested = both.
  CHECK(
      json.find(
          "\"address\":4294967296,\"total_size\":2097152,\"mapped_size\":2097152,\"allocated_"
          "size\":4096,"
          "\"active_size\":12288,\"requested_size\":12000,\"stream\":0,\"segment_type\":\"small\","
          "\"is_expandable\":false") != std::string::npos);
  CHECK(json.find("\"state\":\"active_pending_free\",\"stream\":0,\"waiting_on\":[7]") !=
        std::string::npos);
  CHECK(json.find("\"state\":\"active_allocated\"") != std::string::npos);
  CHECK(json.find("\"state\":\"inactive\"") != std::string::npos);
  CHECK(json.find("\"state\":\"unmapped\"") != std::string::npos);
  CHECK(json.find("\"segment_type\":\"large\",\"is_expandable\":true") != std::string::npos);

  std::ostringstream empty;
  memory_snapshot{}.to_json(empty);
  CHECK(test::json_error(empty.str()).empty());
}

TEST_CASE("Statistics JSON carries every PyTorch key and streamsafe's counters",
          "[core][snapshot]") {
  statistics s;
  s.allocated_bytes.increase(1000);
  s.allocated_bytes.decrease(400);
  s.num_alloc_retries = 2;
  s.fence_wait_ns = 1500;
  s.releases_deferred = 3;
  std::ostringstream os;
  write_statistics_json(os, s);
  const std::string json = os.str();
  CHECK(test::json_error(json).empty());
  for (const char* key :
       {"\"allocated_bytes.all.current\":600", "\"allocated_bytes.all.peak\":1000",
        "\"allocated_bytes.all.allocated\":1000", "\"allocated_bytes.all.freed\":400",
        "\"reserved_bytes.all.peak\":0", "\"active_bytes.all.current\":0",
        "\"inactive_split_bytes.all.current\":0", "\"requested_bytes.all.current\":0",
        "\"segment.all.current\":0", "\"num_alloc_retries\":2", "\"num_ooms\":0",
        "\"num_device_alloc\":0", "\"num_device_free\":0", "\"num_sync_all_streams\":0",
        "\"events_recorded\":0", "\"fence_waits\":0", "\"fence_wait_ns\":1500",
        "\"releases_deferred\":3"}) {
    CHECK(json.find(key) != std::string::npos);
  }
}

TEST_CASE("memory_summary is an aligned table of current, peak and totals plus the counters",
          "[core][snapshot]") {
  statistics s;
  s.allocated_bytes.increase(static_cast<std::int64_t>(3 * MiB / 2));
  s.allocated_bytes.increase(static_cast<std::int64_t>(MiB / 2));
  s.allocated_bytes.decrease(static_cast<std::int64_t>(MiB));
  s.reserved_bytes.increase(static_cast<std::int64_t>(20 * MiB));
  s.allocation.increase(2);
  s.num_ooms = 1;
  s.num_device_alloc = 4;
  s.fence_waits = 2;
  s.fence_wait_ns = 2'500'000;
  const std::string text = memory_summary(s, 0);
  INFO(text);
  CHECK(text.find("streamsafe memory summary, device 0") != std::string::npos);
  CHECK(text.find("| Allocated memory        |     1.00 MiB |     2.00 MiB |     2.00 MiB |     "
                  "1.00 MiB |") != std::string::npos);
  CHECK(text.find("GPU reserved memory") != std::string::npos);
  CHECK(text.find("Non-releasable memory") != std::string::npos);
  CHECK(text.find("Requested memory") != std::string::npos);
  CHECK(text.find("| Allocations             |            2 |            2 |            2 |        "
                  "    0 |") != std::string::npos);
  CHECK(text.find("OOMs") != std::string::npos);
  CHECK(text.find("2.500 ms") != std::string::npos);
  CHECK(text.find("Peak reserved/allocated") != std::string::npos);
  CHECK(text.find("10.0000") != std::string::npos);  // 20 MiB reserved / 2 MiB allocated at peak
  // Every line of the table has the same width.
  std::istringstream lines(text);
  std::string line, first;
  std::getline(lines, first);
  while (std::getline(lines, line)) CHECK(line.size() == first.size());
  CHECK(memory_summary(statistics{}).find("device") == std::string::npos);
}
