// streamsafe core: the device's event pool (internal): recorded-and-done events kept for reuse,
// shared by every stream (each stream_state also keeps a few under its own lock first).
// Lock rule: its own `mu_`, a leaf (nothing is taken while holding it); every member takes it
// and drops it before returning. Creating and destroying events is the caller's (a backend call
// made without this lock).
#pragma once

#include "core/common/thread_annotations.hpp"

#include <streamsafe/backends/device_backend.hpp>

#include <utility>
#include <vector>

namespace streamsafe::detail {

class event_pool {
 public:
  // A pooled event into e; false (e untouched) when the pool is empty.
  bool take(event_handle& e) STREAMSAFE_EXCLUDES(mu_) {
    lock_guard<mutex> lk(mu_);
    if (free_.empty()) return false;
    e = free_.back();
    free_.pop_back();
    return true;
  }
  void put(event_handle e) STREAMSAFE_EXCLUDES(mu_) {
    lock_guard<mutex> lk(mu_);
    free_.push_back(e);
  }
  // Every pooled event, the pool left empty (destruction: the caller destroys them).
  std::vector<event_handle> drain() STREAMSAFE_EXCLUDES(mu_) {
    lock_guard<mutex> lk(mu_);
    return std::exchange(free_, {});
  }

 private:
  mutable mutex mu_;
  std::vector<event_handle> free_ STREAMSAFE_GUARDED_BY(mu_);
};

}  // namespace streamsafe::detail
