// Case K11 through cuda::allocator, the multi-device front end, over simulated devices: the
// capture is announced to the allocator of the stream's device, which then serves the stream
// from the graph's pool and releases nothing; the graph id releases the pool on that device.
#include "support/sim_fixture.hpp"

#include <streamsafe/frontends/allocator.hpp>
#include <streamsafe/sim/simulated_platform.hpp>

#include <catch2/catch.hpp>

using namespace streamsafe;
using streamsafe::cuda::simulated_platform;
using streamsafe::test::MiB;

TEST_CASE("The front end announces a capture to the stream's device and releases the graph there",
          "[frontend][graph][cases][K11]") {
  simulated_platform platform{2};
  cuda::allocator alloc{options{}, platform.make_platform()};
  simulated_platform::set_current_device(1);
  sim::simulated_device& dev = platform.device(1);
  const stream_handle s = dev.create_stream();
  auto* stream = reinterpret_cast<cudaStream_t>(s);

  alloc.deallocate(alloc.allocate(64 * MiB, 1, stream));  // cache on device 1
  const std::uint64_t id = alloc.notify_capture_begin(stream);
  dev.begin_capture(s);
  CHECK(alloc.device_allocator(1).capture_underway());
  CHECK_FALSE(alloc.device_allocator(0).capture_underway());
  CHECK(alloc.empty_cache() == 0);
  void* p = alloc.allocate(64 * MiB, 1, stream);
  dev.launch(s, 10, {{simulated_platform::device_address(p, 1), 64 * MiB, sim::access::write, 1}},
             "captured");
  alloc.deallocate(p);
  REQUIRE_NOTHROW(dev.end_capture(s));
  CHECK(alloc.notify_capture_end(stream) == id);
  CHECK_THROWS_AS(alloc.notify_capture_end(stream), std::invalid_argument);
  CHECK_THROWS_AS(alloc.notify_capture_begin(nullptr), std::invalid_argument);
  alloc.notify_graph_released(id, 1);
  CHECK_THROWS_AS(alloc.notify_graph_released(id, 1), std::invalid_argument);
  alloc.empty_cache();
  CHECK(alloc.stats(1).reserved_bytes.current == 0);
  CHECK(dev.fault_count() == 0);
  simulated_platform::set_current_device(0);
}
