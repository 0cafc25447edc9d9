// A program that empties its cache every step, on the simulated device (both backends): in
// empty_cache:defer mode its steady state maps nothing new and its peak reserved is at or below
// wait mode's, with the release worker on or off and with or without a busy unrelated stream.
//
// Step patterns (sizes in MiB, deliberately not multiples of the chunk size):
//  * fsdp: per layer an all-gather buffer on a side stream used by the compute stream, the
//    layer's activations kept to the backward pass, gradients on the compute stream handed to a
//    reduce-scatter stream, sharded gradients kept to a per-parameter optimizer loop that makes
//    temporaries on the compute stream (AdamW-like), then empty_cache().
//  * plain: a loop of varied allocations on one stream, all freed, then empty_cache().
//  * seed: gradients on a side stream, a per-parameter loop on the compute stream, the last
//    gradient kept alive to the next step, empty_cache(), then one large buffer.
//  * three streams, kv cache: held out (not tuned on), below.
// The host runs ahead of the device: the last step's tail of work (and the busy stream's work,
// when on) is still running while the next step allocates, so the memory empty_cache() queued is
// still waiting for its fence and must be what the next step reuses.
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;
using namespace std::chrono_literals;

namespace {

struct streams {
  stream_handle compute;
  stream_handle gather;
  stream_handle reduce;
  stream_handle unrelated;
};

struct step_env {
  sim::simulated_device& dev;
  caching_allocator& alloc;
  streams s;
  event_handle ev;
  std::vector<void*> carried;  // alive from one step to the next
};

void wait_for(step_env& e, stream_handle waiter, stream_handle producer) {
  e.dev.record_event(e.ev, producer);
  e.dev.stream_wait_event(waiter, e.ev);
}

void fsdp_step(step_env& e, bool adamw) {
  constexpr int layers = 8;
  constexpr std::size_t param = 37 * MiB;
  constexpr std::size_t act = 23 * MiB;
  auto& dev = e.dev;
  auto& a = e.alloc;
  std::vector<void*> acts(layers);
  for (int l = 0; l < layers; ++l) {       // forward
    wait_for(e, e.s.gather, e.s.compute);  // FSDP2: the next all-gather after the last use
    void* gathered = a.allocate(param, e.s.gather);
    dev.launch(e.s.gather, 20, {writes(gathered, param)}, "all-gather");
    wait_for(e, e.s.compute, e.s.gather);
    acts[l] = a.allocate(act, e.s.compute);
    dev.launch(e.s.compute, 40, {reads(gathered, param), writes(acts[l], act)}, "forward");
    a.deallocate(gathered);
  }
  std::vector<void*> sharded(layers);
  for (int l = layers - 1; l >= 0; --l) {  // backward
    wait_for(e, e.s.gather, e.s.compute);  // FSDP2: the next all-gather after the last use
    void* gathered = a.allocate(param, e.s.gather);
    dev.launch(e.s.gather, 20, {writes(gathered, param)}, "all-gather");
    wait_for(e, e.s.compute, e.s.gather);
    wait_for(e, e.s.compute, e.s.reduce);
    void* grad = a.allocate(param, e.s.compute);
    dev.launch(e.s.compute, 80, {reads(gathered, param), reads(acts[l], act), writes(grad, param)},
               "backward");
    a.deallocate(gathered);
    a.deallocate(acts[l]);
    wait_for(e, e.s.reduce, e.s.compute);
    sharded[l] = a.allocate(param, e.s.reduce);
    dev.launch(e.s.reduce, 20, {reads(grad, param), writes(sharded[l], param)}, "reduce-scatter");
    a.deallocate(grad);
  }
  wait_for(e, e.s.compute, e.s.reduce);
  for (int l = 0; l < layers; ++l) {  // optimizer, per parameter
    void* tmp = a.allocate(param, e.s.compute);
    void* tmp2 = adamw ? a.allocate(param, e.s.compute) : nullptr;
    dev.launch(e.s.compute, 10, {reads(sharded[l], param), writes(tmp, param)}, "optimizer");
    a.deallocate(tmp);
    if (tmp2) a.deallocate(tmp2);
    a.deallocate(sharded[l]);
  }
  a.empty_cache();
}

void plain_step(step_env& e) {
  std::vector<void*> live;
  for (std::size_t mib : {3, 41, 7, 130, 12, 66, 1, 90, 25}) {
    void* p = e.alloc.allocate(mib * MiB, e.s.compute);
    e.dev.launch(e.s.compute, 30, {writes(p, mib * MiB)}, "work");
    live.push_back(p);
  }
  for (void* p : live) e.alloc.deallocate(p);
  e.alloc.empty_cache();
}

void seed_step(step_env& e) {
  constexpr int grads = 32;
  constexpr std::size_t grad = 64 * MiB;
  std::vector<void*> g(grads);
  for (auto& p : g) {
    p = e.alloc.allocate(grad, e.s.gather);
    e.dev.launch(e.s.gather, 5, {writes(p, grad)}, "backward");
  }
  wait_for(e, e.s.compute, e.s.gather);
  for (int i = 0; i < grads; ++i) {
    e.dev.launch(e.s.compute, 20, {reads(g[i], grad)}, "signsgd");
    e.alloc.record_stream(g[i], e.s.compute);
    if (i == 0) {
      for (void* p : e.carried) e.alloc.deallocate(p);
      e.carried.clear();
    }
  }
  for (int i = 0; i + 1 < grads; ++i) e.alloc.deallocate(g[i]);
  e.carried.push_back(g.back());
  e.alloc.empty_cache();
  void* buffer = e.alloc.allocate(grads * grad, e.s.compute);
  e.dev.launch(e.s.compute, 50, {writes(buffer, grads * grad)}, "buffer");
  e.alloc.deallocate(buffer);
}

// Patterns the policy was not tuned on: a pipeline over three streams, each allocation ordered
// after the previous stream's work, four alive at a time; a growing cache on the compute stream
// beside a temporary on another stream each token.
void three_stream_step(step_env& e) {
  const stream_handle ss[3] = {e.s.compute, e.s.gather, e.s.reduce};
  std::vector<void*> live;
  const std::size_t sizes[] = {11, 29, 53, 7, 97, 31};
  for (int i = 0; i < 12; ++i) {
    const std::size_t n = sizes[i % 6] * MiB;
    const stream_handle s = ss[i % 3];
    if (i) wait_for(e, s, ss[(i + 2) % 3]);
    void* p = e.alloc.allocate(n, s);
    e.dev.launch(s, 25, {writes(p, n)}, "work");
    live.push_back(p);
    if (live.size() > 4) {
      e.alloc.deallocate(live.front());
      live.erase(live.begin());
    }
  }
  for (void* p : live) e.alloc.deallocate(p);
  e.alloc.empty_cache();
}

void kv_step(step_env& e) {
  std::vector<void*> kv;
  for (int t = 0; t < 10; ++t) {
    kv.push_back(e.alloc.allocate((5 + 3 * t) * MiB, e.s.compute));
    e.dev.launch(e.s.compute, 10, {writes(kv.back(), (5 + 3 * t) * MiB)}, "kv");
    wait_for(e, e.s.gather, e.s.compute);
    void* tmp = e.alloc.allocate(45 * MiB, e.s.gather);
    e.dev.launch(e.s.gather, 10, {writes(tmp, 45 * MiB)}, "attn");
    wait_for(e, e.s.compute, e.s.gather);
    e.alloc.deallocate(tmp);
  }
  for (void* p : kv) e.alloc.deallocate(p);
  e.alloc.empty_cache();
}

struct setting {
  backend_kind backend;
  empty_cache_mode mode;
  bool worker;
  bool busy;
};

struct outcome {
  std::int64_t steady_peak = 0;       // peak reserved over the steady steps
  std::uint64_t steady_new_maps = 0;  // maps + segment allocations over the steady steps
  std::size_t faults = 0;
};

constexpr int k_steps = 6;
constexpr int k_warmup = 2;

outcome run(const setting& st, const std::function<void(step_env&)>& step) {
  options o = make_options(st.backend, fence_scope::all_streams, st.mode);
  o.release_worker = st.worker ? release_worker_mode::on : release_worker_mode::off;
  sim::simulated_device dev(sim_config(16 * GiB));
  caching_allocator alloc(dev, o);
  step_env e{dev,
             alloc,
             {dev.create_stream(), dev.create_stream(), dev.create_stream(), dev.create_stream()},
             dev.create_event(),
             {}};
  void* unrelated = alloc.allocate(2 * MiB, e.s.unrelated);  // a stream the allocator knows
  outcome out;
  std::uint64_t maps_before = 0;
  // Defer mode: the device runs one step behind the host (a hold on the compute stream, opened
  // once the next step has allocated), so the memory a step's empty_cache() queued still waits
  // for its fence while the next step allocates. Wait mode waits for it on the host anyway.
  const bool ahead = st.mode == empty_cache_mode::defer;
  std::uint64_t held = 0;
  bool holding = false;
  for (int i = 0; i < k_steps; ++i) {
    if (i == k_warmup) {
      alloc.reset_peak_stats();
      maps_before = dev.counters().maps + dev.counters().segment_allocs;
    }
    const std::uint64_t next = ahead ? dev.hold(e.s.compute, "the host runs ahead") : 0;
    if (st.busy) dev.launch(e.s.unrelated, 5000, {writes(unrelated, 2 * MiB)}, "unrelated work");
    step(e);
    if (holding) dev.open(held);
    held = next;
    holding = ahead;
    dev.advance(3000);
    if (st.worker) alloc.wait_for_release_worker_idle(5s);
  }
  if (holding) dev.open(held);
  out.steady_peak = alloc.stats().reserved_bytes.peak;
  out.steady_new_maps = dev.counters().maps + dev.counters().segment_allocs - maps_before;
  for (void* p : e.carried) alloc.deallocate(p);
  alloc.deallocate(unrelated);
  dev.run_until_idle();
  alloc.empty_cache(empty_cache_mode::wait);
  out.faults = dev.fault_count();
  alloc.check_invariants();
  dev.destroy_event(e.ev);
  return out;
}

struct pattern {
  const char* name;
  std::function<void(step_env&)> step;
};

const pattern k_patterns[] = {
    // by index below: plain third, three streams fifth, kv cache sixth
    {"fsdp signsgd", [](step_env& e) { fsdp_step(e, false); }},
    {"fsdp adamw", [](step_env& e) { fsdp_step(e, true); }},
    {"plain", plain_step},
    {"seed", seed_step},
    {"three streams", three_stream_step},
    {"kv cache", kv_step},
};

// gap_percent: how far above wait mode's peak defer mode may stay (0: at or below it, and nothing
// mapped anew in steady state); above 0 for the known gaps below, a bound that catches them
// getting worse.
void check_pattern(const pattern& pat, backend_kind backend, bool worker, bool busy,
                   int gap_percent = 0) {
  const outcome waited = run({backend, empty_cache_mode::wait, false, busy}, pat.step);
  const outcome deferred = run({backend, empty_cache_mode::defer, worker, busy}, pat.step);
  INFO(pat.name << ", " << to_string(backend) << ", release worker " << (worker ? "on" : "off")
                << (busy ? ", busy unrelated stream" : "") << ": defer peak "
                << deferred.steady_peak / static_cast<std::int64_t>(MiB) << " MiB, wait peak "
                << waited.steady_peak / static_cast<std::int64_t>(MiB) << " MiB, defer maps "
                << deferred.steady_new_maps << " in steady state");
  CHECK(deferred.steady_peak * 100 <= waited.steady_peak * (100 + gap_percent));
  if (gap_percent == 0) CHECK(deferred.steady_new_maps == 0);
  CHECK(deferred.faults == 0);
  CHECK(waited.faults == 0);
}

}  // namespace

