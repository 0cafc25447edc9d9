// Memory reclaimed twice by alias (expandable, reclaim.cpp): a queued small chunk mapped again
// into a large pool's range, whose queued address is mapped again into a tagged small pool's:
// three addresses of one memory. When the newest address goes first (a pause), the middle one
// owns the memory; its unmap gives nothing back while the oldest address still maps it, so
// reserved keeps counting it until that unmap too (the device never holds more than reserved).
#include "support/forwarding_device.hpp"
#include "support/sim_fixture.hpp"
#include "support/tagged_blocks.hpp"

#include <streamsafe/core/errors.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

// Each unmap, with the device lock dropped (release.cpp): what the device holds before it and
// the allocator's reserved bytes then (a stats() call from the releasing thread).
class unmap_watch final : public forwarding_device {
 public:
  explicit unmap_watch(sim::simulated_device& dev) : forwarding_device(dev) {}
  void watch(caching_allocator* a) { alloc_ = a; }
  void unmap(void* addr, std::size_t size_bytes) override {
    if (alloc_) {
      seen.push_back({reinterpret_cast<std::uintptr_t>(addr), dev_.bytes_in_use(),
                      static_cast<std::size_t>(alloc_->stats().reserved_bytes.current)});
    }
    forwarding_device::unmap(addr, size_bytes);
  }
  struct seen_unmap {
    std::uintptr_t addr;
    std::size_t device_bytes;
    std::size_t reserved;
  };
  std::vector<seen_unmap> seen;

 private:
  caching_allocator* alloc_ = nullptr;
};

}  // namespace

TEST_CASE(
    "Memory mapped at three addresses: the middle address's unmap after the newest's gives "
    "nothing back while the oldest still maps it",
    "[core][release][expandable][sleep]") {
  sim::simulated_device dev(sim_config());
  unmap_watch watch(dev);
  caching_allocator alloc(watch, sleep_options(fence_scope::all_streams, empty_cache_mode::defer));
  const stream_handle t = dev.create_stream();
  const stream_handle s = dev.create_stream();
  const stream_handle u = dev.create_stream();

  // A small block on t, freed while t is held: empty_cache queues its 2 MiB chunk (address A).
  void* a = alloc.allocate(512 * KiB, t);
  dev.launch(t, 10, {writes(a, 512 * KiB, 0x11)}, "use a");
  const std::uint64_t hold_t = dev.hold(t);
  alloc.deallocate(a);
  alloc.empty_cache();
  REQUIRE(alloc.pending_release_bytes() == 2 * MiB);

  // A large block on s reclaims it: mapped again at B, A still queued (s waits on its fence).
  void* b = alloc.allocate(MiB + 512, s);
  REQUIRE(dev.counters().aliases == 1);
  dev.launch(s, 10, {writes(b, MiB + 512, 0x22)}, "use b");
  alloc.deallocate(b);
  alloc.empty_cache();  // A's fence is not done: B is queued behind A
  dev.open(hold_t);
  dev.run_until_idle();

  // A tagged small block on u reclaims B's queued memory: mapped a third time, at C.
  void* c = nullptr;
  {
    tag_scope kv("chain.kv");
    c = alloc.allocate(512 * KiB, u);
  }
  REQUIRE(dev.counters().aliases == 2);
  REQUIRE(dev.bytes_in_use() == 2 * MiB);
  CHECK(alloc.stats().reserved_bytes.current == static_cast<std::int64_t>(2 * MiB));

  // The pause unmaps C first: B owns the memory now, A still maps it.
  alloc.pause("chain.kv", pause_mode::discard, empty_cache_mode::wait);
  CHECK(dev.bytes_in_use() == 2 * MiB);
  CHECK(alloc.stats().reserved_bytes.current == static_cast<std::int64_t>(2 * MiB));

  // A's unmap fails once: A goes back to the queue, behind B.
  dev.fail_next(sim::call::unmap);
  CHECK_THROWS_AS(alloc.empty_cache(), backend_error);
  CHECK(dev.bytes_in_use() == 2 * MiB);
  CHECK(alloc.stats().reserved_bytes.current == static_cast<std::int64_t>(2 * MiB));

  // B goes back, then A: until A's unmap the memory is held, and counted as reserved.
  watch.watch(&alloc);
  alloc.empty_cache();
  watch.watch(nullptr);
  REQUIRE(watch.seen.size() == 2);
  for (const auto& u_seen : watch.seen) {
    INFO("unmap at " << u_seen.addr << ": device " << u_seen.device_bytes << ", reserved "
                     << u_seen.reserved);
    CHECK(u_seen.device_bytes <= u_seen.reserved);
  }
  CHECK(dev.bytes_in_use() == 0);
  CHECK(alloc.stats().reserved_bytes.current == 0);
  CHECK(alloc.pending_release_bytes() == 0);
  CHECK_NOTHROW(alloc.check_invariants());

  alloc.resume("chain.kv");
  alloc.deallocate(c);
  alloc.empty_cache("chain.kv");
  dev.run_until_idle();
  alloc.reclaim();
  alloc.empty_cache();
  CHECK(alloc.stats().reserved_bytes.current == 0);
  CHECK(dev.bytes_in_use() == 0);
  CHECK(dev.fault_count() == 0);
}
