// streamsafe: which GPUs are there, and which one is current.
//
//  device_count()    the number of CUDA devices; 0 where there is none, whatever the reason
//                    (no driver: cudaErrorInsufficientDriver; no device: cudaErrorNoDevice;
//                    anything else). Never throws; clears the runtime's last error it caused.
//  current_device()  the calling thread's current device; throws streamsafe::backend_error.
//
// Thread safety: both are safe from any thread (the current device is per host thread).
#pragma once

namespace streamsafe::cuda {

int device_count() noexcept;
int current_device();

}  // namespace streamsafe::cuda
