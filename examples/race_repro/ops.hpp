// race_repro: the two device_ops implementations.
#pragma once

#include "scenario.hpp"

#include <memory>

namespace race_repro {

// Real kernels on GPU `device`, memory from the expandable (VMM) backend.
std::unique_ptr<device_ops> make_gpu_ops(int device);
// The simulated device: kernels are timed work items over the same address ranges, with a
// bandwidth model of the H200 (about 4.3 TB/s) and a host cost per launch.
std::unique_ptr<device_ops> make_sim_ops();
// The simulated device's faults so far, as text (empty when none).
std::string sim_fault_summary(device_ops& ops);

}  // namespace race_repro
