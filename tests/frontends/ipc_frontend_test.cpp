// IPC through cuda::allocator on simulated devices: export routed to the owning
// device, import on a named device, the release routed back to the producer's device by the
// message, and the producer's free held until the consumer's read has completed.
#include "support/sim_fixture.hpp"

#include <streamsafe/core/errors.hpp>
#include <streamsafe/frontends/allocator.hpp>
#include <streamsafe/sim/simulated_platform.hpp>

#include <catch2/catch.hpp>

using streamsafe::ipc_error;
using streamsafe::options;
using streamsafe::stream_handle;
using streamsafe::cuda::allocator;
using streamsafe::cuda::simulated_platform;
using streamsafe::test::MiB;
namespace sim = streamsafe::sim;

TEST_CASE("cuda::allocator exports on the owning device and learns the consumer's release",
          "[frontend][ipc]") {
  simulated_platform platform(2);
  allocator producer(options{}, platform.make_platform());
  allocator consumer(options{}, platform.make_platform());
  simulated_platform::set_current_device(0);
  sim::simulated_device& dev1 = platform.device(1);
  const stream_handle ps = dev1.create_stream(), cs = dev1.create_stream();
  void* p = producer.allocate(4 * MiB, 1, reinterpret_cast<cudaStream_t>(ps));
  const streamsafe::ipc_handle h = producer.export_block(p);  // device 0 current: routed to 1
  CHECK(streamsafe::ipc_handle_device(h) == 1);
  const streamsafe::imported_block imp = consumer.import_block(h, 1);
  CHECK(imp.ptr == p);
  dev1.launch(
      cs, 500,
      {{simulated_platform::device_address(imp.ptr, 1), 4 * MiB, sim::access::read, std::nullopt}},
      "consumer read");
  const streamsafe::ipc_release r = consumer.release_import(imp.ptr,
                                                            reinterpret_cast<cudaStream_t>(cs));
  CHECK_THROWS_AS(consumer.release_import(imp.ptr, reinterpret_cast<cudaStream_t>(cs)), ipc_error);
  producer.deallocate(p);
  producer.notify_import_released(r);  // routed to device 1 by the message
  CHECK(producer.device_allocator(1).ipc_status().held_frees == 1);
  void* q = producer.allocate(4 * MiB, 1, reinterpret_cast<cudaStream_t>(ps));
  CHECK(q != p);
  producer.empty_cache();  // wait mode: waits on the consumer's event, then releases
  CHECK(producer.device_allocator(1).ipc_status().held_frees == 0);
  producer.deallocate(q);
  consumer.reclaim();
  CHECK(consumer.device_allocator(1).ipc_status().closing == 0);
  CHECK_THROWS_AS(consumer.release_import(q, nullptr), ipc_error);
  CHECK(dev1.fault_count() == 0);
}
