// streamsafe-replay's library: reading PyTorch-style and RMM traces (malformed lines reported
// with their numbers, skipped or rejected), replaying them on the simulated device with known
// peaks, the trace and snapshot it produces, and the HTML report.
//
// Compiles to nothing unless streamsafe_tests links streamsafe_replay_lib (allocator/tools/replay),
// which defines STREAMSAFE_HAVE_REPLAY_LIB.
#ifdef STREAMSAFE_HAVE_REPLAY_LIB

#include "support/json_check.hpp"

#include <streamsafe/core/caching_allocator.hpp>
#include <streamsafe/sim/simulated_device.hpp>

#include "html_report.hpp"
#include "repeat.hpp"
#include "replay.hpp"
#include "trace_reader.hpp"

#include <zlib.h>
#include <catch2/catch.hpp>

#include <cstdio>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::replay;

namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

// Three 4 KiB blocks (small pool) and one 30 MiB block (large pool) on stream 0, then frees;
// PyTorch's segment rows and free_completed rows are present, as in shared/traces.
const char* k_pytorch_trace =
    "time_us,action,address,size,stream\n"
    "1000,segment_alloc,900000,2097152,0\n"
    "1001,alloc,900000,4000,0\n"
    "1002,alloc,904096,4096,0\n"
    "1003,segment_alloc,1900000,31457280,0\n"
    "1004,alloc,1900000,31457280,0\n"
    "1005,free_requested,900000,4000,0\n"
    "1006,free_completed,900000,4000,0\n"
    "1007,alloc,908192,4096,0\n"
    "1008,free_requested,1900000,31457280,0\n"
    "1009,free_completed,1900000,31457280,0\n"
    "1010,free_requested,904096,4096,0\n"
    "1011,free_completed,904096,4096,0\n";

replay_settings sim_settings(backend_kind backend, std::size_t device_bytes = 8 * GiB) {
  replay_settings s;
  s.alloc_options.backend = backend;
  s.make_device = [device_bytes] { return make_simulated_device(device_bytes); };
  s.timed_passes = 1;
  s.trace_capacity = 1000;
  s.timeline_points = 100;
  s.snapshot_at_peak = true;
  return s;
}

std::string temp_path(const std::string& name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir && *dir ? dir : "/tmp") + "/streamsafe_replay_test_" + name;
}

}  // namespace

TEST_CASE("A PyTorch-style trace becomes allocs and frees by slot, segment rows counted aside",
          "[replay]") {
  replay_program p = read_trace_text(k_pytorch_trace);
  CHECK(p.format == trace_format::pytorch);
  CHECK(p.lines == 13);
  CHECK(p.allocs == 4);
  CHECK(p.frees == 3);
  REQUIRE(p.steps.size() == 7);
  CHECK(p.segment_rows == 2);
  CHECK(p.ignored_free_completed == 3);
  CHECK(p.bad_lines.empty());
  CHECK(p.live_at_end == 1);
  CHECK(p.trace_streams == std::vector<std::uint64_t>{0});
  CHECK(p.recorded_reserved_peak == 2 * MiB + 30 * MiB);
  CHECK(p.requested_peak ==
        4096 + 4096 + 30 * MiB);  // after the 4000-byte block is replaced (line 8)
  // The free of 900000 reuses its slot for the next alloc.
  CHECK(p.steps[3].alloc == false);
  CHECK(p.steps[3].slot == p.steps[0].slot);
  CHECK(p.steps[4].slot == p.steps[0].slot);
  CHECK(p.steps[3].size_bytes == 4000);  // a free carries its alloc's requested size
  CHECK(p.steps[3].line == 7);
  CHECK(p.slot_count == 3);
  CHECK(p.steps[0].time_us == 1001);
}

TEST_CASE("free_completed replays as the free when no free_requested came before it", "[replay]") {
  replay_program p = read_trace_text(
      "time_us,action,address,size,stream\n"
      "1,alloc,4096,100,0\n"
      "2,free_completed,4096,100,0\n");
  CHECK(p.frees == 1);
  CHECK(p.ignored_free_completed == 0);
  CHECK(p.bad_lines.empty());
}

