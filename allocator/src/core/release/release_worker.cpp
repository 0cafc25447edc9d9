// streamsafe core: the release worker (options::release_worker on).
//
// In defer mode without a worker, empty_cache gives back on the calling thread what is safe
// right now (the driver's unmap: about 1 ms per 264 MiB on an H200) and later calls finish the
// queue, so a caller sees a fast call and then a slow one. With the worker, empty_cache (and the
// releases of allocate's slow path) fence and queue the whole batch (hand_to_worker_locked) and
// return; a thread per allocator then polls the queue: each pass asks the backend whether a
// capture is underway (stream_is_capturing) and, when none is, moves out of every queued batch
// the blocks whose own fence streams are idle now (take_safe_locked: event queries, and for a
// backend whose free_segment waits for the whole device, only while every known stream is idle)
// and gives them back in one release_batch_memory, with mu_ dropped around the driver calls. It
// never waits on an event: between passes it sleeps on a condition variable, woken by new work,
// by a caller that waits for a pass, or after a delay growing from k_poll_min to k_poll_max
// while nothing completes. A failed driver call puts its memory back in the pool
// (release_batch_memory), is logged, and the worker goes on.
// Locks: the worker holds mu_ while it polls and between passes only inside the condition
// variable's wait (mu_ released). Callers wait for a pass on worker_.settled, mu_ released.
// Fork: pthread_atfork handlers take the device lock of every allocator with a running worker
// (try_lock, for at most k_fork_lock_wait each) so that the child never inherits it held by the
// worker; in the child the worker does not exist (worker_usable_locked compares process ids) and
// the destructor neither joins nor destroys the parent's thread object. Exit: an atexit handler
// stops every worker (bounded, no join) before the CUDA runtime's own teardown.
#include "core/allocator_impl.hpp"
#include "core/common/logging.hpp"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

