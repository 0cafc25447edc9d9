// The growth policy's rules (growth_policy.cpp) on the simulated device: a growth past the peak
// never waits on the host, a few small blocks never pin a large segment, out-of-memory only when
// cached, queued and in-flight memory cannot serve, and its message in PyTorch's form first.
#include "support/blocking_host.hpp"
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <string>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;
using namespace std::chrono_literals;

namespace {

struct blocking_env {
  sim::simulated_device dev;
  blocking_host_backend host;
  caching_allocator alloc;
  explicit blocking_env(options o) : dev(sim_config(8 * GiB)), host(dev, 5s), alloc(host, o) {}
};

}  // namespace

TEST_CASE(
    "An expandable growth past the peak gives idle chunks back without a host wait, also in "
    "empty_cache:wait mode, and never hangs when the busy work waits for the allocating thread",
    "[core][growth][blocking][expandable]") {
  const empty_cache_mode mode = GENERATE(empty_cache_mode::wait, empty_cache_mode::defer);
  INFO("empty_cache:" << to_string(mode));
  blocking_env env(make_options(backend_kind::expandable, fence_scope::all_streams, mode));
  const auto s = env.dev.create_stream();
  const auto c = env.dev.create_stream();  // a collective's stream, known to the allocator
  const auto u = env.dev.create_stream();
  env.alloc.deallocate(env.alloc.allocate(4 * KiB, c));
  void* a = env.alloc.allocate(60 * MiB, s);
  env.dev.launch(s, 10, {writes(a, 60 * MiB)}, "compute");
  env.alloc.deallocate(a);  // 60 MiB cached on s: the peak is 60 MiB (plus the small pool)
  env.dev.run_until_idle();
  const std::int64_t peak_before = env.alloc.stats().reserved_bytes.peak;
  // The collective on c waits for the other half that this thread enqueues after allocating.
  const std::uint64_t collective = env.dev.hold(c, "collective: waits for this thread");
  void* got = nullptr;
  const auto r = returns_within(
      [&] {
        got = env.alloc.allocate(100 * MiB, u);  // past the peak: 60 MiB idle on s
        env.dev.open(collective);
      },
      10s, [&] { env.dev.open(collective); });
  CHECK(r.returned_in_time);
  INFO(r.error);
  CHECK(r.error.empty());
  CHECK(got != nullptr);
  CHECK(env.host.blocking_calls() == 0);  // no host wait at all
  // The idle chunks served the growth: the peak rose by the 40 MiB the request lacked, not 100.
  CHECK(env.alloc.stats().reserved_bytes.peak <= peak_before + static_cast<std::int64_t>(40 * MiB));
  if (got) {
    env.dev.launch(u, 10, {writes(got, 100 * MiB)}, "use");
    env.alloc.deallocate(got);
  }
  env.dev.run_until_idle();
  env.alloc.empty_cache(empty_cache_mode::wait);
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}

