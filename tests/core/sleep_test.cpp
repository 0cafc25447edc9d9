// Sleep and wake (core/sleep.hpp, sleep.cpp) on the simulated device: tags, pause in discard
// and offload mode, resume at the same addresses, hooks, per-tag empty_cache and trim. Each
// safety property has a control that breaks it with the unsafe fence scope
// (allocation_stream), so that the check is seen to fail where the fence is missing.
#include "support/forwarding_device.hpp"
#include "support/sim_faults.hpp"
#include "support/sim_fixture.hpp"
#include "support/tagged_blocks.hpp"

#include <catch2/catch.hpp>

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <map>
#include <stdexcept>
#include <thread>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;
using namespace std::chrono_literals;

namespace {

// The control of a fence that misses a stream: the unmap ran under the work queued behind
// `hold`, and the device saw it. Lets the device run dry.
void check_unmapped_under_held_work(sim_env& env, std::uint64_t hold) {
  CHECK(count_faults(env.dev, sim::fault_kind::release_under_pending_work) > 0);
  env.dev.open(hold);
  env.dev.run_until_idle();
}

}  // namespace

TEST_CASE("Tags: memory allocated under a tag_scope comes from the tag's own segments",
          "[core][sleep]") {
  sim_env env(sleep_options());
  const auto s = env.dev.create_stream();
  void* untagged = env.alloc.allocate(1 * MiB, s);
  void* tagged = nullptr;
  {
    tag_scope outer("kv_cache");
    CHECK(tag_scope::current() == tag_of("kv_cache"));
    tagged = env.alloc.allocate(1 * MiB, s);
    {
      tag_scope none(tag_id{0});
      void* plain = env.alloc.allocate(1 * MiB, s);
      env.alloc.deallocate(plain);
    }
    CHECK(tag_scope::current() == tag_of("kv_cache"));
  }
  CHECK(tag_scope::current() == 0);
  CHECK(tag_name(tag_of("kv_cache")) == "kv_cache");
  // Different segments: the untagged block never shares a segment with the tagged one.
  const memory_snapshot snap = env.alloc.snapshot();
  std::string tag_of_untagged = "?", tag_of_tagged = "?";
  for (const auto& seg : snap.segments) {
    for (const auto& b : seg.blocks) {
      if (b.address == addr(untagged)) tag_of_untagged = seg.tag;
      if (b.address == addr(tagged)) tag_of_tagged = seg.tag;
    }
  }
  CHECK(tag_of_untagged.empty());
  CHECK(tag_of_tagged == "kv_cache");
  CHECK(env.alloc.tag_status("kv_cache").allocated_bytes == 1 * MiB);
  CHECK_THROWS_AS(tag_of(""), config_error);
  CHECK_THROWS_AS(tag_of(std::string(65, 'x')), config_error);
  CHECK_THROWS_AS(tag_of("bad\nname"), config_error);
  env.alloc.deallocate(untagged);
  env.alloc.deallocate(tagged);
  env.alloc.check_invariants();
}

TEST_CASE("pause(discard) gives a tag's chunks back only after a side stream's pending read",
          "[core][sleep]") {
  const bool unsafe = GENERATE(false, true);
  CAPTURE(unsafe);
  sim_env env(sleep_options(unsafe ? fence_scope::allocation_stream : fence_scope::all_streams,
                            empty_cache_mode::defer));
  const auto s = env.dev.create_stream();
  const auto side = env.dev.create_stream();
  void* other = env.alloc.allocate(8 * MiB, s);  // untagged: must stay mapped
  const tagged_blocks t = allocate_tagged(env.alloc, env.dev, s, 3);
  env.alloc.record_stream(other, side);  // the allocator knows the side stream
  // The SignSGD tail: a read of the gradients on the side stream, still queued.
  const auto hold = env.dev.hold(side);
  env.dev.launch(side, 10, {reads(t.grads, 3 * MiB), reads(t.weights, 48 * MiB)}, "sign tail");
  const std::size_t reserved_before = env.alloc.stats().reserved_bytes.current;

  const pause_status st = env.alloc.pause("train", pause_mode::discard);
  if (unsafe) {
    // The fence covers only the allocation stream: the unmap runs under the pending read.
    check_unmapped_under_held_work(env, hold);
    return;
  }
  CHECK(st.phase == tag_phase::pausing);
  CHECK(st.pending_bytes >= 51 * MiB);
  CHECK(env.dev.is_mapped(addr(t.weights), 48 * MiB));
  {
    tag_scope scope("train");
    CHECK_THROWS_AS(env.alloc.allocate(1 * MiB, s), tag_paused);
  }
  void* plain = env.alloc.allocate(1 * MiB, s);  // untagged memory is not affected
  env.dev.open(hold);
  env.dev.run_until_idle();
  const pause_status done = env.alloc.tag_status("train");  // moves the deferred pause along
  CHECK(done.phase == tag_phase::paused);
  CHECK(done.pending_bytes == 0);
  CHECK(done.reserved_bytes == 0);
  CHECK(done.allocated_bytes >= 51 * MiB);  // live blocks stay allocated, pointers valid
  CHECK_FALSE(env.dev.is_mapped(addr(t.weights), 1));
  CHECK(env.dev.is_mapped(addr(other), 8 * MiB));
  CHECK(env.alloc.stats().reserved_bytes.current <=
        static_cast<std::int64_t>(reserved_before - 51 * MiB + 2 * MiB));
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();

  const pause_status back = env.alloc.resume("train");
  CHECK(back.phase == tag_phase::active);
  CHECK(env.dev.is_mapped(addr(t.weights), 48 * MiB));
  CHECK(env.dev.is_mapped(addr(t.grads), 3 * MiB));
  CHECK_FALSE(env.dev.value_at(addr(t.weights)).has_value());  // discard: contents lost
  {
    tag_scope scope("train");
    void* more = env.alloc.allocate(1 * MiB, s);
    env.alloc.deallocate(more);
  }
  env.dev.launch(s, 1, {writes(t.weights, 48 * MiB, 1)}, "use after resume");
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  env.alloc.deallocate(plain);
  env.alloc.deallocate(other);
  env.alloc.deallocate(t.weights);
  env.alloc.deallocate(t.grads);
  env.alloc.check_invariants();
}

