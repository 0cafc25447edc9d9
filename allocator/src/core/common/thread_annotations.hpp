// streamsafe core: clang thread-safety annotations (internal), and lock types that carry them.
//
// With clang and -Wthread-safety the compiler checks that a function marked
// STREAMSAFE_REQUIRES(m) is only called with m held and that members marked
// STREAMSAFE_GUARDED_BY(m) are only touched with m held (https://clang.llvm.org/docs/
// ThreadSafetyAnalysis.html). Other compilers see empty macros. libstdc++'s std::mutex,
// std::lock_guard and std::unique_lock carry no annotations, so the core uses mutex, lock_guard
// and unique_lock from here (same behaviour, annotated); the stream lock (spin_lock)
// is a capability itself.
#pragma once

#include <mutex>

#if defined(__clang__)
#define STREAMSAFE_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define STREAMSAFE_THREAD_ANNOTATION(x)
#endif

#define STREAMSAFE_CAPABILITY(x) STREAMSAFE_THREAD_ANNOTATION(capability(x))
#define STREAMSAFE_SCOPED_CAPABILITY STREAMSAFE_THREAD_ANNOTATION(scoped_lockable)
#define STREAMSAFE_GUARDED_BY(x) STREAMSAFE_THREAD_ANNOTATION(guarded_by(x))
#define STREAMSAFE_PT_GUARDED_BY(x) STREAMSAFE_THREAD_ANNOTATION(pt_guarded_by(x))
#define STREAMSAFE_REQUIRES(...) STREAMSAFE_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define STREAMSAFE_ACQUIRE(...) STREAMSAFE_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define STREAMSAFE_RELEASE(...) STREAMSAFE_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define STREAMSAFE_TRY_ACQUIRE(...) \
  STREAMSAFE_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define STREAMSAFE_EXCLUDES(...) STREAMSAFE_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define STREAMSAFE_ASSERT_CAPABILITY(x) STREAMSAFE_THREAD_ANNOTATION(assert_capability(x))
#define STREAMSAFE_RETURN_CAPABILITY(x) STREAMSAFE_THREAD_ANNOTATION(lock_returned(x))
#define STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS STREAMSAFE_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace streamsafe::detail {

// std::mutex as a capability (the device lock, the event pool's lock).
class STREAMSAFE_CAPABILITY("mutex") mutex {
 public:
  void lock() STREAMSAFE_ACQUIRE() { m_.lock(); }
  bool try_lock() STREAMSAFE_TRY_ACQUIRE(true) { return m_.try_lock(); }
  void unlock() STREAMSAFE_RELEASE() { m_.unlock(); }

 private:
  std::mutex m_;
};

// std::lock_guard, annotated: holds `m` for its scope.
template <class Mutex>
class STREAMSAFE_SCOPED_CAPABILITY lock_guard {
 public:
  explicit lock_guard(Mutex& m) STREAMSAFE_ACQUIRE(m) : m_(m) { m_.lock(); }
  ~lock_guard() STREAMSAFE_RELEASE() { m_.unlock(); }
  lock_guard(const lock_guard&) = delete;
  lock_guard& operator=(const lock_guard&) = delete;

 private:
  Mutex& m_;
};

// std::unique_lock, annotated, for a lock held on entry and dropped and retaken in between
// (around host-blocking driver calls). Always bound to one mutex; BasicLockable, so that
// std::condition_variable_any can wait on it.
template <class Mutex>
class STREAMSAFE_SCOPED_CAPABILITY unique_lock {
 public:
  explicit unique_lock(Mutex& m) STREAMSAFE_ACQUIRE(m) : m_(&m) {
    m_->lock();
    owns_ = true;
  }
  ~unique_lock() STREAMSAFE_RELEASE() {
    if (owns_) m_->unlock();
  }
  unique_lock(const unique_lock&) = delete;
  unique_lock& operator=(const unique_lock&) = delete;
  void lock() STREAMSAFE_ACQUIRE() {
    m_->lock();
    owns_ = true;
  }
  void unlock() STREAMSAFE_RELEASE() {
    owns_ = false;
    m_->unlock();
  }
  bool owns_lock() const noexcept { return owns_; }

 private:
  Mutex* m_;
  bool owns_ = false;
};

// Tells the analysis that `m` is held here, where it cannot see that (locks held in a vector
// for a whole walk, as snapshot and check_invariants do). Checks nothing at run time.
template <class Mutex>
inline void assume_held(const Mutex& m) STREAMSAFE_ASSERT_CAPABILITY(m) {}

}  // namespace streamsafe::detail
