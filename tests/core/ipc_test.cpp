// Interprocess export and import of blocks, on the simulated device: a producer
// allocator exports a block, a consumer allocator on the same device imports it (a view at the
// same address) and reads it on its own stream. The rules under test: the producer's free of an
// exported block is held until every export has been released AND the consumer's event has
// completed, so that neither a reallocation nor empty_cache (wait or defer, either backend)
// touches the bytes under the consumer's pending read; allocate and deallocate never wait;
// misuse is a clear error.
#include "support/sim_faults.hpp"
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <string>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

// A producer and a consumer allocator on one simulated device, each with its own stream.
struct ipc_env {
  sim::simulated_device dev;
  caching_allocator producer;
  caching_allocator consumer;
  stream_handle ps, cs;
  explicit ipc_env(options o) : dev(sim_config()), producer(dev, o), consumer(dev, o) {
    ps = dev.create_stream();
    cs = dev.create_stream();
  }
};

constexpr std::size_t k_bytes = 64 * MiB;  // a large block: its own segment / whole chunks
constexpr std::uint64_t k_read_us = 1000;  // the consumer's long read

}  // namespace

TEST_CASE("a producer free of an exported block is held until the consumer is done",
          "[core][ipc]") {
  EACH_BACKEND(backend);
  ipc_env env(make_options(backend));
  auto& dev = env.dev;
  void* a = env.producer.allocate(k_bytes, env.ps);
  dev.launch(env.ps, 10, {writes(a, k_bytes, 7)}, "producer fills");
  dev.run_until_idle();

  const ipc_handle h = env.producer.export_block(a);
  const imported_block imp = env.consumer.import_block(h);
  REQUIRE(imp.ptr == a);  // the simulated device's view of the same bytes
  REQUIRE(imp.size_bytes >= k_bytes);
  dev.launch(env.cs, k_read_us, {reads(imp.ptr, k_bytes)}, "consumer read");
  const ipc_release r = env.consumer.release_import(imp.ptr, env.cs);

  // The producer frees and reallocates before the release message arrives.
  env.producer.deallocate(a);
  CHECK(env.producer.ipc_status().held_frees == 1);
  CHECK(env.producer.stats().allocated_bytes.current >= static_cast<std::int64_t>(k_bytes));
  void* b = env.producer.allocate(k_bytes, env.ps);
  CHECK(b != a);  // the exported block is not reused
  dev.launch(env.ps, 10, {writes(b, k_bytes, 9)}, "producer reuses");
  env.producer.empty_cache();
  CHECK(dev.is_mapped(addr(a), k_bytes));

  // The release arrives while the consumer's read is still pending: the export has not ended.
  env.producer.notify_import_released(r);
  env.producer.reclaim();
  env.producer.empty_cache(empty_cache_mode::defer);
  CHECK(env.producer.ipc_status().exports == 1);
  CHECK(env.producer.ipc_status().held_frees == 1);
  CHECK(dev.is_mapped(addr(a), k_bytes));
  env.producer.check_invariants();

  dev.advance(2 * k_read_us);         // the consumer's read completes
  CHECK(dev.value_at(addr(a)) == 7);  // what it read was never overwritten
  env.producer.reclaim();
  CHECK(env.producer.ipc_status().exports == 0);
  CHECK(env.producer.ipc_status().held_frees == 0);
  env.producer.check_invariants();

  // Now the block is the producer's again: reusable and releasable.
  void* c = env.producer.allocate(k_bytes, env.ps);
  dev.launch(env.ps, 10, {writes(c, k_bytes, 3)}, "producer reuses after the release");
  env.producer.deallocate(c);
  env.producer.deallocate(b);
  env.producer.empty_cache();
  env.consumer.reclaim();  // the consumer's view closes behind its event
  CHECK(env.consumer.ipc_status().closing == 0);
  CHECK(dev.open_import_count() == 0);
  INFO(fault_text(dev));
  CHECK(dev.fault_count() == 0);
}