TEST_CASE("pause(offload) copies after the pending write and resume restores before new work",
          "[core][sleep]") {
  const bool unsafe = GENERATE(false, true);
  CAPTURE(unsafe);
  sim_env env(sleep_options(unsafe ? fence_scope::allocation_stream : fence_scope::all_streams,
                            empty_cache_mode::defer));
  const auto s = env.dev.create_stream();
  const auto side = env.dev.create_stream();
  const tagged_blocks t = allocate_tagged(env.alloc, env.dev, s, 3);
  env.alloc.record_stream(t.grads, side);
  // A write of 9 over the weights on the side stream, pending at the pause.
  const auto hold = env.dev.hold(side);
  env.dev.launch(side, 10, {writes(t.weights, 48 * MiB, 9)}, "last optimizer write");
  env.alloc.pause("train", pause_mode::offload);
  CHECK(env.dev.host_bytes_in_use() >= 48 * MiB);
  env.dev.open(hold);
  env.dev.run_until_idle();
  if (unsafe) {
    // The copy stream was not ordered after the side stream: the copy raced the write.
    CHECK(count_faults(env.dev, sim::fault_kind::cross_stream_race) > 0);
    return;
  }
  CHECK(env.alloc.tag_status("train").phase == tag_phase::paused);
  CHECK(env.alloc.tag_status("train").offloaded_host_bytes >= 48 * MiB);
  CHECK_FALSE(env.dev.is_mapped(addr(t.weights), 1));
  env.alloc.resume("train");
  // Work on the owner stream after resume is ordered after the restore: no race, sees 9.
  env.dev.launch(s, 1, {reads(t.weights, 48 * MiB)}, "forward");
  CHECK(env.dev.fault_count() == 0);
  // A stream the resume did not order races the restore (the caller's job: resume(tag, stream)).
  const auto unordered = env.dev.create_stream();
  env.dev.launch(unordered, 1, {writes(t.weights, 4096, 5)}, "unordered write");
  CHECK(count_faults(env.dev, sim::fault_kind::cross_stream_race) > 0);
  env.dev.run_until_idle();
  env.dev.clear_faults();
  CHECK(env.dev.value_at(addr(t.weights) + 4096) == std::optional<std::uint8_t>(9));
  CHECK(env.dev.value_at(addr(t.weights) + 48 * MiB - 1) == std::optional<std::uint8_t>(9));
  CHECK(env.alloc.tag_status("train").offloaded_host_bytes == 0);
  // The ordered variant: resume(tag, stream) makes that stream wait for the restore.
  env.alloc.pause("train", pause_mode::offload, empty_cache_mode::wait);
  env.alloc.resume("train", unordered);
  env.dev.launch(unordered, 1, {reads(t.weights, 48 * MiB)}, "ordered read");
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  CHECK(env.dev.value_at(addr(t.weights) + 8192) == std::optional<std::uint8_t>(9));
  env.alloc.deallocate(t.weights);
  env.alloc.deallocate(t.grads);
  CHECK(env.alloc.release_host_cache() >= 48 * MiB);
  CHECK(env.dev.host_bytes_in_use() == 0);
  env.alloc.check_invariants();
}