TEST_CASE(
    "cuda_malloc: small blocks of another stream never pin a large cached segment that a large "
    "request needs again",
    "[core][growth][segment-fit]") {
  const empty_cache_mode mode = GENERATE(empty_cache_mode::wait, empty_cache_mode::defer);
  INFO("empty_cache:" << to_string(mode));
  options o = make_options(backend_kind::cuda_malloc, fence_scope::all_streams, mode);
  o.memory_limit_bytes = 20 * GiB;
  sim_env env(o, sim_config(80 * GiB));
  const auto compute = env.dev.create_stream();
  const auto side = env.dev.create_stream();
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    void* buffer = nullptr;
    REQUIRE_NOTHROW(buffer = env.alloc.allocate(16 * GiB, compute));
    env.dev.launch(compute, 10, {writes(buffer, 16 * GiB)}, "buffer");
    env.alloc.deallocate(buffer);  // 16 GiB cached on the compute stream
    env.dev.advance(1000);
    // 80 gradients of 64 MiB on the side stream: past the limit with the 16 GiB cached.
    std::vector<void*> grads;
    for (int i = 0; i < 80; ++i) {
      void* g = nullptr;
      REQUIRE_NOTHROW(g = env.alloc.allocate(64 * MiB, side));
      env.dev.launch(side, 5, {writes(g, 64 * MiB)}, "gradient");
      grads.push_back(g);
    }
    // The 16 GiB segment was not carved into gradients.
    for (void* g : grads)
      CHECK_FALSE((addr(g) >= addr(buffer) && addr(g) < addr(buffer) + 16 * GiB));
    for (std::size_t i = 0; i + 1 < grads.size(); ++i) env.alloc.deallocate(grads[i]);
    env.alloc.empty_cache();
    env.dev.advance(1000);
    // The last gradient stays alive (a loop variable); the buffer fits again.
    void* again = nullptr;
    REQUIRE_NOTHROW(again = env.alloc.allocate(16 * GiB, compute));
    env.dev.launch(compute, 10, {writes(again, 16 * GiB)}, "buffer again");
    env.alloc.deallocate(again);
    env.alloc.deallocate(grads.back());
    env.dev.advance(1000);
  }
  CHECK(env.alloc.stats().reserved_bytes.peak <= static_cast<std::int64_t>(20 * GiB));
  env.dev.run_until_idle();
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}

TEST_CASE(
    "A request the queued memory of another stream can serve is served behind a device-side "
    "wait while an unrelated stream is busy, not refused",
    "[core][growth][release]") {
  options o = make_options(backend_kind::cuda_malloc, fence_scope::all_streams,
                           empty_cache_mode::defer);
  o.release_worker = release_worker_mode::on;
  o.memory_limit_bytes = 1 * GiB;
  sim_env env(o, sim_config(8 * GiB));
  const auto s = env.dev.create_stream();
  const auto t = env.dev.create_stream();
  const auto busy = env.dev.create_stream();
  env.alloc.deallocate(env.alloc.allocate(4 * KiB, busy));  // known to the allocator
  const std::uint64_t h = env.dev.hold(busy, "unrelated long work");
  void* a = env.alloc.allocate(600 * MiB, s);
  env.dev.launch(s, 10, {writes(a, 600 * MiB)}, "produce");
  env.alloc.deallocate(a);
  env.alloc.empty_cache();  // queued: its fence covers the busy stream
  REQUIRE(env.alloc.pending_release_bytes() >= 600 * MiB);
  void* b = nullptr;
  REQUIRE_NOTHROW(b = env.alloc.allocate(500 * MiB, t));  // 600 + 500 > 1 GiB
  env.dev.launch(t, 10, {writes(b, 500 * MiB)}, "consume");
  CHECK(env.alloc.stats().fence_waits == 0);
  CHECK(env.dev.counters().event_syncs + env.dev.counters().bounded_event_syncs == 0);
  CHECK(env.alloc.stats().reserved_bytes.peak <= static_cast<std::int64_t>(1 * GiB));
  env.dev.open(h);
  env.dev.run_until_idle();
  env.alloc.deallocate(b);
  env.alloc.empty_cache(empty_cache_mode::wait);
  CHECK(env.dev.fault_count() == 0);
  env.alloc.check_invariants();
}

