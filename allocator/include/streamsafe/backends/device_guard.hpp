// streamsafe: device_guard, a scoped "make this device current".
//
// The constructor makes `device` current for the calling thread (skipping cudaSetDevice when it
// already is) and throws streamsafe::backend_error when it cannot; the destructor restores the
// device that was current before (errors are logged, never thrown).
//
// Thread safety: the current device is per host thread, so a guard affects only the thread that
// made it; it must be destroyed on that thread. Not copyable, not movable.
#pragma once

namespace streamsafe::cuda {

class device_guard {
 public:
  explicit device_guard(int device);
  ~device_guard();
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  device_guard(device_guard&&) = delete;
  device_guard& operator=(device_guard&&) = delete;

  int device() const noexcept { return device_; }
  int previous_device() const noexcept { return previous_; }

 private:
  int device_;
  int previous_ = -1;
};

}  // namespace streamsafe::cuda
