// streamsafe core: the spin lock (internal). A test-and-test-and-set lock that spins briefly,
// then yields: the fast path holds it for tens of nanoseconds, so an uncontended acquire must
// cost one atomic exchange. Slow paths may hold it across a driver call; waiters then yield the
// CPU instead of spinning. Satisfies Lockable; the stream lock (stream_lock.hpp).
#pragma once

#include "core/common/thread_annotations.hpp"

#include <atomic>
#include <thread>

namespace streamsafe::detail {

// Waits until done() returns true: spins briefly, then yields the CPU between checks (as lock
// does).
template <class Done>
void spin_until(Done done) noexcept {
  for (int spins = 0; !done();) {
    if (++spins > 64) std::this_thread::yield();
  }
}

class STREAMSAFE_CAPABILITY("mutex") spin_lock {
 public:
  void lock() noexcept STREAMSAFE_ACQUIRE() {
    for (int spins = 0;; ++spins) {
      if (!locked_.exchange(true, std::memory_order_acquire)) return;
      while (locked_.load(std::memory_order_relaxed)) {
        if (++spins > 64) std::this_thread::yield();
      }
    }
  }
  bool try_lock() noexcept STREAMSAFE_TRY_ACQUIRE(true) {
    return !locked_.load(std::memory_order_relaxed) &&
           !locked_.exchange(true, std::memory_order_acquire);
  }
  void unlock() noexcept STREAMSAFE_RELEASE() { locked_.store(false, std::memory_order_release); }
  // A relaxed look (no ordering): true while some thread holds the lock.
  bool is_locked() const noexcept { return locked_.load(std::memory_order_relaxed); }

 private:
  std::atomic<bool> locked_{false};
};

}  // namespace streamsafe::detail
