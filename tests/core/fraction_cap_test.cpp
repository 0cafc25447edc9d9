// A cap on the device's memory set from outside the allocator, as PyTorch's
// set_per_process_memory_fraction is enforced under the PyTorch extension (its backend refuses
// a growth past the cap, and the allocator's out-of-memory path decides), on the simulated device
// (both backends, empty_cache wait and defer with the release worker).
//
// PyTorch's own check of the cap (max_split_size_mb 40): after empty_cache(), the cap is what
// stays reserved plus 120 MiB; three 40 MiB tensors fit, a fourth runs out of memory; once
// they are freed, 120 MiB fits. The device's memory in use never passes the cap.
//
// A pool of its own allocator under the same cap, tried by an allocation that found no memory
// (PyTorch: MemPool(use_on_oom=True)): allocate_cached serves it from the pool's cache only, and
// a pool that cannot serve it keeps its cache.
#include "support/sim_fixture.hpp"

#include <streamsafe/backends/forwarding_backend.hpp>
#include <streamsafe/core/errors.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;
using namespace std::chrono_literals;

namespace {

// Refuses memory that would bring the device's bytes in use past the cap (0 = none), as the
// PyTorch extension's limited_backend does: the allocator sees a device out of memory.
class capped_device final : public forwarding_backend {
 public:
  explicit capped_device(sim::simulated_device& dev) : forwarding_backend(dev), dev_(dev) {}
  void set_cap(std::size_t bytes) {
    cap_ = bytes;
    most_in_use = dev_.bytes_in_use();
  }
  void* allocate_segment(std::size_t size_bytes) override {
    if (!fits(size_bytes)) return nullptr;
    return forwarding_backend::allocate_segment(size_bytes);
  }
  bool map(void* addr, std::size_t size_bytes) override {
    if (!fits(size_bytes)) return false;
    return forwarding_backend::map(addr, size_bytes);
  }
  std::size_t most_in_use = 0;  // sampled at every growth the cap let through

 private:
  bool fits(std::size_t size_bytes) {
    const std::size_t after = dev_.bytes_in_use() + size_bytes;
    if (cap_ != 0 && after > cap_) return false;
    most_in_use = std::max(most_in_use, after);
    return true;
  }
  sim::simulated_device& dev_;
  std::size_t cap_ = 0;
};

struct cap_case {
  backend_kind backend;
  empty_cache_mode mode;
};

}  // namespace

