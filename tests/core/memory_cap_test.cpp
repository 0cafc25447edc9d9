// The memory cap and queued memory, on the simulated device (both backends).
//
// The seed under a cap, scaled to GiB: 16 GiB of parameters on the compute stream; each step
// 256 x 64 MiB gradients allocated on a side stream, a per-parameter SignSGD-like loop of timed
// work on the compute stream reading them (no record_stream; release fence all_streams), the last
// gradient kept alive until the next step's loop (a Python loop variable), the rest freed,
// empty_cache(), then at once one 16 GiB buffer on the compute stream; four steps under a 35 GiB
// memory_limit. The cap must hold (reserved, peak reserved and the device's own bytes in use)
// and the buffer must fit every step. Queued memory is still memory: it counts against the cap
// until the driver call and is the first memory a request reuses, by a wait of its stream on the
// release fence (no host wait, no new memory from the driver).
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;
using namespace std::chrono_literals;

namespace {

constexpr std::size_t k_cap = 35 * GiB;
constexpr std::size_t k_grad = 64 * MiB;
constexpr int k_grads = 256;

struct seed_step {
  bool fits = false;
  std::string error;
  std::uint64_t new_memory_for_buffer = 0;  // maps + segment allocations the buffer made
};

struct seed_run {
  std::vector<seed_step> steps;
  std::int64_t peak_reserved = 0;      // statistics: reserved_bytes.peak
  std::int64_t max_reserved_seen = 0;  // reserved_bytes.current sampled after every operation
  std::size_t max_in_use = 0;          // the device's own bytes backed by memory, sampled
  std::uint64_t fence_waits = 0;       // host waits on fence events (statistics)
  std::uint64_t device_syncs = 0;
  std::uint64_t new_memory_late = 0;  // maps + segment allocations in steps 2 and 3
  std::size_t faults = 0;
  std::size_t pending_after = 0;
  std::uint64_t bytes_given_back = 0;  // bytes unmapped / freed on the device, whole run
  std::uint64_t bytes_taken = 0;       // bytes mapped / allocated on the device, whole run
};

// worker: the release worker on in wait mode too (defer mode always has it).
options cap_options(backend_kind backend, empty_cache_mode mode, bool worker = false) {
  options o = make_options(backend, fence_scope::all_streams, mode);
  o.memory_limit_bytes = k_cap;
  o.release_worker = mode == empty_cache_mode::defer || worker ? release_worker_mode::on
                                                               : release_worker_mode::off;
  return o;
}

// How the host paces the steps.
struct pacing {
  int steps = 4;
  // After each step the test waits for the release worker's pass (false: the next step runs
  // while the worker may still be unmapping, as a program does).
  bool settle = true;
  bool worker = false;  // the release worker on in wait mode too
};

std::uint64_t new_memory(const sim::counters& c) { return c.maps + c.segment_allocs; }

// busy: an unrelated stream (one the allocator has seen) runs long work through every step.
seed_run run_seed(backend_kind backend, empty_cache_mode mode, bool busy, pacing pace = {}) {
  sim::simulated_device dev(sim_config(80 * GiB));
  caching_allocator alloc(dev, cap_options(backend, mode, pace.worker));
  seed_run run;
  auto sample = [&] {
    run.max_reserved_seen = std::max(run.max_reserved_seen, alloc.stats().reserved_bytes.current);
    run.max_in_use = std::max(run.max_in_use, dev.bytes_in_use());
  };
  const auto compute = dev.create_stream();
  const auto side = dev.create_stream();
  const auto other = dev.create_stream();
  void* unrelated = alloc.allocate(2 * MiB, other);  // the allocator knows the unrelated stream
  std::vector<void*> params(k_grads);
  for (auto& p : params) {
    p = alloc.allocate(k_grad, compute);
    dev.launch(compute, 1, {writes(p, k_grad)}, "init");
  }
  sample();
  void* last_grad = nullptr;
  const event_handle done_backward = dev.create_event();
  for (int step = 0; step < pace.steps; ++step) {
    if (busy) dev.launch(other, 400000, {writes(unrelated, 2 * MiB)}, "unrelated long work");
    std::vector<void*> grads(k_grads);
    for (auto& g : grads) {
      g = alloc.allocate(k_grad, side);
      dev.launch(side, 5, {writes(g, k_grad)}, "backward");
      sample();
    }
    dev.record_event(done_backward, side);
    dev.stream_wait_event(compute, done_backward);
    for (int i = 0; i < k_grads; ++i) {
      dev.launch(compute, 70, {reads(grads[i], k_grad), writes(params[i], k_grad)}, "signsgd");
      if (i == 0 && last_grad) {  // the loop variable moves on: last step's gradient goes
        alloc.deallocate(last_grad);
        last_grad = nullptr;
      }
    }
    for (int i = 0; i + 1 < k_grads; ++i) alloc.deallocate(grads[i]);
    last_grad = grads.back();
    alloc.empty_cache();
    sample();
    seed_step s;
    const auto before = new_memory(dev.counters());
    try {
      void* buffer = alloc.allocate(16 * GiB, compute);
      s.fits = true;
      sample();
      dev.launch(compute, 100, {writes(buffer, 16 * GiB)}, "fp8 gather");
      alloc.deallocate(buffer);
    } catch (const out_of_memory& e) {
      s.error = e.what();
    }
    s.new_memory_for_buffer = new_memory(dev.counters()) - before;
    if (step >= 2) run.new_memory_late += new_memory(dev.counters()) - before;
    run.steps.push_back(s);
    dev.advance(50000);  // the rest of the step: the forward pass of the next one
    // The release worker's pass over what completed meanwhile (real time; the simulated clock
    // only moves on the test's calls). A step begun while it is still unmapping can exceed wait
    // mode's peak by the bytes in flight (56 MiB here, seen under CPU load).
    if (pace.settle) alloc.wait_for_release_worker_idle(5s);
    sample();
  }
  if (last_grad) alloc.deallocate(last_grad);
  for (void* p : params) alloc.deallocate(p);
  alloc.deallocate(unrelated);
  dev.run_until_idle();
  alloc.wait_for_release_worker_idle(5s);
  sample();
  const statistics st = alloc.stats();
  run.peak_reserved = st.reserved_bytes.peak;
  run.fence_waits = st.fence_waits;
  run.device_syncs = dev.counters().device_syncs;
  run.faults = dev.fault_count();
  run.pending_after = alloc.pending_release_bytes();
  run.bytes_given_back = dev.counters().bytes_unmapped;
  run.bytes_taken = dev.counters().bytes_mapped;
  alloc.check_invariants();
  dev.destroy_event(done_backward);
  return run;
}

void check_cap(const seed_run& run) {
  for (std::size_t i = 0; i < run.steps.size(); ++i) {
    INFO("step " << i << ": " << run.steps[i].error);
    CHECK(run.steps[i].fits);
  }
  CHECK(run.peak_reserved <= static_cast<std::int64_t>(k_cap));
  CHECK(run.max_reserved_seen <= static_cast<std::int64_t>(k_cap));
  CHECK(run.max_in_use <= k_cap);
  CHECK(run.faults == 0);
  CHECK(run.pending_after == 0);
}

}  // namespace

