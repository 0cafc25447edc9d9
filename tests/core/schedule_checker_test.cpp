// The schedule checker (support/schedule_checker.hpp): 2 to 8 threads, each with its own
// stream, through one allocator with a memory limit on the simulated device, in seeded
// turn-taking schedules, in every interleaving of small two-thread programs, and running at
// once. After every step: no fault, reserved never above the limit (statistics, snapshot,
// the device's own bytes) and no out_of_memory while the oracle (support/could_serve.hpp) says
// the request could be served.
//
// STREAMSAFE_CHECKER_SECONDS sets how long each test case runs (default 2 s);
// STREAMSAFE_CHECKER_SEED runs one seed only (the reproducer a violation prints);
// STREAMSAFE_CHECKER_STRICT=1 fails on every violation. Without it, the kinds the core is known
// to break today (k_known_broken below) are reported as warnings and do not fail the test: the
// first violation of each run is printed with its seed and schedule.
#include "support/schedule_checker.hpp"
#include "support/command.hpp"

#include <unistd.h>
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <string>

using namespace streamsafe;
using namespace streamsafe::test;
using namespace streamsafe::test::checker;

namespace {

// The violations the core is known to produce today: reported, not failed, unless
// STREAMSAFE_CHECKER_STRICT=1. None now: "snapshot-sum", from the checker's first version, left
// it after 45 strict minutes without one (30 at e7302b4, 15 at 3c51004). "oom" left this set once
// the serve path served every judged request (30 minutes of the three test cases with none);
// "device-limit" once a dropped ghost's memory passed to the older ghost still mapping it
// (reclaim.cpp; tests/core/ghost_chain_test.cpp): none in 10 minutes of threads at once, where it
// had been about 1 a minute; "oracle" once the checker's registry of live blocks kept a block that
// another thread got at a freed address before the freeing thread unregistered it (none in 240 s,
// where it had been about 1 in 80 s).
const std::set<std::string> k_known_broken = {};

// STREAMSAFE_CHECKER_PRINT: how many violating runs each test case prints (default 3).
std::size_t print_limit() {
  const char* s = std::getenv("STREAMSAFE_CHECKER_PRINT");
  return s != nullptr && *s != '\0' ? std::strtoull(s, nullptr, 10) : 3;
}

bool strict() {
  const char* s = std::getenv("STREAMSAFE_CHECKER_STRICT");
  return s != nullptr && std::string(s) == "1";
}

// Counts of one test case's runs, and its violations by kind.
struct tally {
  std::size_t runs = 0, steps = 0, ooms = 0, oom_judged = 0, inconclusive = 0;
  std::map<std::string, std::size_t> by_kind;
  std::size_t printed = 0;

  void add(const run_result& r) {
    ++runs;
    steps += r.steps.size();
    ooms += r.ooms;
    oom_judged += r.oom_judged;
    inconclusive += r.inconclusive;
    for (const auto& n : r.notes) ++by_kind[n.kind];
    if (r.failure) ++by_kind[r.failure->kind];
    if (!r.failure && r.notes.empty()) return;
    if (printed < print_limit()) {
      ++printed;
      std::fprintf(stderr, "\n--- schedule checker violation ---\n%s", r.replay_text().c_str());
    }
  }

  // `unit`: what one run is (an interleaving, or a run of threads at once).
  void report(const char* what, double seconds, const char* unit = "interleavings") const {
    std::string kinds;
    for (const auto& [k, n] : by_kind) kinds += " " + k + ":" + std::to_string(n);
    std::fprintf(stderr,
                 "schedule checker, %s: %zu %s, %zu steps in %.1f s; out_of_memory "
                 "%zu (%zu judged, %zu not judged); violations:%s\n",
                 what, runs, unit, steps, seconds, ooms, oom_judged, inconclusive,
                 kinds.empty() ? " none" : kinds.c_str());
  }