TEST_CASE("pause in wait mode returns with everything back; frees during the pause work",
          "[core][sleep]") {
  sim_env env(sleep_options());
  const auto s = env.dev.create_stream();
  const auto side = env.dev.create_stream();
  const tagged_blocks t = allocate_tagged(env.alloc, env.dev, s, 4);
  env.alloc.record_stream(t.grads, side);
  env.dev.launch(side, 50, {reads(t.grads, 3 * MiB)}, "tail");
  const pause_status st = env.alloc.pause("train", pause_mode::discard);
  CHECK(st.phase == tag_phase::paused);
  CHECK(st.reserved_bytes == 0);
  CHECK(st.released_bytes >= 51 * MiB);
  CHECK(env.dev.fault_count() == 0);
  // Pausing twice is a no-op; a free of a paused block works and it is reusable after resume.
  CHECK(env.alloc.pause("train", pause_mode::discard).phase == tag_phase::paused);
  env.alloc.deallocate(t.grads);
  env.alloc.check_invariants();
  CHECK(env.alloc.resume("train").phase == tag_phase::active);
  CHECK(env.alloc.resume("train").phase == tag_phase::active);  // twice: a no-op
  {
    tag_scope scope("train");
    void* again = env.alloc.allocate(3 * MiB, s);
    CHECK(env.dev.is_mapped(addr(again), 3 * MiB));
    env.alloc.deallocate(again);
  }
  env.alloc.deallocate(t.weights);
  CHECK(env.alloc.resume("never_used").phase == tag_phase::active);
  CHECK(env.alloc.pause("never_used", pause_mode::discard).phase == tag_phase::paused);
  CHECK(env.alloc.resume("never_used").phase == tag_phase::active);
  CHECK_THROWS_AS(env.alloc.pause("", pause_mode::discard), config_error);
  env.alloc.check_invariants();
}

TEST_CASE("pause is refused where it cannot be safe or cannot keep addresses",
          "[core][sleep][bad-input]") {
  SECTION("cuda_malloc backend") {
    sim_env env(make_options(backend_kind::cuda_malloc));
    CHECK_THROWS_AS(env.alloc.pause("train", pause_mode::discard), config_error);
  }
  SECTION("inside a stream callback") {
    sim_env env(sleep_options());
    callback_scope cb;
    CHECK_THROWS_AS(env.alloc.pause("train", pause_mode::discard), std::logic_error);
    CHECK_THROWS_AS(env.alloc.resume("train"), std::logic_error);
  }
  SECTION("during a graph capture") {
    sim_env env(sleep_options());
    const auto s = env.dev.create_stream();
    {
      tag_scope scope("train");
      env.alloc.deallocate(env.alloc.allocate(1 * MiB, s));
    }
    env.alloc.notify_capture_begin(s);
    CHECK_THROWS_AS(env.alloc.pause("train", pause_mode::discard), std::logic_error);
    env.alloc.notify_capture_end(s);
    CHECK(env.alloc.pause("train", pause_mode::discard).phase == tag_phase::paused);
    env.alloc.resume("train");
  }
}

TEST_CASE("Sleep hooks see every range before its unmap and after its map", "[core][sleep]") {
  sim_env env(sleep_options());
  const auto s = env.dev.create_stream();
  const tagged_blocks t = allocate_tagged(env.alloc, env.dev, s, 1);
  std::vector<sleep_hook_event> seen;
  sim::simulated_device* dev = &env.dev;
  bool mapped_at_before = true, mapped_at_after = true;
  env.alloc.set_sleep_hook([&](const sleep_hook_event& e) {
    seen.push_back(e);
    const bool m = dev->is_mapped(e.address, e.size_bytes);
    if (e.what == sleep_hook_event::kind::before_unmap) mapped_at_before = mapped_at_before && m;
    if (e.what == sleep_hook_event::kind::after_map) mapped_at_after = mapped_at_after && m;
    if (seen.size() == 1) throw std::runtime_error("a hook that throws is logged and ignored");
  });
  env.alloc.pause("train", pause_mode::discard);
  env.alloc.resume("train");
  std::size_t before = 0, after = 0;
  for (const auto& e : seen) {
    CHECK(e.tag == "train");
    (e.what == sleep_hook_event::kind::before_unmap ? before : after) += e.size_bytes;
  }
  CHECK(before >= 51 * MiB);
  CHECK(after == before);
  CHECK(mapped_at_before);
  CHECK(mapped_at_after);
  env.alloc.deallocate(t.weights);
  env.alloc.deallocate(t.grads);
}

