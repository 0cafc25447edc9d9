// streamsafe core: the stream lock (internal). A test-and-test-and-set lock that spins briefly,
// then yields: the fast path holds it for tens of nanoseconds, so an uncontended acquire must
// cost one atomic exchange (std::mutex costs several times that). Slow paths may hold it across
// a driver call; waiters then yield the CPU instead of spinning. Satisfies Lockable.
#pragma once

#include <atomic>
#include <thread>

namespace streamsafe::detail {

class spin_lock {
 public:
  void lock() noexcept {
    for (int spins = 0;; ++spins) {
      if (!locked_.exchange(true, std::memory_order_acquire)) return;
      while (locked_.load(std::memory_order_relaxed)) {
        if (++spins > 64) std::this_thread::yield();
      }
    }
  }
  bool try_lock() noexcept {
    return !locked_.load(std::memory_order_relaxed) && !locked_.exchange(true, std::memory_order_acquire);
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

}  // namespace streamsafe::detail
