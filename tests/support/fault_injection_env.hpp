// Test support for fault injection: the allocator over a simulated device whose calls fail on
// demand (fi_env, which checks what the allocator promises after a failure and drains it), the
// four backend and empty_cache variants each scenario runs under, and a check that a call
// throws backend_error naming the failed driver call.
#pragma once

#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <streamsafe/core/caching_allocator.hpp>
#include <streamsafe/core/errors.hpp>

#include <optional>
#include <string>
#include <vector>

namespace streamsafe::test {

// The allocator in an optional, so that a test can destroy it before checking the device.
struct fi_env {
  sim::simulated_device dev;
  std::optional<caching_allocator> alloc;
  explicit fi_env(options o, sim::device_config c = sim_config()) : dev(c) {
    alloc.emplace(dev, o);
  }
  ~fi_env() { alloc.reset(); }

  caching_allocator& a() { return *alloc; }

  // Everything the allocator promises after any failure.
  void check_consistent() {
    a().check_invariants();
    const statistics s = a().stats();
    CHECK(static_cast<std::size_t>(s.reserved_bytes.current) == dev.bytes_in_use());
    CHECK(s.allocated_bytes.current <= s.active_bytes.current);
    CHECK(s.active_bytes.current <= s.reserved_bytes.current);
  }

  // Frees `live`, drains the device and the cache: nothing may stay reserved, no fault, no
  // event leaked once the allocator is gone.
  void drain(std::vector<void*> live) {
    for (void* p : live) a().deallocate(p);
    dev.run_until_idle();
    a().empty_cache(empty_cache_mode::wait);
    check_consistent();
    CHECK(a().stats().reserved_bytes.current == 0);
    CHECK(a().pending_release_bytes() == 0);
    CHECK(dev.bytes_in_use() == 0);
    alloc.reset();
    const sim::counters c = dev.counters();
    CHECK(c.events_created == c.events_destroyed);
    CHECK(dev.fault_count() == 0);
  }
};

struct variant {
  backend_kind backend;
  empty_cache_mode mode;
};

inline const variant all_variants[] = {{backend_kind::cuda_malloc, empty_cache_mode::wait},
                                       {backend_kind::cuda_malloc, empty_cache_mode::defer},
                                       {backend_kind::expandable, empty_cache_mode::wait},
                                       {backend_kind::expandable, empty_cache_mode::defer}};

inline options opts(const variant& v, fence_scope scope = fence_scope::all_streams) {
  options o = make_options(v.backend, scope, v.mode);
  o.expandable_chunk_bytes = 2 * MiB;
  return o;
}

inline std::string describe(const variant& v) {
  return std::string(to_string(v.backend)) + "/" + to_string(v.mode);
}

// Calls f, which must throw backend_error naming `call`.
template <class F>
inline void require_backend_error(F&& f, const char* call) {
  try {
    f();
    FAIL("expected backend_error from an injected " << call << " failure");
  } catch (const backend_error& e) {
    CHECK(std::string(e.what()).find(call) != std::string::npos);
  }
}

// A stream the allocator has seen (the all_streams fence covers it).
inline stream_handle seen_stream(fi_env& env) {
  const stream_handle s = env.dev.create_stream();
  env.a().deallocate(env.a().allocate(512, s));
  return s;
}

}  // namespace streamsafe::test
