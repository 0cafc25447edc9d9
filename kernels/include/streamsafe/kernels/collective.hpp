// streamsafe test kernels: a collective-like pair of kernels on two devices that wait on each
// other through flags in memory both devices (and the host) can see, as the two halves of an
// all-reduce do (case K8). A plain C++ header (only <cuda_runtime_api.h>).
//
// Flags: an array of unsigned ints in memory that every device involved can read and write, for
// instance pinned host memory from cudaHostAlloc(cudaHostAllocPortable | cudaHostAllocMapped)
// (pass the device pointer, cudaHostGetDevicePointer), or device memory with peer access. The
// host may set a flag itself to stand in for the other half.
#pragma once

#include <cuda_runtime_api.h>

namespace streamsafe::kernels {

// Enqueues one half of the exchange on `stream`: one thread stores `generation` into
// flags[self] (a system-wide visible store), then spins until flags[peer] >= generation or
// until `timeout_ms` has passed on the GPU's global timer, and stores 1 (the peer arrived) or 0
// (timed out: the other half never came) into *arrived. The spin is bounded, so a collective
// whose other half is never enqueued ends as a failure instead of a hang. self != peer; flags
// and arrived must not be null; timeout_ms in [0, 3.6e6] (one hour). Returns cudaErrorInvalidValue
// for bad arguments (nothing launched), else the launch status. Nothing here synchronises.
cudaError_t launch_exchange_flags(unsigned* flags, int self, int peer, unsigned generation,
                                  double timeout_ms, int* arrived, cudaStream_t stream);

}  // namespace streamsafe::kernels