TEST_CASE("Under a memory cap the seed's buffer fits every step and reserved never passes the cap",
          "[core][release][growth]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  const empty_cache_mode mode = GENERATE(empty_cache_mode::defer, empty_cache_mode::wait);
  INFO(to_string(backend) << ", empty_cache:" << to_string(mode));
  const seed_run run = run_seed(backend, mode, false);
  check_cap(run);
}

TEST_CASE(
    "Expandable, defer mode: the seed's buffer takes the queued gradients by a stream wait, and "
    "the steady state maps nothing new",
    "[core][release][growth][expandable]") {
  const seed_run run = run_seed(backend_kind::expandable, empty_cache_mode::defer, false);
  check_cap(run);
  for (std::size_t i = 1; i < run.steps.size(); ++i) {
    INFO("step " << i);
    CHECK(run.steps[i].new_memory_for_buffer == 0);
  }
  CHECK(run.new_memory_late == 0);
  CHECK(run.fence_waits == 0);  // no host wait
  CHECK(run.device_syncs == 0);
  // The peak of waiting (wait mode, same program).
  const seed_run waited = run_seed(backend_kind::expandable, empty_cache_mode::wait, false);
  INFO("defer peak " << run.peak_reserved << ", wait peak " << waited.peak_reserved);
  CHECK(run.peak_reserved <= waited.peak_reserved);
}

