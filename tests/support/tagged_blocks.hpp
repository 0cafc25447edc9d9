// Test support for sleep and wake: the options they run under (expandable backend, no release
// worker) and a tag's blocks, weights written with a value and a gradient buffer.
#pragma once

#include "support/sim_fixture.hpp"

#include <streamsafe/core/caching_allocator.hpp>
#include <streamsafe/core/sleep.hpp>

#include <cstdint>

namespace streamsafe::test {

// The expandable backend, the worker off: pauses and resumes run on the calling thread.
inline options sleep_options(fence_scope scope = fence_scope::all_streams,
                             empty_cache_mode mode = empty_cache_mode::wait) {
  options o = make_options(backend_kind::expandable, scope, mode);
  o.release_worker = release_worker_mode::off;
  return o;
}

// A tag's blocks on stream s: weights (written with `value`) and a gradient buffer.
struct tagged_blocks {
  void* weights = nullptr;
  void* grads = nullptr;
};

inline tagged_blocks allocate_tagged(caching_allocator& a, sim::simulated_device& dev,
                                     stream_handle s, std::uint8_t value) {
  tag_scope scope("train");
  tagged_blocks t;
  t.weights = a.allocate(48 * MiB, s);
  t.grads = a.allocate(3 * MiB, s);
  dev.launch(s, 5, {writes(t.weights, 48 * MiB, value)}, "init weights");
  dev.run_until_idle();
  return t;
}

}  // namespace streamsafe::test