  // Fails for every violation not known broken (every one when strict).
  void require_clean() const {
    for (const auto& [kind, n] : by_kind) {
      INFO("violations of kind " << kind << ": " << n);
      if (strict() || k_known_broken.count(kind) == 0) {
        CHECK(n == 0);
      } else {
        WARN("known broken in the core today, not failed (STREAMSAFE_CHECKER_STRICT=1 fails it): "
             << kind << " x" << n);
      }
    }
  }
};

template <class F>
void for_seconds(double seconds, F&& f) {
  const auto start = std::chrono::steady_clock::now();
  const auto until = start + std::chrono::duration<double>(seconds);
  std::uint64_t seed = 1;
  if (const auto only = only_seed()) {
    f(*only);
    return;
  }
  do {
    f(seed++);
  } while (std::chrono::steady_clock::now() < until);
}

double elapsed_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

TEST_CASE("seeded turn-taking schedules of 2 to 8 threads keep the allocator's promise",
          "[core][oracle][schedules][threads][property]") {
  tally t;
  const auto start = std::chrono::steady_clock::now();
  for_seconds(run_seconds(), [&](std::uint64_t seed) {
    const config c = config::from_seed(seed, 2, 8);
    t.add(run_turns(c, {}, 160));
  });
  t.report("turn-taking", elapsed_since(start));
  CHECK(t.runs > 0);
  t.require_clean();
}

TEST_CASE("every interleaving of small two-thread programs keeps the allocator's promise",
          "[core][oracle][schedules][threads][property]") {
  tally t;
  std::size_t programs = 0;
  const auto start = std::chrono::steady_clock::now();
  for_seconds(run_seconds(), [&](std::uint64_t seed) {
    config c = config::from_seed(seed, 2, 2);
    c.limit_bytes = 128 * MiB;  // small programs reach the limit
    std::mt19937_64 g(seed);
    const int n0 = 2 + static_cast<int>(g() % 2);
    const int n1 = 2 + static_cast<int>(g() % 2);
    ++programs;
    run_all_interleavings(c, 6, n0, n1, [&](const run_result& r) {
      t.add(r);
      return true;
    });
  });
  t.report("every interleaving", elapsed_since(start));
  std::fprintf(stderr, "  (%zu programs)\n", programs);
  CHECK(t.runs > 0);
  t.require_clean();
}

TEST_CASE("threads running at once keep the allocator's promise",
          "[core][oracle][schedules][threads][property]") {
  tally t;
  const auto start = std::chrono::steady_clock::now();
  for_seconds(run_seconds(), [&](std::uint64_t seed) {
    const config c = config::from_seed(seed, 2, 8);
    t.add(run_free(c, 80));
  });
  t.report("free-running", elapsed_since(start), "runs");
  CHECK(t.runs > 0);
  t.require_clean();
}

// Schedules the core fails today (found by the test cases above at the commit that added this
// file; the release worker off). Marked [!shouldfail]: once the core serves them, Catch2 reports
// these test cases as failed; then drop the mark and empty k_known_broken. Each replays in a
// fresh process (this binary, the seeded test case alone, strict): the allocator's choices
// follow the order of heap addresses, which the tests run before in the same process change,
// so a seed replays as it was found only in a process of its own.
namespace {

void replay_strictly(std::uint64_t seed) {
  char self[4096] = {};
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  REQUIRE(n > 0);
  const command_result r = run_command(
      "STREAMSAFE_CHECKER_STRICT=1 STREAMSAFE_CHECKER_PRINT=1 STREAMSAFE_CHECKER_SEED=" +
      std::to_string(seed) + " '" + std::string(self, static_cast<std::size_t>(n)) +
      "' 'seeded turn-taking schedules*'");
  INFO(r.output);
  CHECK(r.status == 0);
}

}  // namespace

TEST_CASE("a cuda_malloc schedule in defer mode is served from memory pending other streams",
          "[core][oracle][schedules]") {
  replay_strictly(102);  // allocate(39130112): kept 74 MiB + 38 MiB new, limit 128 MiB
}

TEST_CASE("an expandable schedule in defer mode is served from memory pending other streams",
          "[core][oracle][schedules][expandable]") {
  replay_strictly(108);  // allocate(35662848): kept 82 MiB + 36 MiB new, limit 128 MiB
}

TEST_CASE("an expandable schedule is served from a tag's memory that is still pausing",
          "[core][oracle][schedules][expandable][sleep]") {
  replay_strictly(119);  // allocate(75606016): kept 182 MiB + 74 MiB new, limit 256 MiB
}

TEST_CASE("a resume under the limit is served from cached memory",
          "[core][oracle][schedules][expandable][sleep]") {
  replay_strictly(106);  // resume: kept 150 MiB + 82 MiB paused, limit 256 MiB
}