TEST_CASE("The release worker makes a deferred pause off the caller's thread",
          "[core][sleep][worker]") {
  class unmap_watch final : public forwarding_device {
   public:
    explicit unmap_watch(sim::simulated_device& d)
        : forwarding_device(d), home_(std::this_thread::get_id()) {}
    void unmap(void* p, std::size_t n) override {
      (std::this_thread::get_id() == home_ ? home_calls : other_calls).fetch_add(1);
      dev_.unmap(p, n);
    }
    std::atomic<int> home_calls{0}, other_calls{0};

   private:
    std::thread::id home_;
  };
  sim::simulated_device dev(sim_config());
  unmap_watch watch(dev);
  options o = sleep_options(fence_scope::all_streams, empty_cache_mode::defer);
  o.release_worker = release_worker_mode::on;
  caching_allocator alloc(watch, o);
  const auto s = dev.create_stream();
  const tagged_blocks t = allocate_tagged(alloc, dev, s, 2);
  const auto hold = dev.hold(s);
  const pause_status st = alloc.pause("train", pause_mode::offload);
  CHECK(st.phase == tag_phase::pausing);
  std::this_thread::sleep_for(5ms);
  CHECK(dev.is_mapped(addr(t.weights), 48 * MiB));  // the hold keeps the fence pending
  dev.open(hold);
  dev.run_until_idle();
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (alloc.tag_status("train").phase != tag_phase::paused &&
         std::chrono::steady_clock::now() < until) {
    dev.run_until_idle();  // the offload copy the worker enqueued
    std::this_thread::sleep_for(1ms);
  }
  CHECK(alloc.tag_status("train").phase == tag_phase::paused);
  CHECK(watch.home_calls == 0);
  CHECK(watch.other_calls > 0);
  // resume_async: the worker maps and restores; wait_resumed says when; then s is ordered.
  const pause_status r = alloc.resume_async("train");
  CHECK((r.phase == tag_phase::resuming || r.phase == tag_phase::active));
  const pause_status done = alloc.wait_resumed("train", 5s);
  CHECK(done.phase == tag_phase::active);
  CHECK(done.error.empty());
  CHECK(dev.is_mapped(addr(t.weights), 48 * MiB));
  dev.launch(s, 1, {reads(t.weights, 48 * MiB)}, "after wait_resumed");
  dev.run_until_idle();
  CHECK(dev.value_at(addr(t.weights)) == std::optional<std::uint8_t>(2));
  CHECK(dev.fault_count() == 0);
  {
    tag_scope scope("train");
    alloc.deallocate(alloc.allocate(1 * MiB, s));
  }
  alloc.deallocate(t.weights);
  alloc.deallocate(t.grads);
}

TEST_CASE("resume_async without a worker is resume on the caller's thread",
          "[core][sleep][worker]") {
  sim_env env(sleep_options());
  const auto s = env.dev.create_stream();
  const tagged_blocks t = allocate_tagged(env.alloc, env.dev, s, 6);
  env.alloc.pause("train", pause_mode::offload);
  CHECK(env.alloc.resume_async("train", s).phase == tag_phase::active);
  CHECK(env.alloc.wait_resumed("train", 1s).phase == tag_phase::active);
  env.dev.launch(s, 1, {reads(t.weights, 48 * MiB)}, "use");
  env.dev.run_until_idle();
  CHECK(env.dev.value_at(addr(t.weights)) == std::optional<std::uint8_t>(6));
  CHECK(env.dev.fault_count() == 0);
  env.alloc.deallocate(t.weights);
  env.alloc.deallocate(t.grads);
}

TEST_CASE("resume out of memory keeps the tag paused; a later resume completes it",
          "[core][sleep]") {
  sim_env env(sleep_options(), sim_config(512 * MiB));
  const auto s = env.dev.create_stream();
  void* big = nullptr;
  {
    tag_scope scope("kv");
    big = env.alloc.allocate(300 * MiB, s);
  }
  env.alloc.pause("kv", pause_mode::discard);
  void* squatter = env.alloc.allocate(300 * MiB, s);  // the memory the tag gave back
  CHECK_THROWS_AS(env.alloc.resume("kv"), out_of_memory);
  CHECK(env.alloc.tag_status("kv").phase == tag_phase::paused);
  CHECK_FALSE(env.dev.is_mapped(addr(big), 1));
  env.alloc.check_invariants();
  env.alloc.deallocate(squatter);
  env.alloc.empty_cache();
  CHECK(env.alloc.resume("kv").phase == tag_phase::active);
  CHECK(env.dev.is_mapped(addr(big), 300 * MiB));
  env.alloc.deallocate(big);
  env.alloc.check_invariants();
}

