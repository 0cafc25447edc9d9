// streamsafe core: fork (case K15).
//
// A child forked from a process with an allocator inherits a copy of its state: the parent's
// segments, events and streams (handles that are not the child's to free, unmap or
// synchronise), and locks that a parent thread may have held at the fork, which nobody in the
// child will ever unlock. Locking them all in a pthread_atfork prepare handler is no answer: a
// parent thread may hold the device lock across a long driver call (growth), and the fork would
// wait for it. Instead the child handler counts the fork (one lock-free atomic increment, safe
// in a child) and every allocator made before it is "inherited" there: its entry points test
// this before they take any lock and touch nothing of the parent's. In the child, allocate and
// the capture calls throw backend_error, deallocate, record_stream, notify_* and empty_cache do
// nothing (empty_cache and reclaim return 0), and the destructor leaks the host bookkeeping
// rather than read state a parent thread may have been changing at the fork. An allocator made
// in the child is its own and works normally.
#include "core/allocator_impl.hpp"

#include <pthread.h>

#include <atomic>
#include <mutex>
#include <string>

namespace streamsafe {

namespace {

std::atomic<std::uint64_t> forks_seen{0};  // incremented in every forked child

void in_child() noexcept { forks_seen.fetch_add(1, std::memory_order_relaxed); }

std::uint64_t register_fork_handler() {
  static std::once_flag once;
  std::call_once(once, [] { ::pthread_atfork(nullptr, nullptr, in_child); });
  return forks_seen.load(std::memory_order_relaxed);
}

}  // namespace

// Registers the fork handler once.
std::uint64_t caching_allocator::impl::current_fork_generation() { return register_fork_handler(); }

bool caching_allocator::impl::inherited() const noexcept {
  return forks_seen.load(std::memory_order_relaxed) != fork_generation_;
}

void caching_allocator::impl::throw_inherited(const char* what) const {
  throw backend_error(
      std::string("streamsafe: ") + what + " on device " + std::to_string(backend_.device()) +
      " in a forked child: the allocator was made by the parent process, whose memory and "
      "streams the child does not own; make a new allocator in the child");
}

}  // namespace streamsafe