TEST_CASE("empty_cache does not release an exported block under the consumer's read",
          "[core][ipc]") {
  EACH_BACKEND(backend);
  const empty_cache_mode mode = GENERATE(empty_cache_mode::wait, empty_cache_mode::defer);
  INFO("mode " << (mode == empty_cache_mode::wait ? "wait" : "defer"));
  ipc_env env(make_options(backend, fence_scope::all_streams, mode));
  auto& dev = env.dev;
  void* a = env.producer.allocate(k_bytes, env.ps);
  const imported_block imp = env.consumer.import_block(env.producer.export_block(a));
  dev.launch(env.cs, k_read_us, {reads(imp.ptr, k_bytes)}, "consumer read");
  env.producer.notify_import_released(env.consumer.release_import(imp.ptr, env.cs));
  env.producer.deallocate(a);  // released, the consumer's event still pending

  const auto syncs_before = dev.counters().event_syncs;
  env.producer.empty_cache();
  if (mode == empty_cache_mode::wait) {
    // Wait mode waits on the consumer's event, then releases the block's memory.
    CHECK(dev.counters().event_syncs > syncs_before);
    CHECK(env.producer.ipc_status().held_frees == 0);
    CHECK(env.producer.stats().reserved_bytes.current == 0);
  } else {
    // Defer mode never waits: the block stays held and mapped until its event completes.
    CHECK(dev.counters().event_syncs == syncs_before);
    CHECK(env.producer.ipc_status().held_frees == 1);
    CHECK(dev.is_mapped(addr(a), k_bytes));
    dev.advance(2 * k_read_us);
    env.producer.empty_cache();
    CHECK(env.producer.ipc_status().held_frees == 0);
    CHECK(env.producer.stats().reserved_bytes.current == 0);
  }
  env.producer.check_invariants();
  env.consumer.reclaim();
  INFO(fault_text(dev));
  CHECK(dev.fault_count() == 0);
}

TEST_CASE("allocate and deallocate never wait on a consumer event", "[core][ipc]") {
  EACH_BACKEND(backend);
  ipc_env env(make_options(backend, fence_scope::all_streams, empty_cache_mode::defer));
  auto& dev = env.dev;
  void* a = env.producer.allocate(k_bytes, env.ps);
  const imported_block imp = env.consumer.import_block(env.producer.export_block(a));
  const std::uint64_t stall = dev.hold(
      env.cs, "consumer stalls");  // the consumer's event would never complete
  dev.launch(env.cs, k_read_us, {reads(imp.ptr, k_bytes)}, "consumer read");
  env.producer.notify_import_released(env.consumer.release_import(imp.ptr, env.cs));
  const auto before = dev.counters();
  env.producer.deallocate(a);
  for (int i = 0; i < 8; ++i) env.producer.deallocate(env.producer.allocate(k_bytes, env.ps));
  env.producer.reclaim();
  env.producer.empty_cache();
  const auto after = dev.counters();
  CHECK(after.event_syncs == before.event_syncs);
  CHECK(after.device_syncs == before.device_syncs);
  CHECK(env.producer.ipc_status().held_frees == 1);
  CHECK(dev.fault_count() == 0);
  // The consumer died (say): the producer revokes; then the stalled stream moves on and the
  // consumer's view closes behind its event.
  CHECK(env.producer.revoke_exports(a) == 1);
  CHECK(env.producer.ipc_status().held_frees == 0);
  dev.open(stall);
  dev.run_until_idle();
}

TEST_CASE("every export of a block must end before its free completes", "[core][ipc]") {
  ipc_env env(make_options(backend_kind::expandable));
  auto& dev = env.dev;
  caching_allocator second(dev, make_options(backend_kind::expandable));
  void* a = env.producer.allocate(MiB, env.ps);
  const imported_block i1 = env.consumer.import_block(env.producer.export_block(a));
  const imported_block i2 = second.import_block(env.producer.export_block(a));
  CHECK(env.producer.ipc_status().exports == 2);
  env.producer.deallocate(a);
  env.producer.notify_import_released(env.consumer.release_import(i1.ptr, env.cs));
  env.producer.reclaim();
  CHECK(env.producer.ipc_status().held_frees == 1);  // the second consumer still has it
  const stream_handle s2 = dev.create_stream();
  dev.launch(s2, k_read_us, {reads(i2.ptr, MiB)}, "second consumer read");
  env.producer.notify_import_released(second.release_import(i2.ptr, s2));
  env.producer.reclaim();
  CHECK(env.producer.ipc_status().held_frees == 1);
  dev.run_until_idle();
  env.producer.reclaim();
  CHECK(env.producer.ipc_status().held_frees == 0);
  CHECK(env.producer.ipc_status().exports == 0);
  env.producer.check_invariants();
  CHECK(dev.fault_count() == 0);
}

TEST_CASE("a stream-ordered free of an exported block completes on its stream", "[core][ipc]") {
  EACH_BACKEND(backend);
  ipc_env env(make_options(backend));
  auto& dev = env.dev;
  const stream_handle other = dev.create_stream();
  void* a = env.producer.allocate(MiB, env.ps);
  const imported_block imp = env.consumer.import_block(env.producer.export_block(a));
  dev.launch(other, k_read_us, {reads(a, MiB)}, "producer side-stream read");
  env.producer.deallocate(a, other);  // held, with its stream
  env.producer.notify_import_released(env.consumer.release_import(imp.ptr, env.cs));
  env.producer.reclaim();  // the export ends; the free completes behind other's event
  CHECK(env.producer.ipc_status().held_frees == 0);
  void* b = env.producer.allocate(MiB, env.ps);
  dev.launch(env.ps, 10, {writes(b, MiB)}, "producer reuses");
  dev.run_until_idle();
  INFO(fault_text(dev));
  CHECK(dev.fault_count() == 0);
}

