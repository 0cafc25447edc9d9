// The collective-like pair of kernels (see streamsafe/kernels/collective.hpp): one thread per
// half, flags written and polled through volatile accesses with system-wide fences, so that the
// halves see each other across devices and the host; the wait is bounded by %globaltimer.
#include <cmath>
#include <cstdint>

#include "detail.cuh"
#include "streamsafe/kernels/collective.hpp"

namespace streamsafe::kernels {
namespace {

__global__ void exchange_flags_kernel(unsigned* flags, int self, int peer, unsigned generation,
                                      std::uint64_t timeout_ns, int* arrived) {
  volatile unsigned* f = flags;
  f[self] = generation;
  __threadfence_system();
  const std::uint64_t start = detail::globaltimer_ns();
  int came = 0;
  for (;;) {
    if (f[peer] >= generation) {
      came = 1;
      break;
    }
    if (detail::globaltimer_ns() - start >= timeout_ns) break;
    __nanosleep(1000);
  }
  __threadfence_system();
  *static_cast<volatile int*>(arrived) = came;
  __threadfence_system();
}

}  // namespace

cudaError_t launch_exchange_flags(unsigned* flags, int self, int peer, unsigned generation,
                                  double timeout_ms, int* arrived, cudaStream_t stream) {
  if (flags == nullptr || arrived == nullptr || self < 0 || peer < 0 || self == peer)
    return cudaErrorInvalidValue;
  if (!(timeout_ms >= 0.0 && timeout_ms <= 3.6e6)) return cudaErrorInvalidValue;
  const auto ns = static_cast<std::uint64_t>(std::llround(timeout_ms * 1e6));
  exchange_flags_kernel<<<1, 1, 0, stream>>>(flags, self, peer, generation, ns, arrived);
  return cudaGetLastError();
}

}  // namespace streamsafe::kernels
