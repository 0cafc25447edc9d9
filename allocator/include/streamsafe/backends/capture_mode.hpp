// streamsafe: relaxed_capture_mode, a scoped "this thread may make a growth call during a CUDA
// graph capture".
//
// In the default (global) capture mode, a potentially unsafe call such as cudaMalloc, made from
// any thread while a stream captures, fails and invalidates the capture. A thread in relaxed
// mode may make it: the call is not captured (it runs now, once, and is not repeated when the
// graph replays), which is what a caching allocator wants from growth. The guard swaps the
// calling thread's mode to cudaStreamCaptureModeRelaxed (cudaThreadExchangeStreamCaptureMode)
// and swaps the previous mode back on destruction. Relaxed mode does not permit what conflicts
// with a capture (querying or synchronising a captured event); the allocator never does that.
//
// Thread safety: the mode is per host thread; destroy the guard on the thread that made it.
#pragma once

#include <cuda_runtime_api.h>

namespace streamsafe::cuda {

class relaxed_capture_mode {
 public:
  relaxed_capture_mode() noexcept {
    if (cudaThreadExchangeStreamCaptureMode(&mode_) != cudaSuccess) {
      (void)cudaGetLastError();
      swapped_ = false;
    }
  }
  ~relaxed_capture_mode() {
    if (swapped_ && cudaThreadExchangeStreamCaptureMode(&mode_) != cudaSuccess)
      (void)cudaGetLastError();
  }
  relaxed_capture_mode(const relaxed_capture_mode&) = delete;
  relaxed_capture_mode& operator=(const relaxed_capture_mode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool swapped_ = true;
};

}  // namespace streamsafe::cuda