TEST_CASE("revoke_exports ends exports whose consumer never released", "[core][ipc]") {
  ipc_env env(make_options(backend_kind::cuda_malloc));
  void* a = env.producer.allocate(MiB, env.ps);
  (void)env.consumer.import_block(env.producer.export_block(a));  // the consumer then "dies"
  env.producer.deallocate(a);
  env.producer.empty_cache();
  CHECK(env.producer.ipc_status().held_frees == 1);
  CHECK(env.producer.revoke_exports(a) == 1);
  CHECK(env.producer.ipc_status().held_frees == 0);
  CHECK(env.producer.ipc_status().exports == 0);
  CHECK_THROWS_AS(env.producer.revoke_exports(a), invalid_pointer);  // freed now
  env.producer.check_invariants();
}

TEST_CASE("IPC misuse is a clear error", "[core][ipc]") {
  ipc_env env(make_options(backend_kind::expandable));
  auto& P = env.producer;
  auto& C = env.consumer;
  void* a = P.allocate(MiB, env.ps);

  SECTION("export of a freed, interior or unknown pointer") {
    void* f = P.allocate(MiB, env.ps);
    P.deallocate(f);
    CHECK_THROWS_AS(P.export_block(f), invalid_pointer);
    CHECK_THROWS_AS(P.export_block(static_cast<char*>(a) + 512), invalid_pointer);
    int local = 0;
    CHECK_THROWS_AS(P.export_block(&local), invalid_pointer);
  }
  SECTION("malformed or unknown handles and messages") {
    CHECK_THROWS_AS(C.import_block(ipc_handle{}), ipc_error);
    ipc_handle h = P.export_block(a);
    ipc_handle cut = h;
    cut.bytes.pop_back();
    CHECK_THROWS_AS(C.import_block(cut), ipc_error);
    CHECK_THROWS_AS(P.notify_import_released(ipc_release{{1, 2, 3}}), ipc_error);
    const imported_block imp = C.import_block(h);
    CHECK_THROWS_WITH(C.import_block(h), Catch::Contains("imported here already"));
    CHECK_THROWS_WITH(C.import_block(P.export_block(a)),
                      Catch::Contains("another export of the same block"));
    CHECK(env.dev.open_import_count() == 1);  // the refused import's view was closed
    const ipc_release r = C.release_import(imp.ptr, env.cs);
    caching_allocator other(env.dev, make_options(backend_kind::expandable));
    void* o = other.allocate(MiB, env.ps);
    (void)other.export_block(o);
    CHECK_THROWS_WITH(other.notify_import_released(r), Catch::Contains("another allocator"));
    other.revoke_exports(o);
    other.deallocate(o);
    P.notify_import_released(r);
    CHECK_THROWS_AS(P.notify_import_released(r), ipc_error);  // double release, producer side
    env.dev.run_until_idle();
    P.reclaim();
    CHECK_THROWS_WITH(P.notify_import_released(r), Catch::Contains("already ended"));
    CHECK(P.revoke_exports(a) == 1);  // the export whose import was refused
  }
  SECTION("release of an unknown import, and a double release") {
    CHECK_THROWS_WITH(C.release_import(a, env.cs), Catch::Contains("not an open import"));
    const imported_block imp = C.import_block(P.export_block(a));
    const std::uint64_t busy = env.dev.hold(env.cs, "consumer busy");
    (void)C.release_import(imp.ptr, env.cs);
    CHECK_THROWS_WITH(C.release_import(imp.ptr, env.cs), Catch::Contains("released twice"));
    P.revoke_exports(a);
    env.dev.open(busy);
    env.dev.run_until_idle();
  }
  SECTION("a double free of an exported block") {
    (void)P.export_block(a);
    P.deallocate(a);
    CHECK_THROWS_WITH(P.deallocate(a), Catch::Contains("exported"));
    CHECK_THROWS_AS(P.record_stream(a, env.cs), invalid_pointer);
    P.revoke_exports(a);
  }
  SECTION("export, import and release during a graph capture") {
    const ipc_handle h = P.export_block(a);
    const stream_handle cap = env.dev.create_stream();
    env.dev.begin_capture(cap);
    P.notify_capture_begin(cap);
    C.notify_capture_begin(cap);
    CHECK_THROWS_WITH(P.export_block(a), Catch::Contains("capture"));
    CHECK_THROWS_AS(C.import_block(h), ipc_error);
    C.notify_capture_end(cap);
    const imported_block imp = C.import_block(h);
    C.notify_capture_begin(cap);
    CHECK_THROWS_AS(C.release_import(imp.ptr, env.cs), ipc_error);
    C.notify_capture_end(cap);
    P.notify_capture_end(cap);
    env.dev.end_capture(cap);
    P.notify_import_released(C.release_import(imp.ptr, env.cs));
  }
  P.check_invariants();
  C.check_invariants();
}