TEST_CASE("empty_cache(tag) releases only that tag's free memory; trim keeps what is asked",
          "[core][sleep]") {
  sim_env env(sleep_options());
  const auto s = env.dev.create_stream();
  void* a = nullptr;
  void* b = nullptr;
  {
    tag_scope scope("kv");
    a = env.alloc.allocate(100 * MiB, s);
  }
  b = env.alloc.allocate(100 * MiB, s);
  env.alloc.deallocate(a);
  env.alloc.deallocate(b);
  const auto reserved = env.alloc.stats().reserved_bytes.current;
  const std::size_t released = env.alloc.empty_cache("kv");
  CHECK(released >= 100 * MiB);
  CHECK(env.alloc.stats().reserved_bytes.current == reserved - static_cast<std::int64_t>(released));
  CHECK(env.alloc.tag_status("kv").reserved_bytes == 0);
  CHECK(env.alloc.stats().reserved_bytes.current >= static_cast<std::int64_t>(100 * MiB));
  // trim: keep at most 40 MiB of free reserved memory.
  env.alloc.trim(40 * MiB);
  const statistics st = env.alloc.stats();
  CHECK(st.reserved_bytes.current - st.allocated_bytes.current <=
        static_cast<std::int64_t>(40 * MiB));
  CHECK(env.alloc.trim(40 * MiB) == 0);
  env.alloc.check_invariants();
}

TEST_CASE("Destroying the allocator with a tag paused or pausing is clean", "[core][sleep]") {
  sim::simulated_device dev(sim_config());
  const auto s = dev.create_stream();
  {
    caching_allocator alloc(dev, sleep_options(fence_scope::all_streams, empty_cache_mode::defer));
    const tagged_blocks t = allocate_tagged(alloc, dev, s, 1);
    alloc.pause("train", pause_mode::offload, empty_cache_mode::wait);
    {
      tag_scope scope("kv");
      alloc.allocate(10 * MiB, s);
    }
    dev.launch(s, 100, {}, "busy");
    alloc.pause("kv", pause_mode::discard);  // pending at destruction
    (void)t;
  }
  dev.run_until_idle();
  CHECK(dev.fault_count() == 0);
  CHECK(dev.host_bytes_in_use() == 0);
}

// PyTorch's empty_cache() leaves a live MemPool's cache alone (a MemPool outside a capture is a
// tag in the extension): empty_cache_untagged releases the untagged cache only.
TEST_CASE("empty_cache_untagged releases untagged cached memory and leaves every tag's",
          "[core][sleep]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  options o = make_options(backend, fence_scope::all_streams, empty_cache_mode::wait);
  o.release_worker = release_worker_mode::off;
  sim_env env(o);
  const auto s = env.dev.create_stream();
  void* a = nullptr;
  {
    tag_scope scope("pool");
    a = env.alloc.allocate(64 * MiB, s);
  }
  void* b = env.alloc.allocate(64 * MiB, s);
  env.alloc.deallocate(a);
  env.alloc.deallocate(b);
  const std::size_t released = env.alloc.empty_cache_untagged();
  CHECK(released >= 64 * MiB);
  CHECK(env.alloc.tag_status("pool").reserved_bytes >= 64 * MiB);
  CHECK(env.alloc.empty_cache_untagged() == 0);
  CHECK(env.alloc.empty_cache("pool") >= 64 * MiB);
  CHECK(env.alloc.stats().reserved_bytes.current == 0);
  env.alloc.check_invariants();
}

