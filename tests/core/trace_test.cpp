// The trace recorder: a bounded ring of allocator events, exported as JSON and as the CSV of
// shared/traces/README.md.
#include "support/json_check.hpp"

#include <streamsafe/core/trace.hpp>

#include <catch2/catch.hpp>

#include <sstream>
#include <thread>
#include <vector>

using namespace streamsafe;

namespace {

trace_event ev(std::uint64_t t, trace_action a, std::uintptr_t addr, std::size_t size,
               stream_handle s = 0) {
  return trace_event{t, a, addr, size, s, 0};
}

}  // namespace

TEST_CASE("Every trace action has a name that parses back to it", "[core][trace]") {
  for (auto a : {trace_action::alloc, trace_action::free_requested, trace_action::free_completed,
                 trace_action::segment_alloc, trace_action::segment_free, trace_action::segment_map,
                 trace_action::segment_unmap, trace_action::release_deferred, trace_action::oom}) {
    auto parsed = parse_trace_action(to_string(a));
    REQUIRE(parsed);
    CHECK(*parsed == a);
  }
  CHECK_FALSE(parse_trace_action("Alloc"));
  CHECK_FALSE(parse_trace_action(""));
  CHECK_FALSE(parse_trace_action("allocate"));
}

TEST_CASE("The recorder keeps events oldest first and writes the shared CSV format",
          "[core][trace]") {
  trace_recorder rec(8);
  rec.record(ev(100, trace_action::segment_alloc, 4096, 2097152, 7));
  rec.record(ev(101, trace_action::alloc, 4096, 1000, 7));
  rec.record(ev(102, trace_action::free_requested, 4096, 1000, 7));
  REQUIRE(rec.size() == 3);
  CHECK(rec.recorded() == 3);
  CHECK(rec.dropped() == 0);
  auto events = rec.events();
  REQUIRE(events.size() == 3);
  CHECK(events[0].action == trace_action::segment_alloc);
  CHECK(events[2].time_us == 102);

  std::ostringstream csv;
  rec.to_csv(csv);
  CHECK(csv.str() ==
        "time_us,action,address,size,stream\n"
        "100,segment_alloc,4096,2097152,7\n"
        "101,alloc,4096,1000,7\n"
        "102,free_requested,4096,1000,7\n");
}

TEST_CASE("A full recorder overwrites its oldest events and counts them as dropped",
          "[core][trace]") {
  trace_recorder rec(4);
  for (std::uint64_t i = 0; i < 10; ++i) rec.record(ev(i, trace_action::alloc, 512 * i, 512));
  CHECK(rec.size() == 4);
  CHECK(rec.capacity() == 4);
  CHECK(rec.recorded() == 10);
  CHECK(rec.dropped() == 6);
  auto events = rec.events();
  REQUIRE(events.size() == 4);
  for (std::size_t i = 0; i < 4; ++i)
    CHECK(events[i].time_us == 6 + i);  // the newest four, in order

  rec.clear();
  CHECK(rec.size() == 0);
  CHECK(rec.dropped() == 0);
  rec.record(ev(42, trace_action::oom, 0, 1 << 20));
  REQUIRE(rec.events().size() == 1);
  CHECK(rec.events()[0].action == trace_action::oom);
}

TEST_CASE("A recorder of capacity zero keeps nothing and counts every event as dropped",
          "[core][trace]") {
  trace_recorder rec(0);
  rec.record(ev(1, trace_action::alloc, 512, 512));
  rec.record(trace_action::free_requested, 512, 512, 0, 0);
  CHECK(rec.size() == 0);
  CHECK(rec.events().empty());
  CHECK(rec.dropped() == 2);
  std::ostringstream csv;
  rec.to_csv(csv);
  CHECK(csv.str() == "time_us,action,address,size,stream\n");
}

TEST_CASE("The JSON export is valid JSON with PyTorch's trace entry keys", "[core][trace]") {
  trace_recorder rec(2);
  rec.record(ev(5, trace_action::segment_map, 1 << 21, 20 << 20, 3));
  rec.record(ev(6, trace_action::release_deferred, 1 << 21, 20 << 20, 3));
  rec.record(ev(7, trace_action::segment_unmap, 1 << 21, 20 << 20, 3));
  std::ostringstream os;
  rec.to_json(os);
  const std::string json = os.str();
  CHECK(test::json_error(json).empty());
  CHECK(json.find("\"capacity\":2,\"recorded\":3,\"dropped\":1") != std::string::npos);
  CHECK(
      json.find("{\"time_us\":6,\"action\":\"release_deferred\",\"addr\":2097152,\"size\":20971520,"
                "\"stream\":3,\"device\":0}") != std::string::npos);
  CHECK(json.find("segment_map") == std::string::npos);  // dropped, the oldest

  std::ostringstream empty;
  trace_recorder(4).to_json(empty);
  CHECK(test::json_error(empty.str()).empty());
}

TEST_CASE("record() stamps events with the system clock in microseconds", "[core][trace]") {
  trace_recorder rec(1);
  const std::uint64_t before = trace_recorder::now_us();
  rec.record(trace_action::alloc, 512, 100, 0, 3);
  const std::uint64_t after = trace_recorder::now_us();
  auto e = rec.events().at(0);
  CHECK(e.time_us >= before);
  CHECK(e.time_us <= after);
  CHECK(e.device == 3);
  CHECK(before > 1'600'000'000'000'000ull);  // after September 2020: microseconds since the epoch
}

TEST_CASE("Threads recording at once lose no count and keep each thread's order", "[core][trace]") {
  constexpr int threads = 4;
  constexpr std::uint64_t per_thread = 20000;
  trace_recorder rec(1000);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&rec, t] {
      for (std::uint64_t i = 0; i < per_thread; ++i) {
        rec.record(trace_event{i, trace_action::alloc, static_cast<std::uintptr_t>(t), 512, 0, 0});
      }
    });
  }
  for (auto& th : pool) th.join();
  CHECK(rec.recorded() == threads * per_thread);
  CHECK(rec.size() == 1000);
  CHECK(rec.dropped() == threads * per_thread - 1000);
  std::vector<std::int64_t> last(threads, -1);
  for (const trace_event& e : rec.events()) {
    REQUIRE(e.address < static_cast<std::uintptr_t>(threads));
    CHECK(static_cast<std::int64_t>(e.time_us) > last[e.address]);  // per-thread sequence increases
    last[e.address] = static_cast<std::int64_t>(e.time_us);
  }
}