TEST_CASE("a consumer allocator destroyed closes its imports behind their events", "[core][ipc]") {
  sim::simulated_device dev(sim_config());
  caching_allocator producer(dev, make_options(backend_kind::expandable));
  const stream_handle ps = dev.create_stream(), cs = dev.create_stream();
  void* a = producer.allocate(k_bytes, ps);
  ipc_release r;
  {
    caching_allocator consumer(dev, make_options(backend_kind::expandable));
    const imported_block imp = consumer.import_block(producer.export_block(a));
    dev.launch(cs, k_read_us, {reads(imp.ptr, k_bytes)}, "consumer read");
    r = consumer.release_import(imp.ptr, cs);
  }  // waits on the consumer's event before closing its view
  CHECK(dev.open_import_count() == 0);
  producer.notify_import_released(r);
  producer.deallocate(a);
  producer.empty_cache();
  INFO(fault_text(dev));
  CHECK(dev.fault_count() == 0);
}

// Field case: a consumer released its import (the producer then ended the export at that first
// release and handed the block out again) and imported the same handle a second time; the
// second import read the producer's new data. An export is imported at most once per consumer.
TEST_CASE("an export cannot be imported again after its import was released", "[core][ipc][race]") {
  EACH_BACKEND(backend);
  ipc_env env(make_options(backend));
  auto& dev = env.dev;
  void* a = env.producer.allocate(k_bytes, env.ps);
  dev.launch(env.ps, 10, {writes(a, k_bytes, 7)}, "producer fills");
  dev.run_until_idle();
  const ipc_handle h = env.producer.export_block(a);

  const imported_block first = env.consumer.import_block(h);
  dev.launch(env.cs, 10, {reads(first.ptr, k_bytes)}, "consumer's first read");
  env.producer.notify_import_released(env.consumer.release_import(first.ptr, env.cs));
  dev.run_until_idle();
  env.consumer.reclaim();  // the first import's view closes behind its event
  env.producer.reclaim();  // the export ends
  CHECK(env.producer.ipc_status().exports == 0);
  CHECK(env.consumer.ipc_status().closing == 0);

  // The producer frees the block and hands it out again.
  env.producer.deallocate(a);
  void* b = env.producer.allocate(k_bytes, env.ps);
  CHECK(b == a);
  dev.launch(env.ps, k_read_us, {writes(b, k_bytes, 9)}, "producer writes its new block");

  // The handle imported a second time would read the producer's new block under its writes.
  CHECK_THROWS_WITH(env.consumer.import_block(h), Catch::Contains("imported here already"));
  CHECK(env.consumer.ipc_status().imports == 0);
  CHECK(dev.open_import_count() == 0);
  dev.run_until_idle();
  env.producer.deallocate(b);
  env.producer.check_invariants();
  env.consumer.check_invariants();
  INFO(fault_text(dev));
  CHECK(dev.fault_count() == 0);
}

// A front end with its own release protocol (PyTorch counts a sent tensor's consumers) ends an
// export with the message ipc_release_of builds; the hold still waits for the consumer's event.
TEST_CASE("ipc_release_of ends an export behind the consumer's event", "[core][ipc]") {
  EACH_BACKEND(backend);
  ipc_env env(make_options(backend));
  auto& dev = env.dev;
  void* a = env.producer.allocate(k_bytes, env.ps);
  const ipc_handle h = env.producer.export_block(a);
  const imported_block imp = env.consumer.import_block(h);
  dev.launch(env.cs, k_read_us, {reads(imp.ptr, k_bytes)}, "consumer read");
  (void)env.consumer.release_import(imp.ptr, env.cs);  // the message is not sent back
  env.producer.notify_import_released(ipc_release_of(h));
  env.producer.deallocate(a);
  void* b = env.producer.allocate(k_bytes, env.ps);
  CHECK(b != a);  // held behind the consumer's pending read
  CHECK(env.producer.ipc_status().held_frees == 1);
  dev.run_until_idle();
  env.producer.reclaim();
  env.consumer.reclaim();
  CHECK(env.producer.ipc_status().exports == 0);
  CHECK(env.producer.ipc_status().held_frees == 0);
  CHECK_THROWS_AS(ipc_release_of(ipc_handle{}), ipc_error);
  env.producer.deallocate(b);
  env.producer.check_invariants();
  INFO(fault_text(dev));
  CHECK(dev.fault_count() == 0);
}