TEST_CASE(
    "A graph captured under a tag: its private pool is the tag's; pause(discard) gives it "
    "back behind queued replays on any stream and resume keeps the graph valid",
    "[core][sleep][graph]") {
  // The decode step of a generation engine: captured once under the engine's tag, replayed on
  // the engine's stream; the engine sleeps with replays still queued and wakes to replay the
  // same graph at the same addresses. The graph writes its scratch before it reads it, so
  // discard loses nothing the graph needs.
  const fence_scope scope = GENERATE(fence_scope::all_streams, fence_scope::used_streams,
                                     fence_scope::allocation_stream);
  const bool unsafe = scope == fence_scope::allocation_stream;
  CAPTURE(static_cast<int>(scope));
  sim_env env(sleep_options(scope, empty_cache_mode::defer));
  const auto s = env.dev.create_stream();    // where the engine replays
  const auto cap = env.dev.create_stream();  // where it captured
  void* untagged = env.alloc.allocate(8 * MiB, s);
  std::uint64_t graph = 0;
  void* scratch = nullptr;
  {
    tag_scope tag("eng_graph");
    env.alloc.notify_capture_begin(cap);
    env.dev.begin_capture(cap);
    scratch = env.alloc.allocate(32 * MiB, cap);  // a workspace, the step's intermediates
    env.dev.launch(cap, 10, {writes(scratch, 32 * MiB, 0x5A), reads(scratch, 32 * MiB)},
                   "decode step");
    graph = env.dev.end_capture(cap);
    env.alloc.notify_capture_end(cap);
  }
  CHECK(env.alloc.tag_status("eng_graph").reserved_bytes >= 32 * MiB);
  const auto hold = env.dev.hold(s);
  env.dev.launch_graph(graph, s);  // still queued at the pause
  const pause_status st = env.alloc.pause("eng_graph", pause_mode::discard);
  if (unsafe) {
    // The fence covers only the capturing stream: the unmap runs under the queued replay.
    check_unmapped_under_held_work(env, hold);
    return;
  }
  CHECK(st.phase == tag_phase::pausing);
  CHECK(env.dev.is_mapped(addr(scratch), 32 * MiB));
  env.dev.open(hold);
  env.dev.run_until_idle();
  CHECK(env.alloc.tag_status("eng_graph").phase == tag_phase::paused);
  CHECK_FALSE(env.dev.is_mapped(addr(scratch), 1));
  CHECK(env.dev.is_mapped(addr(untagged), 8 * MiB));
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();

  env.alloc.resume("eng_graph");
  CHECK(env.dev.is_mapped(addr(scratch), 32 * MiB));
  env.dev.launch_graph(graph, s);  // the same graph, the same addresses
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  INFO(fault_text(env.dev));
  CHECK(env.dev.value_at(addr(scratch)) == std::optional<std::uint8_t>(0x5A));
  env.alloc.deallocate(scratch);
  env.alloc.deallocate(untagged);
  env.alloc.check_invariants();
}

namespace {

// Exports as the CUDA expandable backend does: with a descriptor of the physical memory (here a
// memfd standing for it), which keeps that memory alive while it is open.
class fd_exporting_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  ipc_memory export_memory(std::uintptr_t segment_base, std::size_t segment_bytes,
                           std::uintptr_t addr, std::size_t size_bytes) override {
    ipc_memory m = dev_.export_memory(segment_base, segment_bytes, addr, size_bytes);
    last_fd = ::memfd_create("streamsafe-test-export", MFD_CLOEXEC);
    REQUIRE(last_fd >= 0);
    m.fds.push_back(last_fd);
    return m;
  }
  int last_fd = -1;
};

// The inode a descriptor names, 0 if it is not open.
ino_t inode_of(int fd) {
  struct ::stat st {};
  return ::fstat(fd, &st) == 0 ? st.st_ino : 0;
}

}  // namespace

TEST_CASE("pause gives exported memory back: the exports' descriptors no longer hold it",
          "[core][sleep][ipc]") {
  // A trainer hands its weights to an engine by CUDA IPC each step, then sleeps. The export's
  // descriptors of the weights' physical memory would keep that memory alive after the pause
  // (the driver frees it only once every descriptor is closed): one copy of the weights leaked
  // per step. The pause retires them; the number stays taken, so a late import of the old handle
  // fails instead of reaching other memory.
  sim::simulated_device dev(sim_config());
  fd_exporting_device be(dev);
  caching_allocator alloc(be, sleep_options());
  const auto s = dev.create_stream();
  void* w = nullptr;
  {
    tag_scope scope("train");
    w = alloc.allocate(48 * MiB, s);
  }
  (void)alloc.export_block(w);
  const int fd = be.last_fd;
  REQUIRE(fd >= 0);
  const ino_t memory = inode_of(fd);
  alloc.pause("train", pause_mode::offload);
  CHECK(alloc.tag_status("train").phase == tag_phase::paused);
  CHECK(inode_of(fd) != 0);                // the number stays taken
  CHECK(inode_of(fd) != memory);           // but no longer names the memory
  CHECK(alloc.ipc_status().exports == 1);  // the export itself ends by the protocol
  alloc.resume("train");
  CHECK(alloc.revoke_exports(w) == 1);
  alloc.deallocate(w);
  alloc.check_invariants();
}

namespace {

class copy_counting_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  void copy_async(void* dst, const void* src, std::size_t bytes, stream_handle stream) override {
    ++copies;
    dev_.copy_async(dst, src, bytes, stream);
  }
  int copies = 0;
};

}  // namespace