TEST_CASE("RMM logs are read: hex pointers, clock times, streams, allocate failures", "[replay]") {
  replay_program p = read_trace_text(
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "140573312345856,23:59:59:999000,allocate,0x7f8a40000000,1024,0x7f8a38001020\n"
      "140573312345856,23:59:59.9995,allocate,7f8a40000400,2048,0\n"
      "140573312345856,00:00:00:000500,free,0x7f8a40000000,1024,0x7f8a38001020\n"
      "140573312345856,00:00:01:000000,allocate failure,0x0,99999999999,0\n"
      "140573312345857,00:00:02:000000,deallocate,0x7f8a40000400,2048,140232445644832\n");
  CHECK(p.format == trace_format::rmm);
  CHECK(p.bad_lines.empty());
  CHECK(p.allocs == 2);
  CHECK(p.frees == 2);
  CHECK(p.other_rows == 1);
  REQUIRE(p.steps.size() == 4);
  const std::uint64_t last_second = (23 * 3600 + 59 * 60 + 59) * 1'000'000ull;
  CHECK(p.steps[0].time_us == last_second + 999'000);
  CHECK(p.steps[1].time_us == last_second + 999'500);
  CHECK(p.steps[2].time_us == 86'400'000'000ull + 500);  // past midnight: the next day
  CHECK(p.steps[3].time_us == 86'400'000'000ull + 2'000'000);
  CHECK(p.trace_streams == std::vector<std::uint64_t>{0x7f8a38001020, 0, 140232445644832});
  CHECK(p.steps[3].stream == 2);  // freed on another stream than its allocation
  CHECK(p.steps[3].slot == p.steps[1].slot);

  replay_program epoch = read_trace_text(
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "1,1634567890.123456,allocate,0x1000,1024,0\n"
      "1,1634567890.5,free,0x1000,1024,0\n");
  REQUIRE(epoch.steps.size() == 2);
  CHECK(epoch.steps[0].time_us == 1634567890123456ull);
  CHECK(epoch.steps[1].time_us == 1634567890500000ull);
}

TEST_CASE("Columns are found by name, in any order, with extra columns", "[replay]") {
  replay_program p = read_trace_text(
      "device,stream,size,address,action,time_us\n"
      "0,7,512,4096,alloc,10\n"
      "0,7,512,4096,free_requested,11\n");
  CHECK(p.bad_lines.empty());
  REQUIRE(p.steps.size() == 2);
  CHECK(p.trace_streams == std::vector<std::uint64_t>{7});
  CHECK(p.steps[0].size_bytes == 512);
  CHECK(p.steps[1].time_us == 11);
}

TEST_CASE("Headerless traces are read in the canonical column order, guessed or forced",
          "[replay]") {
  replay_program guessed = read_trace_text("5,alloc,4096,100,0\n6,free_requested,4096,100,0\n");
  CHECK(guessed.format == trace_format::pytorch);
  CHECK(guessed.steps.size() == 2);
  read_options rmm;
  rmm.format = trace_format::rmm;
  replay_program forced = read_trace_text("1,00:00:01:000000,allocate,0x1000,64,0\n", rmm);
  CHECK(forced.format == trace_format::rmm);
  CHECK(forced.allocs == 1);
  CHECK_THROWS_AS(read_trace_text("time_us,action,address,size,stream\n1,alloc,4096,1,0\n", rmm),
                  trace_parse_error);
  try {
    read_trace_text("\n# a comment\nhello,world\n");
    FAIL("an unknown format must be rejected");
  } catch (const trace_parse_error& e) {
    CHECK(e.line() == 3);
    CHECK(std::string(e.what()).find("unrecognised trace format") != std::string::npos);
  }
  CHECK_THROWS_AS(read_trace_text(""), trace_parse_error);
}

TEST_CASE("Blank lines, comments, CRLF line ends and a byte order mark are accepted", "[replay]") {
  replay_program p = read_trace_text(
      "\xEF\xBB\xBFtime_us,action,address,size,stream\r\n"
      "\r\n"
      "# recorded on an H200\r\n"
      "1,alloc,4096,100,0\r\n"
      "2,free_requested,4096,100,0\r\n");
  CHECK(p.bad_lines.empty());
  CHECK(p.steps.size() == 2);
}

TEST_CASE("Malformed lines are reported with their line numbers and skipped by default",
          "[replay]") {
  const std::string text =
      "time_us,action,address,size,stream\n"        // 1
      "1,alloc,4096,100,0\n"                        // 2
      "2,alloc,4096\n"                              // 3: too few fields
      "3,alloc,8192,1x0,0\n"                        // 4: bad size
      "4,allocate,8192,100,0\n"                     // 5: unknown action (an RMM word)
      "5,free_requested,12288,100,0\n"              // 6: free of an address never allocated
      "6,alloc,4096,200,0\n"                        // 7: alloc at a live address
      "7,alloc,8192,-5,0\n"                         // 8: negative size
      "x,alloc,8192,100,0\n"                        // 9: bad time
      "8,alloc,8192,100,99999999999999999999999\n"  // 10: stream overflows 64 bits
      "9,free_requested,4096,100,0\n";              // 11
  replay_program p = read_trace_text(text);
  REQUIRE(p.bad_lines.size() == 8);
  std::vector<std::size_t> lines;
  for (const auto& b : p.bad_lines) lines.push_back(b.line);
  CHECK(lines == std::vector<std::size_t>{3, 4, 5, 6, 7, 8, 9, 10});
  CHECK(p.bad_lines[0].message.find("expected 5 fields, found 3") != std::string::npos);
  CHECK(p.bad_lines[1].message.find("bad size '1x0'") != std::string::npos);
  CHECK(p.bad_lines[2].message.find("unknown action 'allocate'") != std::string::npos);
  CHECK(p.bad_lines[3].message.find("which no live alloc holds") != std::string::npos);
  CHECK(p.bad_lines[4].message.find("still live since line 2") != std::string::npos);
  CHECK(p.steps.size() == 2);  // line 2 and line 11
  CHECK(p.live_at_end == 0);

  read_options strict;
  strict.strict = true;
  try {
    read_trace_text(text, strict);
    FAIL("strict mode must reject the trace");
  } catch (const trace_parse_error& e) {
    CHECK(e.line() == 3);
    CHECK(std::string(e.what()).find("expected 5 fields") != std::string::npos);
  }
}

TEST_CASE("Random garbage after a valid header is reported line by line, never a crash",
          "[replay]") {
  std::mt19937 rng(1234);
  const std::string pieces[] = {"alloc",
                                "free_requested",
                                "segment_alloc",
                                "0x1f",
                                "4096",
                                "-1",
                                "",
                                "\"",
                                ",",
                                "99999999999999999999",
                                "free",
                                "oom",
                                "\t",
                                "abc",
                                "12",
                                "512",
                                "\xff\xfe",
                                ":"};
  std::ostringstream os;
  os << "time_us,action,address,size,stream\n";
  for (int line = 0; line < 3000; ++line) {
    const int fields = static_cast<int>(rng() % 8);
    for (int f = 0; f < fields; ++f) {
      os << pieces[rng() % (sizeof pieces / sizeof pieces[0])];
      if (f + 1 < fields) os << ',';
    }
    os << '\n';
  }
  replay_program p;
  REQUIRE_NOTHROW(p = read_trace_text(os.str()));
  CHECK(p.bad_lines.size() > 100);
  for (const auto& b : p.bad_lines) {
    CHECK(b.line >= 2);
    CHECK(b.line <= 3001);
  }
  // Whatever was accepted replays cleanly.
  replay_settings s = sim_settings(backend_kind::cuda_malloc);
  REQUIRE_NOTHROW(run_replay(p, s));
}

TEST_CASE("Gzip-compressed and plain files are read; truncation and absence are reported",
          "[replay]") {
  const std::string gz = temp_path("trace.csv.gz");
  {
    gzFile f = gzopen(gz.c_str(), "wb");
    REQUIRE(f);
    gzputs(f, k_pytorch_trace);
    gzclose(f);
  }
  replay_program p = read_trace_file(gz);
  CHECK(p.steps.size() == 7);
  CHECK(p.bad_lines.empty());

  const std::string plain = temp_path("trace.csv");
  {
    std::FILE* f = std::fopen(plain.c_str(), "wb");
    REQUIRE(f);
    std::fputs(k_pytorch_trace, f);
    std::fclose(f);
  }
  CHECK(read_trace_file(plain).steps.size() == 7);

  // Cut the compressed file in the middle: the lines before the cut are kept, the cut reported.
  std::string bytes;
  {
    std::FILE* f = std::fopen(gz.c_str(), "rb");
    REQUIRE(f);
    char buf[4096];
    std::size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) bytes.append(buf, n);
    std::fclose(f);
  }
  const std::string cut = temp_path("cut.csv.gz");
  {
    std::FILE* f = std::fopen(cut.c_str(), "wb");
    std::fwrite(bytes.data(), 1, bytes.size() * 2 / 3, f);
    std::fclose(f);
  }
  replay_program partial = read_trace_file(cut);
  REQUIRE_FALSE(partial.bad_lines.empty());
  CHECK(partial.bad_lines.back().message.find("truncated") != std::string::npos);
  read_options strict;
  strict.strict = true;
  CHECK_THROWS_AS(read_trace_file(cut, strict), trace_parse_error);

  try {
    read_trace_file(temp_path("does_not_exist.csv"));
    FAIL("a missing file must be reported");
  } catch (const trace_parse_error& e) {
    CHECK(e.line() == 0);
    CHECK(std::string(e.what()).find("cannot open") != std::string::npos);
  }
  std::remove(gz.c_str());
  std::remove(plain.c_str());
  std::remove(cut.c_str());
}

TEST_CASE("A replay with cudaMalloc-style segments reaches the known peaks", "[replay]") {
  replay_program p = read_trace_text(k_pytorch_trace);
  replay_report rep = run_replay(p, sim_settings(backend_kind::cuda_malloc));
  const statistics& s = rep.result.stats;
  // Rounded to 512: 4000 -> 4096; 30 MiB stays. Peak: 4096 + 4096 + 30 MiB.
  CHECK(s.allocated_bytes.peak == static_cast<std::int64_t>(8 * KiB + 30 * MiB));
  CHECK(rep.result.peak_allocated == s.allocated_bytes.peak);
  // One 2 MiB small segment, one 30 MiB large segment (requests of 10 MiB or more: rounded to 2
  // MiB).
  CHECK(s.reserved_bytes.peak == static_cast<std::int64_t>(32 * MiB));
  CHECK(rep.result.segment_ops.segment_allocs == 2);
  CHECK(rep.result.segment_ops.segment_frees == 0);
  CHECK(rep.result.reserved_end == s.reserved_bytes.current);
  CHECK(rep.ratio() == Approx(32.0 * MiB / (8 * KiB + 30 * MiB)));
  CHECK(rep.result.steps == 7);
  CHECK(rep.events_per_second() > 0);
  CHECK(rep.result.ooms == 0);
  CHECK(rep.device.find("simulated device, 8.00 GiB") != std::string::npos);

  // The timeline carries the same peaks.
  std::int64_t tl_alloc = 0, tl_res = 0;
  for (const auto& t : rep.result.timeline) {
    tl_alloc = std::max(tl_alloc, t.allocated);
    tl_res = std::max(tl_res, t.reserved);
  }
  CHECK(tl_alloc == s.allocated_bytes.peak);
  CHECK(tl_res == s.reserved_bytes.peak);

  // The trace: segment_alloc before the alloc it served, allocs and frees with trace times and
  // sizes.
  REQUIRE(rep.trace.size() >= 2 + 4 + 3 * 2);
  CHECK(rep.trace[0].action == trace_action::segment_alloc);
  CHECK(rep.trace[0].size == 2 * MiB);
  CHECK(rep.trace[1].action == trace_action::alloc);
  CHECK(rep.trace[1].size == 4000);
  CHECK(rep.trace[1].time_us == 1001);
  std::size_t allocs = 0, frees = 0, completed = 0, segments = 0;
  for (const auto& e : rep.trace) {
    allocs += e.action == trace_action::alloc;
    frees += e.action == trace_action::free_requested;
    completed += e.action == trace_action::free_completed;
    segments += e.action == trace_action::segment_alloc;
  }
  CHECK(allocs == 4);
  CHECK(frees == 3);
  CHECK(completed == 3);
  CHECK(segments == 2);

  // The snapshot at the peak: consistent, its active blocks are the allocated bytes.
  REQUIRE(rep.peak_snapshot);
  const memory_snapshot& snap = *rep.peak_snapshot;
  REQUIRE_NOTHROW(snap.check_consistency());
  std::size_t active = 0, mapped = 0;
  for (const auto& seg : snap.segments) {
    active += seg.bytes_in(snapshot_block_state::active);
    mapped += seg.mapped_bytes;
  }
  CHECK(active == static_cast<std::size_t>(s.allocated_bytes.peak));
  CHECK(mapped == 32 * MiB);
  REQUIRE(snap.segments.size() == 2);
  CHECK(snap.segments[0].pool == snapshot_pool::small);
  CHECK(snap.segments[1].pool == snapshot_pool::large);
  CHECK(snap.time_us == 1004);  // peak reached by the 30 MiB alloc
}

TEST_CASE("--repeat replays the trace back to back; what it never frees is allocated once",
          "[replay]") {
  const replay_program one = read_trace_text(k_pytorch_trace);
  REQUIRE(one.live_at_end == 1);  // the 4 KiB block at 908192
  const replay_program three = repeat_program(one, 3);
  REQUIRE(three.steps.size() == 7 + 6 + 6);
  CHECK(three.repetition_starts == std::vector<std::size_t>{0, 7, 13});
  CHECK(three.allocs == 4 + 3 + 3);
  CHECK(three.frees == 3 * 3);
  CHECK(three.slot_count == 3 * one.slot_count);
  CHECK(three.steps[7].time_us > three.steps[6].time_us);  // times go on
  CHECK_THROWS_AS(repeat_program(one, 0), std::invalid_argument);

  replay_report rep = run_replay(three, sim_settings(backend_kind::cuda_malloc));
  REQUIRE(rep.result.repetitions.size() == 3);
  const auto& r = rep.result.repetitions;
  CHECK(r[0].segment_ops.segment_allocs == 2);  // the first repetition grows the cache
  CHECK(r[1].segment_ops.segment_allocs + r[1].segment_ops.segment_frees == 0);  // reuses it
  CHECK(r[2].segment_ops.segment_allocs + r[2].segment_ops.segment_frees == 0);
  CHECK(r[0].peak_allocated == static_cast<std::int64_t>(8 * KiB + 30 * MiB));
  // Later repetitions hold the first one's never-freed 4 KiB block besides their own peak.
  CHECK(r[1].peak_allocated == static_cast<std::int64_t>(12 * KiB + 30 * MiB));
  CHECK(r[2].peak_allocated == r[1].peak_allocated);
  CHECK(r[2].peak_reserved == static_cast<std::int64_t>(32 * MiB));
  CHECK(rep.result.stats.allocated_bytes.peak == r[1].peak_allocated);
  for (const auto& x : r) CHECK(x.seconds > 0);  // from the timed pass
}

TEST_CASE("A replay with expandable segments maps chunks and its trace replays to the same peaks",
          "[replay]") {
  replay_program p = read_trace_text(k_pytorch_trace);
  replay_report rep = run_replay(p, sim_settings(backend_kind::expandable));
  const statistics& s = rep.result.stats;
  CHECK(s.allocated_bytes.peak == static_cast<std::int64_t>(8 * KiB + 30 * MiB));
  // Small pool: one 2 MiB chunk; large pool: for 30 MiB a 20 MiB chunk and a 10 MiB one.
  CHECK(s.reserved_bytes.peak == static_cast<std::int64_t>(32 * MiB));
  CHECK(rep.result.segment_ops.segment_allocs == 0);
  CHECK(rep.result.segment_ops.maps == 3);
  REQUIRE(rep.peak_snapshot);
  const memory_snapshot& snap = *rep.peak_snapshot;
  REQUIRE_NOTHROW(snap.check_consistency());
  REQUIRE(snap.segments.size() == 2);
  for (const auto& seg : snap.segments) {
    CHECK(seg.expandable);
    CHECK(seg.blocks.back().state == snapshot_block_state::unmapped);
  }

  // The replay's own trace, written as CSV, reads back and replays to the same peaks.
  std::ostringstream csv;
  write_trace_csv(csv, rep.trace);
  replay_program again = read_trace_text(csv.str());
  CHECK(again.bad_lines.empty());
  CHECK(again.allocs == 4);
  CHECK(again.frees == 3);
  CHECK(again.segment_rows == 3);
  CHECK(again.recorded_reserved_peak == 32 * MiB);
  replay_report rep2 = run_replay(again, sim_settings(backend_kind::expandable));
  CHECK(rep2.result.stats.allocated_bytes.peak == s.allocated_bytes.peak);
  CHECK(rep2.result.stats.reserved_bytes.peak == s.reserved_bytes.peak);

  std::ostringstream json;
  write_trace_json(json, rep.trace);
  CHECK(test::json_error(json.str()).empty());
  std::ostringstream snap_json;
  snap.to_json(snap_json);
  CHECK(test::json_error(snap_json.str()).empty());
}

TEST_CASE("Frees on another stream replay as stream-ordered frees", "[replay]") {
  replay_program p = read_trace_text(
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "1,00:00:00:000001,allocate,0x10000,1048576,0x100\n"
      "1,00:00:00:000002,free,0x10000,1048576,0x200\n"
      "1,00:00:00:000003,allocate,0x20000,1048576,0x100\n"
      "1,00:00:00:000004,free,0x20000,1048576,0x100\n");
  replay_settings s = sim_settings(backend_kind::cuda_malloc);
  replay_report rep = run_replay(p, s);
  CHECK(rep.result.ooms == 0);
  CHECK(rep.result.steps == 4);
  CHECK(rep.result.stats.events_recorded >= 1);  // the free on stream 0x200 recorded an event
  std::size_t completed = 0;
  for (const auto& e : rep.trace) completed += e.action == trace_action::free_completed;
  CHECK(completed == 1);  // only the same-stream free is known to complete at once
}

TEST_CASE("Allocations the device cannot hold are counted as OOMs and their frees skipped",
          "[replay]") {
  replay_program p = read_trace_text(
      "time_us,action,address,size,stream\n"
      "1,alloc,4096,41943040,0\n"
      "2,alloc,52428800,41943040,0\n"
      "3,free_requested,52428800,41943040,0\n"
      "4,free_requested,4096,41943040,0\n");
  replay_report rep = run_replay(p, sim_settings(backend_kind::cuda_malloc, 64 * MiB));
  CHECK(rep.result.ooms == 1);
  CHECK(rep.result.frees_skipped == 1);
  CHECK(rep.result.stats.num_ooms == 1);
  bool saw_oom = false;
  for (const auto& e : rep.trace) saw_oom |= e.action == trace_action::oom && e.size == 40 * MiB;
  CHECK(saw_oom);
}

TEST_CASE("The HTML report is one self-contained file with the plot and the segment map",
          "[replay]") {
  replay_program p = read_trace_text(k_pytorch_trace);
  replay_report rep = run_replay(p, sim_settings(backend_kind::expandable));
  html_report_input in;
  in.title = "replay of <trace> & co";
  in.facts = {{"peak allocated", "30.01 MiB"}, {"ratio", "1.3993"}};
  for (const auto& t : rep.result.timeline)
    in.usage.push_back({t.time_us, t.allocated, t.reserved});
  in.snapshot = rep.peak_snapshot;
  in.final_stats = rep.result.stats;
  std::ostringstream os;
  write_html_report(os, in);
  const std::string html = os.str();
  CHECK(html.rfind("<!DOCTYPE html>", 0) == 0);
  CHECK(html.find("replay of &lt;trace&gt; &amp; co") != std::string::npos);
  CHECK(html.find("<trace>") == std::string::npos);
  CHECK(html.find("<script") == std::string::npos);
  CHECK(html.find("src=") == std::string::npos);
  CHECK(html.find("<link") == std::string::npos);
  CHECK(html.find("@import") == std::string::npos);
  CHECK(html.find("class=\"plot\"") != std::string::npos);
  CHECK(html.find("class=\"map\"") != std::string::npos);
  CHECK(html.find("peak reserved 32.00 MiB") != std::string::npos);
  CHECK(html.find("active block") != std::string::npos);
  CHECK(html.find("Allocated memory") != std::string::npos);  // memory_summary
  CHECK(html.find("</html>") != std::string::npos);
  // Nothing but the SVG namespace names a URL.
  std::size_t pos = 0, urls = 0, svg_ns = 0;
  while ((pos = html.find("http", pos)) != std::string::npos) {
    ++urls;
    svg_ns += html.compare(pos, 26, "http://www.w3.org/2000/svg") == 0;
    ++pos;
  }
  CHECK(urls == svg_ns);

  // Degenerate inputs still give a page.
  html_report_input empty;
  empty.title = "empty";
  empty.usage = {{5, 0, 0}};
  std::ostringstream os2;
  REQUIRE_NOTHROW(write_html_report(os2, empty));
  CHECK(os2.str().find("</html>") != std::string::npos);
}

#endif  // STREAMSAFE_HAVE_REPLAY_LIB

TEST_CASE("The HTML segment map names each segment's tag and what a pause gave back",
          "[replay][sleep]") {
  sim::simulated_device dev;
  options o;
  o.backend = backend_kind::expandable;
  caching_allocator alloc(dev, o);
  void* p = nullptr;
  {
    tag_scope scope("kv_cache");
    p = alloc.allocate(30 * MiB, 0);
  }
  alloc.pause("kv_cache", pause_mode::discard);
  html_report_input in;
  in.title = "paused";
  in.usage = {{0, 0, 0}, {1, 30 * MiB, 0}};
  in.snapshot = alloc.snapshot();
  std::ostringstream os;
  write_html_report(os, in);
  const std::string html = os.str();
  CHECK(html.find("tag kv_cache") != std::string::npos);
  CHECK(html.find(", paused ") != std::string::npos);
  CHECK(html.find("(paused: its memory is back with the driver until resume)") !=
        std::string::npos);
  alloc.resume("kv_cache");
  alloc.deallocate(p);
}
