// Tests of the simulated device: timing, events, happens-before, faults, memory, injection.
#include <catch2/catch.hpp>

#include <streamsafe/core/errors.hpp>
#include <streamsafe/sim/simulated_device.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace {

using streamsafe::backend_error;
using streamsafe::sim::access;
using streamsafe::sim::call;
using streamsafe::sim::device_config;
using streamsafe::sim::fault_kind;
using streamsafe::sim::range;
using streamsafe::sim::simulated_device;

constexpr std::size_t mib = std::size_t{1} << 20;

range rd(std::uintptr_t begin, std::size_t size) { return range{begin, size, access::read, {}}; }

range wr(std::uintptr_t begin, std::size_t size, std::uint8_t value) {
  return range{begin, size, access::write, value};
}

std::uintptr_t addr(void* p) { return reinterpret_cast<std::uintptr_t>(p); }

std::size_t count_faults(const simulated_device& dev, fault_kind kind) {
  const auto all = dev.faults();
  return static_cast<std::size_t>(
      std::count_if(all.begin(), all.end(), [kind](const auto& f) { return f.kind == kind; }));
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE(
    "Work on one stream runs in FIFO order, each kernel taking its duration after the "
    "previous one finished",
    "[sim]") {
  simulated_device dev;
  const auto s = dev.create_stream();
  const auto k1 = dev.launch(s, 10, {}, "first");
  const auto k2 = dev.launch(s, 5, {}, "second");
  CHECK(dev.now_us() == 0);
  CHECK_FALSE(dev.stream_idle(s));
  dev.advance(9);
  CHECK_FALSE(dev.completed(k1));
  CHECK_FALSE(dev.completed(k2));
  dev.advance(1);
  CHECK(dev.now_us() == 10);
  CHECK(dev.completed(k1));
  CHECK_FALSE(dev.completed(k2));
  dev.advance(4);
  CHECK_FALSE(dev.completed(k2));
  dev.advance(1);
  CHECK(dev.completed(k2));
  CHECK(dev.stream_idle(s));
  CHECK(dev.now_us() == 15);
}

TEST_CASE(
    "Kernels on different streams run concurrently and a kernel launched on an idle "
    "stream starts at the current time",
    "[sim]") {
  simulated_device dev;
  const auto a = dev.create_stream();
  const auto b = dev.create_stream();
  CHECK(a != b);
  CHECK(a != 0);
  dev.advance(100);
  const auto ka = dev.launch(a, 10, {});
  const auto kb = dev.launch(b, 20, {});
  dev.advance(10);
  CHECK(dev.completed(ka));
  CHECK_FALSE(dev.completed(kb));
  dev.advance(10);
  CHECK(dev.completed(kb));
  CHECK(dev.now_us() == 120);
  const auto k0 = dev.launch(0, 0, {});  // zero-length kernel on the default stream: done at once
  CHECK(dev.completed(k0));
}

TEST_CASE(
    "An event is complete until recorded, incomplete while the work before its record "
    "marker runs, and synchronize_event advances the clock to that work's end",
    "[sim]") {
  simulated_device dev;
  const auto s = dev.create_stream();
  const auto e = dev.create_event();
  CHECK(dev.query_event(e));  // never recorded
  dev.launch(s, 30, {});
  dev.record_event(e, s);
  CHECK_FALSE(dev.query_event(e));
  dev.advance(29);
  CHECK_FALSE(dev.query_event(e));
  dev.synchronize_event(e);
  CHECK(dev.now_us() == 30);
  CHECK(dev.query_event(e));

  SECTION("re-recording replaces the marker the event tracks") {
    dev.launch(s, 50, {});
    dev.record_event(e, s);
    CHECK_FALSE(dev.query_event(e));
    dev.record_event(e, 0);  // stream 0 is idle: the new marker completes at once
    CHECK(dev.query_event(e));
  }
  SECTION("recording on an idle stream completes immediately") {
    dev.record_event(e, s);
    CHECK(dev.query_event(e));
  }
}

TEST_CASE("stream_wait_event delays the waiting stream until the recorded work completes",
          "[sim]") {
  simulated_device dev;
  const auto a = dev.create_stream();
  const auto b = dev.create_stream();
  const auto c = dev.create_stream();
  const auto e1 = dev.create_event();
  const auto e2 = dev.create_event();
  dev.launch(a, 10, {});
  dev.record_event(e1, a);
  dev.stream_wait_event(b, e1);
  const auto kb = dev.launch(b, 0, {}, "zero length after the wait");
  dev.record_event(e2, b);
  dev.stream_wait_event(c, e2);
  const auto kc = dev.launch(c, 5, {});
  CHECK_FALSE(dev.completed(kb));
  dev.advance(10);
  // a's kernel completing at t=10 unblocks b, whose record unblocks c, all at the same instant.
  CHECK(dev.completed(kb));
  CHECK_FALSE(dev.completed(kc));
  dev.advance(5);
  CHECK(dev.completed(kc));
  CHECK(dev.now_us() == 15);
}

TEST_CASE("Waiting on an event that was never recorded is a no-op", "[sim]") {
  simulated_device dev;
  const auto s = dev.create_stream();
  const auto e = dev.create_event();
  dev.launch(0, 100, {});
  dev.stream_wait_event(s, e);
  const auto k = dev.launch(s, 1, {});
  dev.advance(1);
  CHECK(dev.completed(k));
}

TEST_CASE(
    "Reusing memory on another stream is race-free when ordered by stream_wait_event and "
    "a cross_stream_race when not",
    "[sim]") {
  simulated_device dev;
  void* seg = dev.allocate_segment(2 * mib);
  REQUIRE(seg != nullptr);
  const auto p = addr(seg);
  const auto a = dev.create_stream();
  const auto b = dev.create_stream();
  dev.launch(a, 100, {wr(p, 4096, 1)}, "producer");

  SECTION("ordered") {
    const auto e = dev.create_event();
    dev.record_event(e, a);
    dev.stream_wait_event(b, e);
    dev.launch(b, 10, {wr(p, 4096, 2)}, "consumer");
    CHECK(dev.fault_count() == 0);
  }
  SECTION("unordered") {
    dev.launch(b, 10, {rd(p + 1024, 16)}, "consumer");
    REQUIRE(count_faults(dev, fault_kind::cross_stream_race) == 1);
    const auto message = dev.faults().front().message;
    CHECK(contains(message, "producer"));
    CHECK(contains(message, "consumer"));
    CHECK(contains(message, "stream " + std::to_string(a)));
    CHECK(contains(message, "stream " + std::to_string(b)));
  }
  SECTION("a wait in the other direction does not order the producer before the consumer") {
    dev.launch(b, 1, {});  // something unrelated
    const auto e = dev.create_event();
    dev.record_event(e, b);
    dev.stream_wait_event(a, e);
    dev.launch(b, 10, {wr(p, 16, 3)}, "consumer");
    CHECK(count_faults(dev, fault_kind::cross_stream_race) == 1);
  }
  SECTION("reads on two streams do not race, nor do disjoint writes") {
    dev.launch(b, 10, {wr(p + 4096, 4096, 7)});
    dev.launch(b, 10, {rd(p + 8192, 16)});
    CHECK(dev.fault_count() == 0);
  }
  SECTION("overlapping reads on two streams do not race") {
    const auto reader = dev.create_stream();
    dev.launch(reader, 100, {rd(p + 8192, 64)}, "first reader");
    dev.launch(b, 10, {rd(p + 8192, 64)}, "second reader");
    CHECK(dev.fault_count() == 0);
    dev.launch(b, 10, {wr(p + 8192 + 63, 1, 9)}, "writer");
    CHECK(count_faults(dev, fault_kind::cross_stream_race) == 1);
  }
  SECTION("no race once the producer has completed, even without ordering") {
    dev.advance(100);
    dev.launch(b, 10, {wr(p, 4096, 2)});
    CHECK(dev.fault_count() == 0);
  }
}

TEST_CASE("Happens-before is transitive through events on a third stream", "[sim]") {
  simulated_device dev;
  const auto p = addr(dev.allocate_segment(2 * mib));
  const auto a = dev.create_stream();
  const auto b = dev.create_stream();
  const auto c = dev.create_stream();
  const auto ea = dev.create_event();
  const auto eb = dev.create_event();
  dev.launch(a, 100, {wr(p, 64, 1)});
  dev.record_event(ea, a);
  dev.stream_wait_event(b, ea);
  dev.record_event(eb, b);
  dev.stream_wait_event(c, eb);
  dev.launch(c, 1, {wr(p, 64, 2)});
  CHECK(dev.fault_count() == 0);
}

TEST_CASE("Work on the same stream never races with itself", "[sim]") {
  simulated_device dev;
  const auto p = addr(dev.allocate_segment(2 * mib));
  dev.launch(0, 100, {wr(p, 64, 1)});
  dev.launch(0, 100, {wr(p, 64, 2)});
  CHECK(dev.fault_count() == 0);
}

TEST_CASE(
    "Freeing or unmapping memory under pending work is a release_under_pending_work "
    "fault, and releasing it after the work completed is not",
    "[sim]") {
  simulated_device dev;
  const auto s = dev.create_stream();

  SECTION("free_segment") {
    void* seg = dev.allocate_segment(4 * mib);
    void* other = dev.allocate_segment(2 * mib);
    dev.launch(s, 10, {rd(addr(seg) + mib, 8)}, "reader");
    dev.free_segment(other, 2 * mib);  // untouched segment: fine
    CHECK(dev.fault_count() == 0);
    dev.free_segment(seg, 4 * mib);
    REQUIRE(count_faults(dev, fault_kind::release_under_pending_work) == 1);
    CHECK(contains(dev.faults().front().message, "reader"));
    CHECK(contains(dev.faults().front().message, "free_segment"));
    CHECK(dev.bytes_in_use() == 0);  // the release was still performed
  }
  SECTION("free_segment after completion") {
    void* seg = dev.allocate_segment(4 * mib);
    dev.launch(s, 10, {rd(addr(seg), 8)});
    dev.advance(10);
    dev.free_segment(seg, 4 * mib);
    CHECK(dev.fault_count() == 0);
  }
  SECTION("queued but not started work counts as pending") {
    void* seg = dev.allocate_segment(2 * mib);
    dev.launch(s, 10, {});
    dev.launch(s, 10, {wr(addr(seg), 8, 1)}, "queued writer");
    dev.free_segment(seg, 2 * mib);
    CHECK(count_faults(dev, fault_kind::release_under_pending_work) == 1);
  }
  SECTION("unmap") {
    void* base = dev.reserve_address_range(8 * mib);
    REQUIRE(dev.map(base, 8 * mib));
    const auto p = addr(base);
    dev.launch(s, 10, {wr(p + 6 * mib, 8, 1)}, "writer");
    dev.unmap(base, 2 * mib);  // the first chunk is not touched
    CHECK(dev.fault_count() == 0);
    dev.unmap(reinterpret_cast<void*>(p + 6 * mib), 2 * mib);
    REQUIRE(count_faults(dev, fault_kind::release_under_pending_work) == 1);
    CHECK(contains(dev.faults().front().message, "unmap"));
    CHECK_FALSE(dev.is_mapped(p + 6 * mib, 1));
  }
  SECTION("unmap after completion") {
    void* base = dev.reserve_address_range(2 * mib);
    REQUIRE(dev.map(base, 2 * mib));
    dev.launch(s, 10, {wr(addr(base), 8, 1)});
    const auto e = dev.create_event();
    dev.record_event(e, s);
    dev.synchronize_event(e);
    dev.unmap(base, 2 * mib);
    CHECK(dev.fault_count() == 0);
  }
}

TEST_CASE(
    "A hold blocks its stream until opened, and synchronizing on it throws instead of "
    "deadlocking",
    "[sim]") {
  simulated_device dev;
  const auto s = dev.create_stream();
  const auto h = dev.hold(s, "gate");
  const auto k = dev.launch(s, 5, {});
  const auto e = dev.create_event();
  dev.record_event(e, s);
  dev.advance(1000);
  CHECK_FALSE(dev.completed(h));
  CHECK_FALSE(dev.completed(k));
  CHECK_FALSE(dev.query_event(e));

  try {
    dev.synchronize_event(e);
    FAIL("synchronize_event returned");
  } catch (const backend_error& error) {
    CHECK(contains(error.what(), "deadlock"));
    CHECK(contains(error.what(), "gate"));
  }
  CHECK_THROWS_AS(dev.synchronize_device(), backend_error);
  CHECK_THROWS_AS(dev.run_until_idle(), std::logic_error);

  dev.open(h);
  CHECK(dev.completed(h));
  CHECK_FALSE(dev.completed(k));
  dev.synchronize_event(e);
  CHECK(dev.completed(k));
  CHECK(dev.now_us() == 1005);
  dev.synchronize_device();
  CHECK(dev.stream_idle(s));
}

TEST_CASE(
    "A stream waiting on an event behind a hold is blocked too, and runs once the hold "
    "opens",
    "[sim]") {
  simulated_device dev;
  const auto a = dev.create_stream();
  const auto b = dev.create_stream();
  const auto h = dev.hold(a);
  const auto e = dev.create_event();
  dev.record_event(e, a);
  dev.stream_wait_event(b, e);
  const auto k = dev.launch(b, 3, {});
  CHECK_THROWS_AS(dev.synchronize_device(), backend_error);
  dev.open(h);
  dev.run_until_idle();
  CHECK(dev.completed(k));
}

TEST_CASE("value_at shows the value of the last completed write", "[sim]") {
  simulated_device dev;
  const auto p = addr(dev.allocate_segment(2 * mib));
  const auto a = dev.create_stream();
  const auto b = dev.create_stream();
  CHECK_FALSE(dev.value_at(p).has_value());

  SECTION("writes land at completion, not at launch") {
    dev.launch(a, 10, {wr(p, 100, 1)});
    CHECK_FALSE(dev.value_at(p).has_value());
    dev.advance(10);
    CHECK(dev.value_at(p) == std::uint8_t{1});
    CHECK(dev.value_at(p + 99) == std::uint8_t{1});
    CHECK_FALSE(dev.value_at(p + 100).has_value());
  }
  SECTION("ordered: the later write on the waiting stream wins although it is shorter") {
    dev.launch(a, 50, {wr(p, 100, 1)});
    const auto e = dev.create_event();
    dev.record_event(e, a);
    dev.stream_wait_event(b, e);
    dev.launch(b, 1, {wr(p + 10, 10, 2)});
    dev.run_until_idle();
    CHECK(dev.fault_count() == 0);
    CHECK(dev.value_at(p + 9) == std::uint8_t{1});
    CHECK(dev.value_at(p + 10) == std::uint8_t{2});
    CHECK(dev.value_at(p + 19) == std::uint8_t{2});
    CHECK(dev.value_at(p + 20) == std::uint8_t{1});
  }
  SECTION("unordered: the shorter write finishes first and is overwritten, and it is a race") {
    dev.launch(a, 50, {wr(p, 100, 1)});
    dev.launch(b, 1, {wr(p + 10, 10, 2)});
    dev.run_until_idle();
    CHECK(count_faults(dev, fault_kind::cross_stream_race) == 1);
    CHECK(dev.value_at(p + 10) == std::uint8_t{1});
  }
  SECTION("kernels finishing at the same instant complete in launch order") {
    dev.launch(b, 10, {wr(p, 8, 1)});  // launched first, on the stream created later
    dev.launch(a, 10, {wr(p, 8, 2)});
    dev.advance(10);
    CHECK(dev.value_at(p) == std::uint8_t{2});
  }
  SECTION("unmapped memory forgets its contents, so a remapped chunk reads as unwritten") {
    void* base = dev.reserve_address_range(2 * mib);
    REQUIRE(dev.map(base, 2 * mib));
    dev.launch(a, 1, {wr(addr(base), 8, 5)});
    dev.run_until_idle();
    CHECK(dev.value_at(addr(base)) == std::uint8_t{5});
    dev.unmap(base, 2 * mib);
    REQUIRE(dev.map(base, 2 * mib));
    CHECK_FALSE(dev.value_at(addr(base)).has_value());
  }
  SECTION("a write without a value forgets what was there") {
    dev.launch(a, 1, {wr(p, 100, 1)});
    dev.launch(a, 1, {range{p + 50, 10, access::write, {}}});
    dev.run_until_idle();
    CHECK(dev.value_at(p + 49) == std::uint8_t{1});
    CHECK_FALSE(dev.value_at(p + 50).has_value());
    CHECK(dev.value_at(p + 60) == std::uint8_t{1});
  }
}

TEST_CASE("Launching work on memory that is not backed is an access_unmapped fault", "[sim]") {
  simulated_device dev;
  const auto s = dev.create_stream();
  void* seg = dev.allocate_segment(2 * mib);
  const auto p = addr(seg);

  SECTION("inside a live segment: fine") {
    dev.launch(s, 1, {rd(p, 2 * mib)});
    CHECK(dev.fault_count() == 0);
  }
  SECTION("one byte past the end of a segment") {
    dev.launch(s, 1, {rd(p + 1, 2 * mib)}, "overrun");
    REQUIRE(count_faults(dev, fault_kind::access_unmapped) == 1);
    CHECK(contains(dev.faults().front().message, "overrun"));
  }
  SECTION("a freed segment (its address is never handed out again)") {
    dev.free_segment(seg, 2 * mib);
    void* again = dev.allocate_segment(2 * mib);
    CHECK(again != seg);
    dev.launch(s, 1, {wr(p, 8, 1)});
    CHECK(count_faults(dev, fault_kind::access_unmapped) == 1);
  }
  SECTION("reserved but unmapped chunks") {
    void* base = dev.reserve_address_range(4 * mib);
    REQUIRE(dev.map(base, 2 * mib));
    dev.launch(s, 1, {rd(addr(base), 2 * mib)});
    CHECK(dev.fault_count() == 0);
    dev.launch(s, 1, {rd(addr(base) + 2 * mib - 8, 16)});
    CHECK(count_faults(dev, fault_kind::access_unmapped) == 1);
    CHECK(dev.is_mapped(addr(base), 2 * mib));
    CHECK_FALSE(dev.is_mapped(addr(base), 4 * mib));
  }
}

TEST_CASE(
    "Addresses come from a granularity-aligned bump pointer and map/unmap/free reject "
    "invalid ranges",
    "[sim]") {
  simulated_device dev;
  const std::size_t gran = dev.map_granularity_bytes();
  void* s1 = dev.allocate_segment(512);
  void* s2 = dev.allocate_segment(512);
  CHECK(addr(s1) >= 0x7f0000000000ULL);
  CHECK(addr(s1) % gran == 0);
  CHECK(addr(s2) % gran == 0);
  CHECK(addr(s2) > addr(s1));
  CHECK_THROWS_AS(dev.allocate_segment(100), backend_error);
  CHECK_THROWS_AS(dev.free_segment(reinterpret_cast<void*>(addr(s1) + 512), 512), backend_error);
  dev.free_segment(s1, 512);
  CHECK_THROWS_AS(dev.free_segment(s1, 512), backend_error);

  void* base = dev.reserve_address_range(4 * gran);
  CHECK(addr(base) % gran == 0);
  CHECK(addr(base) > addr(s2));
  CHECK_THROWS_AS(dev.map(reinterpret_cast<void*>(addr(base) + 512), gran), backend_error);
  CHECK_THROWS_AS(dev.map(base, gran + 512), backend_error);
  CHECK_THROWS_AS(dev.map(reinterpret_cast<void*>(addr(base) + 4 * gran), gran), backend_error);
  REQUIRE(dev.map(base, 2 * gran));
  CHECK_THROWS_AS(dev.map(reinterpret_cast<void*>(addr(base) + gran), gran), backend_error);
  CHECK_THROWS_AS(dev.unmap(reinterpret_cast<void*>(addr(base) + 2 * gran), gran), backend_error);
  CHECK_THROWS_AS(dev.release_address_range(base, 4 * gran), backend_error);  // still mapped
  dev.unmap(base, gran);
  dev.unmap(reinterpret_cast<void*>(addr(base) + gran), gran);
  CHECK_THROWS_AS(dev.unmap(base, gran), backend_error);
  dev.release_address_range(base, 4 * gran);
  CHECK_THROWS_AS(dev.release_address_range(base, 4 * gran), backend_error);
}

TEST_CASE("fail_next makes the next calls of a kind fail without changing any state", "[sim]") {
  simulated_device dev;
  const auto s = dev.create_stream();
  const auto e = dev.create_event();

  SECTION("allocate_segment returns nullptr") {
    dev.fail_next(call::allocate_segment, 2);
    CHECK(dev.allocate_segment(2 * mib) == nullptr);
    CHECK(dev.allocate_segment(2 * mib) == nullptr);
    CHECK(dev.bytes_in_use() == 0);
    CHECK(dev.counters().segment_allocs == 0);
    CHECK(dev.allocate_segment(2 * mib) != nullptr);
    CHECK(dev.counters().segment_allocs == 1);
  }
  SECTION("map returns false") {
    void* base = dev.reserve_address_range(2 * mib);
    dev.fail_next(call::map);
    CHECK_FALSE(dev.map(base, 2 * mib));
    CHECK_FALSE(dev.is_mapped(addr(base), 2 * mib));
    CHECK(dev.bytes_in_use() == 0);
    CHECK(dev.map(base, 2 * mib));
  }
  SECTION("record_event throws and enqueues nothing") {
    dev.launch(s, 10, {});
    dev.fail_next(call::record_event);
    try {
      dev.record_event(e, s);
      FAIL("record_event did not throw");
    } catch (const backend_error& error) {
      CHECK(contains(error.what(), "injected"));
      CHECK(contains(error.what(), "record_event"));
    }
    CHECK(dev.query_event(e));  // still never recorded
    CHECK(dev.counters().events_recorded == 0);
    dev.record_event(e, s);
    CHECK_FALSE(dev.query_event(e));
  }
  SECTION("free_segment throws and the segment stays live") {
    void* seg = dev.allocate_segment(2 * mib);
    dev.fail_next(call::free_segment);
    CHECK_THROWS_AS(dev.free_segment(seg, 2 * mib), backend_error);
    CHECK(dev.is_mapped(addr(seg), 2 * mib));
    dev.free_segment(seg, 2 * mib);
    CHECK_FALSE(dev.is_mapped(addr(seg), 2 * mib));
  }
  SECTION("the synchronizing calls throw without advancing the clock") {
    dev.launch(s, 10, {});
    dev.record_event(e, s);
    dev.fail_next(call::synchronize_event);
    dev.fail_next(call::synchronize_device);
    CHECK_THROWS_AS(dev.synchronize_event(e), backend_error);
    CHECK_THROWS_AS(dev.synchronize_device(), backend_error);
    CHECK(dev.now_us() == 0);
    dev.fail_next(call::query_event);
    CHECK_THROWS_AS(dev.query_event(e), backend_error);
    CHECK(dev.counters().event_queries == 0);
  }
  SECTION("the remaining kinds throw") {
    void* base = dev.reserve_address_range(2 * mib);
    REQUIRE(dev.map(base, 2 * mib));
    for (call c : {call::create_event, call::stream_wait_event, call::unmap,
                   call::release_address_range, call::reserve_address_range}) {
      dev.fail_next(c);
    }
    CHECK_THROWS_AS(dev.create_event(), backend_error);
    CHECK_THROWS_AS(dev.stream_wait_event(s, e), backend_error);
    CHECK_THROWS_AS(dev.unmap(base, 2 * mib), backend_error);
    CHECK(dev.is_mapped(addr(base), 2 * mib));
    dev.unmap(base, 2 * mib);
    CHECK_THROWS_AS(dev.release_address_range(base, 2 * mib), backend_error);
    CHECK_THROWS_AS(dev.reserve_address_range(2 * mib), backend_error);
    dev.release_address_range(base, 2 * mib);
  }
}

TEST_CASE("Counters count every successful backend call", "[sim]") {
  simulated_device dev;
  const auto s = dev.create_stream();
  void* seg = dev.allocate_segment(2 * mib);
  dev.free_segment(seg, 2 * mib);
  void* base = dev.reserve_address_range(4 * mib);
  REQUIRE(dev.map(base, 4 * mib));
  dev.unmap(base, 2 * mib);
  const auto e = dev.create_event();
  dev.launch(s, 1, {});
  dev.record_event(e, s);
  dev.query_event(e);
  dev.stream_wait_event(0, e);
  dev.synchronize_event(e);
  dev.synchronize_device();
  dev.destroy_event(e);
  const auto c = dev.counters();
  CHECK(c.segment_allocs == 1);
  CHECK(c.segment_frees == 1);
  CHECK(c.maps == 1);
  CHECK(c.unmaps == 1);
  CHECK(c.bytes_mapped == 4 * mib);
  CHECK(c.bytes_unmapped == 2 * mib);
  CHECK(c.events_created == 1);
  CHECK(c.events_destroyed == 1);
  CHECK(c.events_recorded == 1);
  CHECK(c.event_queries == 1);
  CHECK(c.event_syncs == 1);
  CHECK(c.stream_waits == 1);
  CHECK(c.device_syncs == 1);
  CHECK(c.launches == 1);
  CHECK_THROWS_AS(dev.query_event(e), backend_error);  // destroyed
}

TEST_CASE("A destroyed stream rejects new work but finishes its pending work", "[sim]") {
  simulated_device dev;
  const auto s = dev.create_stream();
  const auto e = dev.create_event();
  const auto k = dev.launch(s, 10, {});
  dev.destroy_stream(s);
  const std::string expected = "stream " + std::to_string(s) + " was destroyed";
  try {
    dev.launch(s, 1, {});
    FAIL("launch on a destroyed stream did not throw");
  } catch (const backend_error& error) {
    CHECK(contains(error.what(), expected));
  }
  CHECK_THROWS_AS(dev.record_event(e, s), backend_error);
  CHECK_THROWS_AS(dev.stream_wait_event(s, e), backend_error);
  CHECK_THROWS_AS(dev.hold(s), backend_error);
  CHECK_THROWS_AS(dev.destroy_stream(s), backend_error);
  CHECK_THROWS_AS(dev.destroy_stream(0), backend_error);
  CHECK_FALSE(dev.completed(k));
  dev.advance(10);
  CHECK(dev.completed(k));
  CHECK(dev.create_stream() != s);  // handles are not reused by default
}

TEST_CASE("With handle reuse a new stream takes the lowest destroyed handle and a fresh clock",
          "[sim]") {
  simulated_device dev;
  dev.set_reuse_stream_handles(true);
  const auto p = addr(dev.allocate_segment(2 * mib));
  const auto s1 = dev.create_stream();
  const auto s2 = dev.create_stream();
  const auto s3 = dev.create_stream();
  dev.launch(s1, 100, {wr(p, 64, 1)}, "old work");
  dev.destroy_stream(s3);
  dev.destroy_stream(s1);
  const auto again = dev.create_stream();
  CHECK(again == s1);
  CHECK(dev.create_stream() == s3);
  CHECK(dev.create_stream() != s2);
  // The recycled handle is a different stream: not ordered after the old stream's work.
  dev.launch(again, 1, {rd(p, 64)}, "new work");
  CHECK(count_faults(dev, fault_kind::cross_stream_race) == 1);
}

TEST_CASE(
    "Allocations beyond the device total fail as out of memory and memory_info tracks "
    "them",
    "[sim]") {
  device_config config;
  config.total_bytes = 8 * mib;
  simulated_device dev(config);
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  dev.memory_info(free_bytes, total_bytes);
  CHECK(total_bytes == 8 * mib);
  CHECK(free_bytes == 8 * mib);

  void* seg = dev.allocate_segment(4 * mib);
  REQUIRE(seg != nullptr);
  void* base = dev.reserve_address_range(8 * mib);
  REQUIRE(dev.map(base, 2 * mib));
  CHECK(dev.bytes_in_use() == 6 * mib);
  dev.memory_info(free_bytes, total_bytes);
  CHECK(free_bytes == 2 * mib);

  CHECK(dev.allocate_segment(4 * mib) == nullptr);
  CHECK_FALSE(dev.map(reinterpret_cast<void*>(addr(base) + 2 * mib), 4 * mib));
  CHECK_FALSE(dev.is_mapped(addr(base) + 2 * mib, 1));  // nothing stays mapped
  CHECK(dev.bytes_in_use() == 6 * mib);
  CHECK(dev.map(reinterpret_cast<void*>(addr(base) + 2 * mib), 2 * mib));
  CHECK(dev.allocate_segment(512) == nullptr);

  dev.free_segment(seg, 4 * mib);
  dev.memory_info(free_bytes, total_bytes);
  CHECK(free_bytes == 4 * mib);
  CHECK(dev.allocate_segment(4 * mib) != nullptr);
}

TEST_CASE("Concurrent calls from several threads keep the device consistent", "[sim]") {
  simulated_device dev;
  const auto p = addr(dev.allocate_segment(2 * mib));
  constexpr int threads = 4;
  constexpr int per_thread = 200;
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&dev, p, t] {
      const auto s = dev.create_stream();
      const auto e = dev.create_event();
      for (int i = 0; i < per_thread; ++i) {
        const auto offset = static_cast<std::uintptr_t>(t) * 4096;
        dev.launch(s, 1, {wr(p + offset, 4096, static_cast<std::uint8_t>(i))});
        dev.record_event(e, s);
        if (i % 10 == 0) dev.synchronize_event(e);
        dev.advance(1);
      }
    });
  }
  for (auto& worker : workers) worker.join();
  dev.synchronize_device();
  CHECK(dev.fault_count() == 0);
  CHECK(dev.counters().launches == threads * per_thread);
  for (int t = 0; t < threads; ++t) {
    CHECK(dev.value_at(p + static_cast<std::uintptr_t>(t) * 4096) ==
          static_cast<std::uint8_t>(per_thread - 1));
  }
}
