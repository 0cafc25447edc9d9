// A C++ consumer of the installed streamsafe package (find_package(streamsafe), target
// streamsafe::streamsafe): the caching allocator and the multi-device front end over simulated
// devices. Exit status 0 when every check passed.
#include <streamsafe/core/caching_allocator.hpp>
#include <streamsafe/frontends/allocator.hpp>
#include <streamsafe/sim/simulated_device.hpp>
#include <streamsafe/sim/simulated_platform.hpp>

#include <cstdio>

int main() {
  int failures = 0;
  auto check = [&](bool ok, const char* what) {
    if (!ok) {
      std::fprintf(stderr, "consumer: check failed: %s\n", what);
      ++failures;
    }
  };

  // One device's caching allocator over a simulated device.
  streamsafe::sim::simulated_device device;
  streamsafe::caching_allocator alloc(device,
                                      streamsafe::options::parse("release_fence:all_streams"));
  const streamsafe::stream_handle s = device.create_stream();
  void* p = alloc.allocate(1 << 20, s);
  alloc.deallocate(p);
  check(alloc.allocate(1 << 20, s) == p, "same-stream reuse");
  alloc.deallocate(p);
  check(alloc.empty_cache() > 0, "empty_cache released the segment");
  alloc.check_invariants();

  // The multi-device front end over two simulated devices: a free routed to its device.
  streamsafe::cuda::simulated_platform platform(2);
  {
    streamsafe::cuda::allocator front(streamsafe::options{}, platform.make_platform());
    void* q = front.allocate(4096, 1, nullptr);
    streamsafe::cuda::simulated_platform::set_current_device(0);
    front.deallocate(q);
    check(front.stats(1).allocated_bytes.current == 0, "free routed to device 1");
  }
  std::printf("consumer (C++): %s\n", failures == 0 ? "ok" : "FAILED");
  return failures == 0 ? 0 : 1;
}
