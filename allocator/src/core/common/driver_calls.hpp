// streamsafe core: driver calls made with the device lock dropped (internal): fence waits and
// releases (release.cpp, ipc.cpp, destruction.cpp) and pause/resume calls (sleep.cpp).
// Lock rule: impl::driver_calls_ is GUARDED_BY(mu_), the device lock: `in_flight` counts the
// calls running with mu_ dropped, and waiters (notify_capture_begin waits for none; a tag's
// resume and pause wait for its calls) wait on `done` with mu_ (a device_lock) released inside
// the wait. driver_call_scope drops mu_ for its call and takes it back before it counts the
// call done, so every change of `in_flight` is made under mu_.
#pragma once

#include "core/common/thread_annotations.hpp"

#include <condition_variable>

namespace streamsafe::detail {

struct driver_calls {
  int in_flight = 0;
  std::condition_variable_any done;  // notified when in_flight drops to 0 (and by tag calls)
};

// Drops mu_ around a host-blocking or releasing driver call and counts it in flight; relock()
// (or the destructor, on an exception) takes mu_ back.
class driver_call_scope {
 public:
  driver_call_scope(driver_calls& calls,
                    unique_lock<mutex>& lk) STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS : calls_(calls),
                                                                                   lk_(lk) {
    ++calls_.in_flight;
    lk_.unlock();
  }
  void relock() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
    if (done_) return;
    lk_.lock();
    done_ = true;
    if (--calls_.in_flight == 0) calls_.done.notify_all();
  }
  ~driver_call_scope() { relock(); }
  driver_call_scope(const driver_call_scope&) = delete;
  driver_call_scope& operator=(const driver_call_scope&) = delete;

 private:
  driver_calls& calls_;
  unique_lock<mutex>& lk_;
  bool done_ = false;
};

}  // namespace streamsafe::detail