TEST_CASE(
    "empty_cache every step in defer mode: the steady state maps nothing new and peak reserved "
    "is at or below wait mode's",
    "[core][release][growth]") {
  const bool worker = GENERATE(true, false);
  const bool busy = GENERATE(false, true);
  for (int i = 0; i < 5; ++i) check_pattern(k_patterns[i], backend_kind::cuda_malloc, worker, busy);
  check_pattern(k_patterns[2], backend_kind::expandable, worker, busy);  // plain
  check_pattern(k_patterns[4], backend_kind::expandable, worker, busy);  // three streams
}

// Expandable: memory moved between pools by map_alias during a step (idle chunks before a
// growth past the peak) leaves the pools' ranges fragmented, and defer mode's steady state keeps
// 2-8% more reserved than wait mode's and maps a run anew each step (fsdp) or keeps what a growth
// past the peak mapped in the first steps (seed). A growing cache beside temporaries of another
// stream (kv) keeps more than wait mode's peak on both backends. Known gaps, not yet closed:
// measured 2-8% (expandable), 97% (seed, expandable) and 21% (kv cache, cuda_malloc) above wait
// mode; bounded here so that they cannot grow unseen.
TEST_CASE(
    "Expandable, empty_cache every step in defer mode with several streams: peak reserved stays "
    "within the known gap above wait mode's",
    "[core][release][growth]") {
  const bool worker = GENERATE(true, false);
  const bool busy = GENERATE(false, true);
  for (const pattern& pat : k_patterns) {
    if (&pat == &k_patterns[3]) continue;  // seed: below
    check_pattern(pat, backend_kind::expandable, worker, busy, /*gap_percent=*/10);
  }
  // seed: wait mode waits on the gradients' record_stream uses and gives their memory back
  // (2118 MiB); defer mode leaves those pending blocks to a later reclaim(), which the step never
  // calls, so it keeps them (4178 MiB, 97% above): a known gap, bounded.
  check_pattern(k_patterns[3], backend_kind::expandable, worker, busy, /*gap_percent=*/100);
  check_pattern(k_patterns[5], backend_kind::cuda_malloc, worker, busy, /*gap_percent=*/25);
}