TEST_CASE("offload copies adjacent live blocks as one range, out and back", "[core][sleep]") {
  // An optimizer's state: many tensors side by side in the tag's segment. One copy per
  // contiguous range of live blocks, not one per block: fewer driver calls at pause and resume.
  sim::simulated_device dev(sim_config());
  copy_counting_device be(dev);
  caching_allocator alloc(be, sleep_options());
  const auto s = dev.create_stream();
  std::vector<void*> state;
  {
    tag_scope scope("optim");
    for (int i = 0; i < 8; ++i) state.push_back(alloc.allocate(4 * MiB, s));
  }
  for (std::size_t i = 0; i < state.size(); ++i) {
    REQUIRE(addr(state[i]) == addr(state[0]) + i * 4 * MiB);  // side by side
    dev.launch(s, 1, {writes(state[i], 4 * MiB, static_cast<std::uint8_t>(i + 1))}, "init");
  }
  dev.run_until_idle();
  alloc.pause("optim", pause_mode::offload);
  CHECK(be.copies == 1);
  CHECK(alloc.tag_status("optim").offloaded_host_bytes == 32 * MiB);
  alloc.resume("optim");
  CHECK(be.copies == 2);
  dev.run_until_idle();
  for (std::size_t i = 0; i < state.size(); ++i) {
    CHECK(dev.value_at(addr(state[i]) + 4 * MiB - 1) ==
          std::optional<std::uint8_t>(static_cast<std::uint8_t>(i + 1)));
  }
  CHECK(dev.fault_count() == 0);
  for (void* p : state) alloc.deallocate(p);
  alloc.check_invariants();
}

namespace {

// Counts the physical handles a GPU backend would create and release: one per map call, and
// each unmap gives back every handle mapped inside its range (one cuMemUnmap and one
// cuMemRelease each on the GPU, whatever the call covers).
class handle_counting_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  bool map(void* addr, std::size_t size_bytes) override {
    const bool ok = dev_.map(addr, size_bytes);
    if (ok) {
      ++maps;
      handles[reinterpret_cast<std::uintptr_t>(addr)] = size_bytes;
    }
    return ok;
  }
  void unmap(void* addr, std::size_t size_bytes) override {
    dev_.unmap(addr, size_bytes);
    const auto lo = reinterpret_cast<std::uintptr_t>(addr);
    const auto from = handles.lower_bound(lo);
    const auto to = handles.lower_bound(lo + size_bytes);
    unmaps += static_cast<int>(std::distance(from, to));
    handles.erase(from, to);
  }
  void reset() { maps = unmaps = 0; }
  int maps = 0;
  int unmaps = 0;
  std::map<std::uintptr_t, std::size_t> handles;
};

}  // namespace

TEST_CASE("A resumed tag is mapped in handles sized to it: a switch is a few driver calls",
          "[core][sleep]") {
  // 40 x 25 MiB of weights, grown chunk by chunk (80 handles: each growth maps what its request
  // lacks, 26 or 24 MiB, as a 20 MiB chunk and the rest). The first pause gives those
  // back; the resume maps the tag in handles of up to expandable_tag_handle_mb, and every later
  // pause and resume makes that many calls, not one per 20 MiB. A free stretch of the tag's
  // cache stays a handle of its own, which empty_cache(tag) gives back whole.
  const pause_mode mode = GENERATE(pause_mode::discard, pause_mode::offload);
  CAPTURE(static_cast<int>(mode));
  sim::simulated_device dev(sim_config(8 * GiB));
  handle_counting_device be(dev);
  options o = sleep_options();
  o.expandable_tag_handle_bytes = 512 * MiB;
  caching_allocator alloc(be, o);
  const auto s = dev.create_stream();
  std::vector<void*> w;
  {
    tag_scope scope("weights");
    for (int i = 0; i < 40; ++i) w.push_back(alloc.allocate(25 * MiB, s));
  }
  for (std::size_t i = 0; i < w.size(); ++i)
    dev.launch(s, 1, {writes(w[i], 25 * MiB, static_cast<std::uint8_t>(i + 1))}, "init");
  for (std::size_t i = 30; i < w.size(); ++i) alloc.deallocate(w[i]);  // 250 MiB of free cache
  dev.run_until_idle();
  const std::size_t first_unmaps = [&] {
    be.reset();
    alloc.pause("weights", mode);
    return static_cast<std::size_t>(be.unmaps);
  }();
  CHECK(first_unmaps == 80);  // the growth's chunks
  be.reset();
  alloc.resume("weights");
  // 750 MiB holding live blocks in two handles of up to 512 MiB, 250 MiB of free cache in one.
  CHECK(be.maps == 3);
  for (int cycle = 0; cycle < 2; ++cycle) {
    be.reset();
    alloc.pause("weights", mode);
    CHECK(be.unmaps == 3);
    alloc.resume("weights");
    CHECK(be.maps == 3);
  }
  dev.run_until_idle();
  if (mode == pause_mode::offload) {
    for (std::size_t i = 0; i < 30; ++i) {
      CHECK(dev.value_at(addr(w[i]) + 25 * MiB - 1) ==
            std::optional<std::uint8_t>(static_cast<std::uint8_t>(i + 1)));
    }
  }
  // Partial release: the free stretch goes back whole; the stretches holding live blocks stay.
  be.reset();
  CHECK(alloc.empty_cache("weights") == 250 * MiB);
  CHECK(be.unmaps == 1);
  alloc.check_invariants();
  // A live block freed inside a large handle: nothing goes back until the handle is free.
  alloc.deallocate(w[0]);
  CHECK(alloc.empty_cache("weights") == 0);
  for (std::size_t i = 1; i < 30; ++i) alloc.deallocate(w[i]);
  CHECK(alloc.empty_cache("weights") == 750 * MiB);
  CHECK(alloc.tag_status("weights").reserved_bytes == 0);
  CHECK(dev.fault_count() == 0);
  alloc.check_invariants();
}