TEST_CASE("Under a memory cap a busy unrelated stream does not make the seed run out of memory",
          "[core][release][growth]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  const empty_cache_mode mode = GENERATE(empty_cache_mode::defer, empty_cache_mode::wait);
  INFO(to_string(backend) << ", empty_cache:" << to_string(mode));
  const seed_run run = run_seed(backend, mode, true);
  check_cap(run);
}

TEST_CASE(
    "Under a memory cap, with the release worker still releasing when the next step begins and a "
    "busy unrelated stream, the seed's buffer fits every step and reserved never passes the cap",
    "[core][release][growth][expandable]") {
  const empty_cache_mode mode = GENERATE(empty_cache_mode::defer, empty_cache_mode::wait);
  const bool busy = GENERATE(true, false);
  for (int round = 0; round < 3; ++round) {  // a race: a few rounds
    INFO("expandable, empty_cache:" << to_string(mode) << (busy ? ", busy unrelated stream" : "")
                                    << ", round " << round);
    pacing pace;
    pace.steps = 6;
    pace.settle = false;
    pace.worker = true;
    check_cap(run_seed(backend_kind::expandable, mode, busy, pace));
  }
}

TEST_CASE(
    "Reserved never counts memory twice: after empty_cache in defer mode and a growth elsewhere, "
    "peak reserved stays within the limit",
    "[core][release][growth]") {
  // 600 MiB freed on one stream and queued behind a running kernel, then 600 MiB asked for on
  // another stream under a 1 GiB limit: the queued memory serves it (a stream wait on its
  // fence), and reserved, its peak and the device's bytes in use stay at or below the limit.
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  const release_worker_mode worker = GENERATE(release_worker_mode::on, release_worker_mode::off);
  INFO(to_string(backend) << ", release_worker " << to_string(worker));
  options o = make_options(backend, fence_scope::all_streams, empty_cache_mode::defer);
  o.release_worker = worker;
  o.memory_limit_bytes = 1 * GiB;
  sim_env env(o, sim_config(8 * GiB));
  const auto s = env.dev.create_stream();
  const auto t = env.dev.create_stream();
  void* a = env.alloc.allocate(600 * MiB, s);
  env.dev.launch(s, 1000, {writes(a, 600 * MiB)}, "optimizer tail");
  env.alloc.deallocate(a);
  env.alloc.empty_cache();
  REQUIRE(env.alloc.pending_release_bytes() == 600 * MiB);
  void* b = nullptr;
  REQUIRE_NOTHROW(b = env.alloc.allocate(600 * MiB, t));
  env.dev.launch(t, 10, {writes(b, 600 * MiB)}, "next step");
  const statistics st = env.alloc.stats();
  CHECK(st.reserved_bytes.peak <= static_cast<std::int64_t>(1 * GiB));
  CHECK(env.dev.bytes_in_use() <= 1 * GiB);
  CHECK(env.alloc.stats().fence_waits == 0);  // a stream wait, not a host wait
  // The release worker (or a later call) gives back only what nobody took: nothing here.
  env.dev.run_until_idle();
  env.alloc.wait_for_release_worker_idle(5s);
  env.alloc.reclaim();
  CHECK(env.alloc.pending_release_bytes() == 0);
  CHECK(env.alloc.stats().reserved_bytes.current == static_cast<std::int64_t>(600 * MiB));
  CHECK(env.dev.bytes_in_use() == 600 * MiB);
  env.alloc.deallocate(b);
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}