namespace streamsafe {

namespace {

constexpr auto k_poll_min = std::chrono::microseconds(20);
constexpr auto k_poll_max = std::chrono::microseconds(1000);
constexpr auto k_fork_lock_wait = std::chrono::milliseconds(100);

// Allocators with a running worker (as void*: the impl type is private to caching_allocator).
struct fork_registry {
  std::mutex mu;
  std::vector<void*> live;
  std::vector<void*> held;  // device locks taken by fork_prepare
};

fork_registry& registry() {
  static fork_registry* r = new fork_registry;  // never destroyed: fork handlers outlive statics
  return *r;
}

std::once_flag g_atfork_once;

}  // namespace

// pthread_atfork handlers: the forking thread takes (try_lock, bounded) the device lock of every
// allocator with a running worker, so that no worker holds it in the child; at_exit stops every
// worker, bounded, no join.
struct caching_allocator::impl::process_hooks {
  static void fork_prepare() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS;
  static void fork_parent() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS;
  static void fork_child() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS;
  static void at_exit() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS;
};

std::int64_t caching_allocator::impl::current_pid() noexcept {
  return static_cast<std::int64_t>(::getpid());
}

// The option is on, the thread could start, and this is the process that made the allocator.
bool caching_allocator::impl::worker_usable_locked() const {
  if (opts_.release_worker != release_worker_mode::on || worker_.failed || worker_.stop)
    return false;
  const std::int64_t pid = current_pid();
  return pid == creator_pid_ && (worker_.pid == 0 || worker_.pid == pid);
}

// The worker is giving memory back right now (driver calls): what it gives back still counts
// as reserved until they end.
bool caching_allocator::impl::worker_release_in_flight_locked() const {
  return stats_.release_worker_bytes != 0 || worker_.releasing;
}

bool caching_allocator::impl::worker_releases_locked(empty_cache_mode mode) const {
  return mode == empty_cache_mode::defer && worker_usable_locked();
}

// Starts the release worker if it is not running; false when it cannot run.
bool caching_allocator::impl::ensure_worker_locked() {
  if (worker_.thread) return true;
  if (!worker_usable_locked()) return false;
  try {
    worker_.thread = std::make_unique<std::thread>([this] { worker_main(); });
    worker_.pid = current_pid();
    std::call_once(g_atfork_once, [] {
      ::pthread_atfork(&process_hooks::fork_prepare, &process_hooks::fork_parent,
                       &process_hooks::fork_child);
      std::atexit(&process_hooks::at_exit);  // after the CUDA runtime's own handler: runs before
                                             // its teardown
    });
    std::lock_guard<std::mutex> rlk(registry().mu);
    registry().live.push_back(this);
  } catch (const std::exception& e) {
    // Queued work stays: later calls finish it on their own thread, as with the worker off.
    worker_.failed = true;
    detail::log().warn(
        "device {}: the release worker could not start ({}); releases stay on the calling threads",
        backend_.device(), e.what());
    return false;
  }
  return true;
}

// Fences the whole batch and queues it for the worker; nothing is released on this thread.
void caching_allocator::impl::hand_to_worker_locked(release_batch& batch) {
  if (batch.blocks.empty()) return;
  try {
    record_fence_locked(batch);
  } catch (...) {
    restore_batch_locked(batch);
    throw;
  }
  queue_batch_locked(batch);
  if (!ensure_worker_locked()) return;  // the queue stays: later calls finish it
  worker_.kick_now();
}

// One pass: every queued block whose own fence streams are idle now goes back (one batch).
std::size_t caching_allocator::impl::worker_pass_locked(device_lock& lk) {
  detect_captures_locked(lk);
  if (capturing()) return 0;  // capture.cpp: no query, no release meanwhile
  if (sleep_.resumes_pending != 0) advance_resumes_locked(lk);                      // wake.cpp
  if (sleep_.host_trim_pending) trim_host_locked(lk, nullptr);                      // wake.cpp
  std::size_t paused = sleep_.pauses_pending != 0 ? advance_pauses_locked(lk) : 0;  // sleep.cpp
  if (releases_.empty() || capturing()) return paused;
  release_batch now;
  std::exception_ptr error;
  try {
    now = take_completed_locked();
  } catch (...) {
    error = std::current_exception();  // what was taken before the failure still goes back
  }
  std::size_t released = 0;
  if (now.blocks.empty()) {
    for (auto& e : now.fence) put_event(e.event);
  } else {
    const std::size_t bytes = now.bytes;
    stats_.release_worker_bytes += bytes;
    worker_.releasing = true;
    try {
      released = release_batch_memory(lk, now);
    } catch (...) {
      if (!lk.owns_lock()) lk.lock();
      restore_batch_locked(now);  // only what release_batch_memory had not reached yet
      if (!error) error = std::current_exception();
    }
    worker_.releasing = false;
    stats_.release_worker_bytes -= bytes;
    ++stats_.release_worker_releases;
    detail::log().debug("device {}: release worker gave back {} of {} bytes whose fences completed",
                        backend_.device(), released, bytes);
  }
  if (error) std::rethrow_exception(error);
  return released + paused;
}

void caching_allocator::impl::worker_main() {
  device_lock lk(mu_);
  auto delay = std::chrono::duration_cast<std::chrono::microseconds>(k_poll_min);
  auto wake = [&]() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS { return worker_.woken(); };  // mu_ held
  while (!worker_.stop) {
    const std::uint64_t pass = ++worker_.passes_begun;
    worker_.kick = false;
    std::size_t released = 0;
    try {
      released = worker_pass_locked(lk);
    } catch (const std::exception& e) {
      if (!lk.owns_lock()) lk.lock();
      detail::log().warn(
          "device {}: release worker: {}; the memory stays cached (or queued) and is tried again",
          backend_.device(), e.what());
    } catch (...) {
      if (!lk.owns_lock()) lk.lock();
    }
    worker_.passes_done = pass;
    worker_.settled->notify_all();
    if (worker_.stop) break;
    if (worker_.kick) {
      delay = k_poll_min;
      continue;
    }
    if (releases_.empty() && sleep_.pauses_pending == 0 && sleep_.resumes_pending == 0) {
      worker_.wake->wait(lk, wake);
      delay = k_poll_min;
      continue;
    }
    worker_.wake->wait_for(lk, delay, wake);
    delay = released != 0
                ? k_poll_min
                : std::min(delay * 2,
                           std::chrono::duration_cast<std::chrono::microseconds>(k_poll_max));
  }
}

// Wakes the worker and waits (mu_ dropped meanwhile) until a pass begun after the call has
// ended; deadline null: no limit. True at once without a worker; false on timeout.
bool caching_allocator::impl::wait_for_worker_locked(
    device_lock& lk, const std::chrono::steady_clock::time_point* deadline) {
  if (!worker_.thread || !worker_usable_locked()) return true;
  const std::uint64_t target = worker_.passes_begun + 1;  // the next pass begins after this call
  worker_.kick_now();
  auto done = [&]() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS { return worker_.passed(target); };
  if (!deadline) {
    worker_.settled->wait(lk, done);
    return true;
  }
  return worker_.settled->wait_until(lk, *deadline, done);
}

void caching_allocator::impl::stop_worker() {
  std::unique_ptr<std::thread> t;
  bool here = false;
  std::condition_variable_any* wake = nullptr;
  std::condition_variable_any* settled = nullptr;
  {
    detail::lock_guard<detail::mutex> lk(mu_);
    worker_.stop = true;
    t = std::move(worker_.thread);
    here = worker_.pid == current_pid();
    wake = worker_.wake.get();
    settled = worker_.settled.get();
    if (t && !here) {
      (void)worker_.wake.release();  // leaked with the thread object: see release_worker.hpp
      (void)worker_.settled.release();
    }
  }
  if (!t) return;
  if (here) {
    // (Not in a forked child: a condition variable's internal mutex may have been held there by
    // the parent's worker at the fork, and nobody waits on these in the child.)
    wake->notify_all();
    settled->notify_all();
  }
  {
    std::lock_guard<std::mutex> rlk(registry().mu);
    auto& live = registry().live;
    live.erase(std::remove(live.begin(), live.end(), static_cast<void*>(this)), live.end());
  }
  if (!here) {
    (void)t.release();  // a forked child: the thread lives in the parent only; never join it here
    return;
  }
  t->join();
}

void caching_allocator::impl::process_hooks::fork_prepare() {
  fork_registry& r = registry();
  r.mu.lock();
  for (void* p : r.live) {
    impl* m = static_cast<impl*>(p);
    const auto until = std::chrono::steady_clock::now() + k_fork_lock_wait;
    bool held = m->mu_.try_lock();
    while (!held && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      held = m->mu_.try_lock();
    }
    if (held) r.held.push_back(p);  // else another thread holds it for long: as with any lock
  }
}

void caching_allocator::impl::process_hooks::fork_parent() {
  fork_registry& r = registry();
  for (void* p : r.held) static_cast<impl*>(p)->mu_.unlock();
  r.held.clear();
  r.mu.unlock();
}

void caching_allocator::impl::process_hooks::fork_child() { fork_parent(); }

void caching_allocator::impl::process_hooks::at_exit() {
  // Process exit: allocators that are never destroyed (the process-wide ones) keep their worker
  // thread, which must make no driver call once the CUDA runtime unloads. Each worker is told to
  // stop and its driver call in flight, if any, is given a bounded time to end; no join (a thread
  // blocked elsewhere must not hang the exit). Later releases run on the calling thread.
  fork_registry& r = registry();
  std::lock_guard<std::mutex> rlk(r.mu);
  for (void* p : r.live) {
    impl* m = static_cast<impl*>(p);
    const auto until = std::chrono::steady_clock::now() + k_fork_lock_wait;
    while (true) {
      bool quiet = false, here = true;
      if (m->mu_.try_lock()) {
        here = m->worker_.pid == current_pid();  // in a forked child the worker is the parent's
        if (here) m->worker_.stop = true;
        quiet = m->driver_calls_.in_flight == 0;
        m->mu_.unlock();
      }
      if (!here) break;
      m->worker_.wake->notify_all();
      if (quiet || std::chrono::steady_clock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}

// ---- public interface -------------------------------------------------------------------------

bool caching_allocator::release_worker_idle() const {
  detail::lock_guard<detail::mutex> lk(impl_->mu_);
  // Bytes, not batches: the old addresses of memory reclaimed by another pool (reclaim.cpp) may
  // still wait for their unmap, which gives nothing back.
  return impl_->releases_.deferred_bytes == 0 && impl_->stats_.release_worker_bytes == 0;
}

bool caching_allocator::wait_for_release_worker_idle(std::chrono::nanoseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  device_lock lk(impl_->mu_);
  return impl_->wait_for_worker_locked(lk, &deadline);
}

}  // namespace streamsafe