TEST_CASE("offload_keep_host: the pinned backup stays between switches, or goes back at resume",
          "[core][sleep]") {
  const bool keep = GENERATE(true, false);
  CAPTURE(keep);
  sim::simulated_device dev(sim_config());
  options o = sleep_options();
  o.offload_keep_host = keep;
  caching_allocator alloc(dev, o);
  const auto s = dev.create_stream();
  void* weights = nullptr;
  {
    tag_scope scope("weights");
    weights = alloc.allocate(64 * MiB, s);
  }
  for (int cycle = 0; cycle < 2; ++cycle) {
    dev.launch(s, 1, {writes(weights, 64 * MiB, static_cast<std::uint8_t>(cycle + 7))}, "step");
    alloc.pause("weights", pause_mode::offload);
    CHECK(dev.host_bytes_in_use() >= 64 * MiB);  // the backup
    alloc.resume("weights");
    dev.launch(s, 1, {reads(weights, 64 * MiB)}, "use");
    dev.run_until_idle();
    CHECK(dev.value_at(addr(weights) + 64 * MiB - 1) ==
          std::optional<std::uint8_t>(static_cast<std::uint8_t>(cycle + 7)));
    if (keep) {
      CHECK(dev.host_bytes_in_use() >= 64 * MiB);  // pinned once, reused by the next pause
    } else {
      CHECK(dev.host_bytes_in_use() <= 64 * MiB / 100);  // under 1% of the backup
    }
  }
  CHECK(dev.fault_count() == 0);
  alloc.deallocate(weights);
  alloc.check_invariants();
}

TEST_CASE("offload_keep_host:False with the release worker: the backup goes back off the caller",
          "[core][sleep][worker]") {
  sim::simulated_device dev(sim_config());
  options o = sleep_options(fence_scope::all_streams, empty_cache_mode::defer);
  o.release_worker = release_worker_mode::on;
  o.offload_keep_host = false;
  caching_allocator alloc(dev, o);
  const auto s = dev.create_stream();
  void* weights = nullptr;
  {
    tag_scope scope("weights");
    weights = alloc.allocate(64 * MiB, s);
  }
  dev.launch(s, 1, {writes(weights, 64 * MiB, 9)}, "step");
  alloc.pause("weights", pause_mode::offload);
  auto until = std::chrono::steady_clock::now() + 5s;
  while (alloc.tag_status("weights").phase != tag_phase::paused &&
         std::chrono::steady_clock::now() < until) {
    dev.run_until_idle();  // the offload copy the worker enqueued
    std::this_thread::sleep_for(1ms);
  }
  REQUIRE(alloc.tag_status("weights").phase == tag_phase::paused);
  CHECK(dev.host_bytes_in_use() >= 64 * MiB);
  alloc.resume("weights", s);  // on this thread; the worker frees the backup after the restore
  until = std::chrono::steady_clock::now() + 5s;
  while (dev.host_bytes_in_use() > 64 * MiB / 100 && std::chrono::steady_clock::now() < until) {
    dev.run_until_idle();  // the restore copy
    std::this_thread::sleep_for(1ms);
  }
  CHECK(dev.host_bytes_in_use() <= 64 * MiB / 100);
  dev.launch(s, 1, {reads(weights, 64 * MiB)}, "use");
  dev.run_until_idle();
  CHECK(dev.value_at(addr(weights) + 64 * MiB - 1) == std::optional<std::uint8_t>(9));
  CHECK(dev.fault_count() == 0);
  alloc.deallocate(weights);
}
