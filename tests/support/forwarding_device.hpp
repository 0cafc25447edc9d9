// Test support: a device_backend that forwards every call to a simulated device
// (forwarding_backend). Tests derive from it and override the calls they hook (a delay, a
// callback, a remapped stream), reaching the device itself through dev_.
#pragma once

#include <streamsafe/backends/forwarding_backend.hpp>
#include <streamsafe/sim/simulated_device.hpp>

namespace streamsafe::test {

class forwarding_device : public forwarding_backend {
 public:
  explicit forwarding_device(sim::simulated_device& dev) : forwarding_backend(dev), dev_(dev) {}

 protected:
  sim::simulated_device& dev_;
};

}  // namespace streamsafe::test
