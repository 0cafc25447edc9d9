// Test support: the simulated device's faults counted and printed, and the EACH_BACKEND section
// that runs a test once per backend.
#pragma once

#include <streamsafe/core/options.hpp>
#include <streamsafe/sim/simulated_device.hpp>

#include <cstddef>
#include <string>

namespace streamsafe::test {

// How many of the device's faults are of `kind`.
inline std::size_t count_faults(const sim::simulated_device& dev, sim::fault_kind kind) {
  std::size_t n = 0;
  for (const auto& f : dev.faults()) n += f.kind == kind ? 1 : 0;
  return n;
}

// Every fault's message, one a line (for INFO).
inline std::string fault_text(const sim::simulated_device& dev) {
  std::string text;
  for (const auto& f : dev.faults()) text += f.message + "\n";
  return text;
}

inline const char* name_of(backend_kind b) {
  return b == backend_kind::expandable ? "expandable" : "cuda_malloc";
}

}  // namespace streamsafe::test

// Runs the test once per backend (Catch2 GENERATE), naming it in failure messages.
#define EACH_BACKEND(backend)                                                                 \
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable); \
  INFO("backend " << name_of(backend))
