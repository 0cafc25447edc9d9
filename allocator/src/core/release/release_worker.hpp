// streamsafe core: the release worker's state (internal; release_worker.cpp has the thread).
// One thread per allocator (options::release_worker on), started by the first release handed
// to it and stopped and joined first thing in destroy_all; it polls the release queue's fences
// and the pauses and resumes of tags, with the device lock dropped around driver calls.
// Lock rule: impl::worker_ is GUARDED_BY(mu_), the device lock: the thread object, the flags
// and the pass counters are read and written under it; the worker waits on `wake` and callers
// wait for a pass on `settled`, both with mu_ (a device_lock) released inside the wait.
// The condition variables are on the heap: a forked child must not destroy them (the parent's
// worker may have been waiting on one at the fork, and destroying a condition variable waits
// for its waiters); stop_worker leaks them there with the thread object.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <thread>

namespace streamsafe::detail {

struct release_worker {
  std::unique_ptr<std::thread> thread;
  std::int64_t pid = 0;  // the process that started the thread (0: none started)
  bool stop = false;
  bool kick = false;    // a pass is wanted now (new work, a waiter)
  bool failed = false;  // could not start: releases stay synchronous
  // A pass is giving memory back (driver calls, mu_ dropped). Its bytes can grow meanwhile: an
  // unmap elsewhere can make a ghost in flight the owner of its memory (reclaim.cpp).
  bool releasing = false;
  std::uint64_t passes_begun = 0;
  std::uint64_t passes_done = 0;
  std::unique_ptr<std::condition_variable_any> wake =
      std::make_unique<std::condition_variable_any>();
  std::unique_ptr<std::condition_variable_any> settled =
      std::make_unique<std::condition_variable_any>();  // callers waiting for a pass

  // Asks for a pass now and wakes the thread.
  void kick_now() {
    kick = true;
    wake->notify_one();
  }
  bool woken() const noexcept { return stop || kick; }  // the thread's wait ends
  bool passed(std::uint64_t pass) const noexcept { return stop || passes_done >= pass; }
};

}  // namespace streamsafe::detail
