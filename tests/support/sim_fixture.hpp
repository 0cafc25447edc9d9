// Test support: the real caching allocator over a simulated device.
#pragma once

#include <streamsafe/core/caching_allocator.hpp>
#include <streamsafe/sim/simulated_device.hpp>

#include <cstdint>
#include <optional>

namespace streamsafe::test {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

inline options make_options(backend_kind backend, fence_scope scope = fence_scope::all_streams,
                            empty_cache_mode mode = empty_cache_mode::wait) {
  options o;
  o.backend = backend;
  o.release_fence = scope;
  o.empty_cache = mode;
  return o;
}

inline sim::device_config sim_config(std::size_t total_bytes = 8 * GiB, int device = 0) {
  sim::device_config c;
  c.total_bytes = total_bytes;
  c.device = device;
  return c;
}

struct sim_env {
  sim::simulated_device dev;
  caching_allocator alloc;
  explicit sim_env(options o = {}, sim::device_config c = sim_config()) : dev(c), alloc(dev, o) {}
};

inline std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

inline sim::range reads(const void* p, std::size_t n) {
  return {addr(p), n, sim::access::read, std::nullopt};
}
inline sim::range writes(const void* p, std::size_t n,
                         std::optional<std::uint8_t> v = std::nullopt) {
  return {addr(p), n, sim::access::write, v};
}

}  // namespace streamsafe::test