TEST_CASE(
    "out_of_memory says it in PyTorch's form first, then allocated, reserved, cached, queued, "
    "pending, graph pools and the largest free block",
    "[core][growth][bad-input]") {
  options o = make_options(backend_kind::expandable, fence_scope::all_streams,
                           empty_cache_mode::defer);
  o.memory_limit_bytes = 1 * GiB;
  sim_env env(o, sim_config(8 * GiB));
  const auto s = env.dev.create_stream();
  void* live = env.alloc.allocate(600 * MiB, s);
  std::string what;
  try {
    env.alloc.allocate(800 * MiB, s);
  } catch (const out_of_memory& e) {
    what = e.what();
  }
  INFO(what);
  REQUIRE_FALSE(what.empty());
  CHECK(what.rfind("CUDA out of memory. Tried to allocate 800.00 MiB. GPU 0 has a total capacity "
                   "of 8.00 GiB of which ",
                   0) == 0);
  CHECK(what.find(" is free. streamsafe: out of memory on device 0") != std::string::npos);
  for (const char* part :
       {"allocated 600.00 MiB", "reserved 600.00 MiB", "cached ", "queued for release ",
        "pending other streams' work ", "held by graphs' private pools ", "largest free block ",
        "limit 1.00 GiB"})
    CHECK(what.find(part) != std::string::npos);
  env.alloc.deallocate(live);
  env.alloc.check_invariants();
}

namespace {

// A simulated device whose virtual address space holds `limit` bytes of reservations: beyond,
// reserve_address_range fails as cuMemAddressReserve does (backend_error).
class address_space_limit final : public forwarding_backend {
 public:
  address_space_limit(sim::simulated_device& dev, std::size_t limit)
      : forwarding_backend(dev), limit_(limit) {}
  void* reserve_address_range(std::size_t size_bytes) override {
    if (used_ + size_bytes > limit_)
      throw backend_error("reserve_address_range: CUDA_ERROR_OUT_OF_MEMORY (address space)");
    used_ += size_bytes;
    return forwarding_backend::reserve_address_range(size_bytes);
  }
  void release_address_range(void* base, std::size_t size_bytes) override {
    used_ -= size_bytes;
    forwarding_backend::release_address_range(base, size_bytes);
  }
  std::size_t used() const { return used_; }

 private:
  std::size_t limit_;
  std::size_t used_ = 0;
};

}  // namespace

TEST_CASE(
    "Expandable: 64 streams' pools fit in a 512 GiB address space, and running out of it says "
    "address space",
    "[core][growth][expandable]") {
  sim::simulated_device dev(sim_config(8 * GiB));
  address_space_limit space(dev, 512 * GiB);
  std::string oom;
  {
    caching_allocator alloc(space, make_options(backend_kind::expandable));
    std::vector<std::pair<stream_handle, std::vector<void*>>> held;
    for (int i = 0; i < 64; ++i) {
      const auto s = dev.create_stream();
      std::vector<void*> blocks;
      INFO("stream " << i << ", address space used " << space.used());
      REQUIRE_NOTHROW(blocks.push_back(alloc.allocate(64 * MiB, s)));  // the large pool
      REQUIRE_NOTHROW(blocks.push_back(alloc.allocate(4 * KiB, s)));   // the small pool
      held.emplace_back(s, std::move(blocks));
    }
    CHECK(space.used() <= 512 * GiB);
    for (auto& [s, blocks] : held)
      for (void* b : blocks) alloc.deallocate(b);
    alloc.check_invariants();
  }
  // A space too small for one more range: out_of_memory, and it says why.
  address_space_limit tiny(dev, 8 * GiB + 4 * MiB);
  caching_allocator alloc(tiny, make_options(backend_kind::expandable));
  const auto s = dev.create_stream();
  void* a = alloc.allocate(64 * MiB, s);  // a range that spans the 8 GiB limit
  try {
    alloc.allocate(4 * KiB, s);  // the small pool needs a range of its own: 2 MiB fit, not more
  } catch (const out_of_memory& e) {
    oom = e.what();
  }
  void* b = nullptr;
  const auto t = dev.create_stream();
  try {
    b = alloc.allocate(64 * MiB, t);  // no room for another 64 MiB range at all
  } catch (const out_of_memory& e) {
    oom = e.what();
  }
  INFO(oom);
  CHECK(b == nullptr);
  CHECK(oom.find("address space") != std::string::npos);
  alloc.deallocate(a);
  alloc.check_invariants();
}