TEST_CASE(
    "A cap set after empty_cache from what stays reserved holds: three 40 MiB blocks fit under "
    "reserved + 120 MiB, a fourth runs out of memory, then 120 MiB fits",
    "[core][release]") {
  const cap_case c = GENERATE(cap_case{backend_kind::cuda_malloc, empty_cache_mode::wait},
                              cap_case{backend_kind::expandable, empty_cache_mode::wait},
                              cap_case{backend_kind::cuda_malloc, empty_cache_mode::defer},
                              cap_case{backend_kind::expandable, empty_cache_mode::defer});
  INFO("backend " << to_string(c.backend) << ", empty_cache " << to_string(c.mode));
  sim::simulated_device dev(sim_config(8 * GiB));
  capped_device capped(dev);
  options o = make_options(c.backend, fence_scope::all_streams, c.mode);
  o.release_worker = c.mode == empty_cache_mode::defer ? release_worker_mode::on
                                                       : release_worker_mode::off;
  caching_allocator alloc(capped, o);
  const auto side = dev.create_stream();

  // What earlier work leaves: a few small and medium blocks alive among freed larger ones, on
  // the default stream and on a side stream.
  std::vector<void*> live, freed;
  for (int i = 0; i < 6; ++i) {
    freed.push_back(alloc.allocate(48 * MiB, 0));
    live.push_back(alloc.allocate(3 * MiB, 0));
    freed.push_back(alloc.allocate(96 * MiB, side));
    live.push_back(alloc.allocate(512 * KiB, side));
    live.push_back(alloc.allocate(2 * MiB + 4 * KiB, 0));
  }
  freed.push_back(alloc.allocate(300 * MiB, 0));
  for (void* p : freed) alloc.deallocate(p);

  alloc.empty_cache();
  if (c.mode == empty_cache_mode::defer) {
    // Right after empty_cache() in defer mode, reserved still counts what it queued (mapped
    // until the worker's driver call, reusable first): a cap read from it now would leave room
    // for that memory as well once the worker gives it back. The cap below starts from what
    // stays once the worker is done (how far the worker has got at this point is timing: on the
    // simulated device the fence completes at once).
    REQUIRE(alloc.wait_for_release_worker_idle(5s));
    REQUIRE(alloc.pending_release_bytes() == 0);
  }
  const auto pre_reserved = static_cast<std::size_t>(alloc.stats().reserved_bytes.current);
  const std::size_t cap = pre_reserved + 120 * MiB;
  capped.set_cap(cap);
  runtime_options r;
  r.max_split_size_bytes = 40 * MiB;
  alloc.set_runtime_options(r);
  INFO("reserved after empty_cache " << pre_reserved << ", in use " << dev.bytes_in_use());

  void* a = alloc.allocate(40 * MiB, 0);
  void* b = alloc.allocate(40 * MiB, 0);
  void* d = alloc.allocate(40 * MiB, 0);
  INFO("reserved " << alloc.stats().reserved_bytes.current << ", in use " << dev.bytes_in_use()
                   << ", cap " << cap);
  CHECK(static_cast<std::size_t>(alloc.stats().reserved_bytes.current) <= cap);
  CHECK_THROWS_AS(alloc.allocate(40 * MiB, 0), out_of_memory);
  alloc.deallocate(a);
  alloc.deallocate(b);
  alloc.deallocate(d);
  void* big = nullptr;
  CHECK_NOTHROW(big = alloc.allocate(120 * MiB, 0));
  CHECK(capped.most_in_use <= cap);
  CHECK(static_cast<std::size_t>(alloc.stats().reserved_bytes.current) <= cap);
  if (big) alloc.deallocate(big);
  for (void* p : live) alloc.deallocate(p);
  alloc.wait_for_release_worker_idle(5s);
  alloc.check_invariants();
}

TEST_CASE(
    "A pool tried for an allocation that found no memory serves it from its cache, and keeps "
    "its cache when the request does not fit it",
    "[core][release]") {
  sim::simulated_device dev(sim_config(8 * GiB));
  capped_device capped(dev);
  // The pool's allocator under the same device-wide cap (the pool's memory counts against it).
  caching_allocator pool(capped, make_options(backend_kind::cuda_malloc));
  capped.set_cap(48 * MiB);
  void* cached = pool.allocate(40 * MiB, 0);
  const auto address = addr(cached);
  pool.deallocate(cached);
  REQUIRE(pool.stats().reserved_bytes.current == static_cast<std::int64_t>(40 * MiB));

  // What an allocation that found no memory asks of a pool before it runs out of memory
  // (PyTorch: MemPool(use_on_oom=True)). 64 MiB: nothing cached fits, and the cap leaves no
  // room: the pool cannot serve it, and what it holds stays (no release, no growth).
  CHECK(pool.allocate_cached(64 * MiB, 0) == nullptr);
  CHECK(pool.stats().reserved_bytes.current == static_cast<std::int64_t>(40 * MiB));
  CHECK(dev.counters().segment_frees == 0);
  // 30 MiB: the cached block serves it.
  void* p = pool.allocate_cached(30 * MiB, 0);
  CHECK(addr(p) == address);
  if (p) pool.deallocate(p);
  // Nothing cached on another stream: no growth either.
  const auto side = dev.create_stream();
  capped.set_cap(0);
  const std::uint64_t grown = dev.counters().segment_allocs;
  CHECK(pool.allocate_cached(4 * MiB, side) == nullptr);
  CHECK(dev.counters().segment_allocs == grown);
  pool.check_invariants();
}
