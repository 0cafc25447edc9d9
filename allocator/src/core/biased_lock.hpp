// streamsafe core: the stream lock (internal), a biased lock. Satisfies Lockable (lock, try_lock,
// unlock; use it through std::lock_guard / std::unique_lock). Not recursive; the thread that
// locked it must be the one that unlocks it.
//
// Why: the same-stream fast path (allocate and free on one stream, nearly always from one thread)
// takes its stream's lock twice per pair. A spin lock pays an atomic exchange (a locked
// read-modify-write) on every acquire even when no other thread ever comes. A
// biased lock lets one thread, its bias owner, acquire and release with plain loads and stores;
// any other thread first revokes the bias, paying a heavy fence. This is biased locking in the
// sense of Dice, Moir and Scherer, "Quickly reacquirable locks" (2003), with the heavy side of
// the asymmetric Dekker handshake done by the Linux membarrier(2) system call
// (MEMBARRIER_CMD_PRIVATE_EXPEDITED), the technique behind folly's asymmetric thread fence and
// liburcu's membarrier flavour.
//
// State. locked_ is the normal lock (a spin_lock). owner_ is the bias owner's thread record or
// null. A thread record (biased_lock_thread, one per live thread that has taken a biased lock by
// the normal path; never freed, handed to a new thread after its thread exits) has a few slots
// naming the locks its thread holds by the fast path. Only a holder of locked_ writes owner_;
// only a record's thread writes its slots. (A single "inside" word in the lock would not do: a
// thread that read owner_ == itself just before losing the bias may write that word after the
// bias went to another thread, and erase the new owner's mark.)
//
// Fast path (the caller's record is owner_): a free slot = this (plain store); compiler barrier;
// then if owner_ is still the caller and locked_ is free, the lock is held. Otherwise the slot is
// cleared and the normal path follows (also when all slots are in use). No read-modify-write, no
// hardware fence. unlock: if one of the caller's slots names this lock, clear it (release store),
// else release locked_.
//
// Normal path: acquire locked_. If owner_ names another thread, revoke: owner_ = null; heavy fence
// (membarrier); wait until no slot of the old owner names this lock (acquire loads). Then count:
// after K consecutive normal acquisitions by one thread that found locked_ free, it becomes the
// owner (owner_ = its record, under locked_). K starts at 256 and doubles at every revocation up to 65536, so threads
// that take turns pay at most one membarrier (a few microseconds) per K acquisitions.
//
// Why mutual exclusion holds. (a) Two normal-path holders exclude each other through locked_.
// (b) A normal-path holder R excludes the owner A's fast path. R entered either with owner_ null
// or its own record (then no other thread takes the fast path: owner_ changes only under
// locked_, which R holds), or after revoking A. membarrier(PRIVATE_EXPEDITED) acts as a full
// fence in every running thread of the process at some point P during the call (a thread not
// running passes a full fence at its context switch); R's own call is a full fence too. Take A's
// fast-path store to its slot and its loads of owner_ and locked_, which the compiler barrier
// keeps in that order in the program:
//   - P before A's store: A's loads come after P, so they see owner_ = null and locked_ = true
//     (R stored both before the call): A's fast path fails and A waits for locked_ like anyone.
//   - P after A's store: the store is visible to R once membarrier returns, so R sees A's slot
//     name the lock and waits for A's unlock, whose release store R's acquire load then
//     synchronizes with.
// This is the store-buffering (Dekker) pattern with a full fence on both sides, but A's fence is
// paid by R, and only at a revocation. (c) A thread never enters by the fast path on a bias it
// lost: its loads after its point P read null or a newer value of owner_, and a new grant names
// another record, or its own made under locked_. A late write to its own slot (after it read a
// stale owner_) is cleared again before it returns, and no revoker of a later owner reads it.
// (d) Ordering: the owner's fast path needs no acquire. Its grant was made in its own normal
// acquisition (acquire on locked_), and until a revocation no other thread holds the lock; a
// revoker's critical section begins after the owner's release of its slot and ends with the
// release of locked_, which the owner acquires before it can be granted again.
//
// Thread exit: a thread may exit while it is the owner (not while it holds the lock). Its record
// (slots all clear) goes to a free list under a mutex, so the next thread to take it happens
// after the exit and inherits the bias harmlessly: revoking it returns at once, and that thread
// may use it like its own. A thread whose record is gone (its thread_local destructors running)
// takes the normal path only.
//
// When the bias is never granted (the lock is then a spin lock with a few relaxed loads more):
// without membarrier (not Linux, an old kernel, seccomp, gVisor; bias_supported() says which),
// and under ThreadSanitizer, which does not model membarrier's fence and would report the fast
// path as a race.
//
// fork(): as with any lock, a child forked while another thread holds a biased lock (or is
// registering or retiring its record) must not take that lock: the holder does not exist there.
//
// try_lock never blocks: it takes the fast path if this thread is the owner, else tries locked_
// once; while another thread holds the bias it fails (a revocation would wait for the owner's
// critical section) even when the lock is free, and releases locked_ again. Nothing in streamsafe
// calls it today; a caller must not spin on it while another thread keeps the bias.
#pragma once

#include "spin_lock.hpp"

#include <atomic>
#include <cstdint>

namespace streamsafe::detail {

class biased_lock;

// A thread's record for biased locks (see above): its slots name the locks it holds by the fast
// path. Written only by its thread; read by revokers. Never freed. Each record has cache lines of
// its own (128 bytes: a line and its prefetch pair): threads write their slots on every fast-path
// lock and unlock, and records sharing a line would make that line bounce between their cores.
struct alignas(128) biased_lock_thread {
  static constexpr int k_slots = 4;  // more biased locks held at once take the normal path
  std::atomic<const biased_lock*> inside[k_slots] = {};
};

// This thread's record; null until it first takes a biased lock by the normal path, and again
// once its thread_local destructors have run. The initial-exec TLS model makes reading it one
// load (no __tls_get_addr call).
#if defined(__GNUC__)
inline thread_local biased_lock_thread* t_biased_lock_thread __attribute__((tls_model("initial-exec"))) = nullptr;
#else
inline thread_local biased_lock_thread* t_biased_lock_thread = nullptr;
#endif

// This thread's record, registered on first use; null while its thread_local destructors run.
biased_lock_thread* this_biased_lock_thread() noexcept;  // biased_lock.cpp

// The lock functions are opaque to the thread-safety analysis (they take locked_ on some paths
// only); to their callers they acquire and release this lock.
class STREAMSAFE_CAPABILITY("mutex") biased_lock {
 public:
  static constexpr std::uint32_t k_first_bias_after = 256;  // K at first
  static constexpr std::uint32_t k_max_bias_after = 65536;  // K's cap as revocations double it

  // first_bias_after: K, consecutive normal acquisitions by one thread before it becomes the
  // owner; max_bias_after: how far revocations may double K (tests make both small).
  explicit biased_lock(std::uint32_t first_bias_after = k_first_bias_after,
                       std::uint32_t max_bias_after = k_max_bias_after) noexcept
      : bias_after_(first_bias_after), max_bias_after_(max_bias_after) {}
  biased_lock(const biased_lock&) = delete;
  biased_lock& operator=(const biased_lock&) = delete;

  void lock() noexcept STREAMSAFE_ACQUIRE() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
    biased_lock_thread* me = t_biased_lock_thread;
    if (me != nullptr) {
      if (owner_.load(std::memory_order_relaxed) == me && fast_lock(me)) return;
    } else {
      me = this_biased_lock_thread();  // first time on this thread (outside the lock)
    }
    const bool waited = !locked_.try_lock();
    if (waited) locked_.lock();
    after_normal_acquire(me, waited);
  }

  bool try_lock() noexcept STREAMSAFE_TRY_ACQUIRE(true) STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
    biased_lock_thread* me = t_biased_lock_thread;
    if (me != nullptr) {
      if (owner_.load(std::memory_order_relaxed) == me && fast_lock(me)) return true;
    } else {
      me = this_biased_lock_thread();
    }
    if (!locked_.try_lock()) return false;
    const biased_lock_thread* owner = owner_.load(std::memory_order_relaxed);
    if (owner != nullptr && owner != me) {  // would need a revocation, which may wait
      locked_.unlock();
      return false;
    }
    count_normal_acquire(me, owner, false);
    return true;
  }

  void unlock() noexcept STREAMSAFE_RELEASE() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
    if (biased_lock_thread* me = t_biased_lock_thread) {
      for (auto& slot : me->inside) {
        if (slot.load(std::memory_order_relaxed) == this) {
          slot.store(nullptr, std::memory_order_release);
          return;
        }
      }
    }
    locked_.unlock();
  }

  // Whether this process can grant a bias at all (membarrier available, not ThreadSanitizer).
  static bool bias_supported() noexcept;

  // Test hooks. bias_owner: the owner's thread record or null (racy unless the lock is quiet).
  const void* bias_owner() const noexcept { return owner_.load(std::memory_order_relaxed); }
  bool biased_to_this_thread() const noexcept {
    return t_biased_lock_thread != nullptr && bias_owner() == t_biased_lock_thread;
  }
  std::uint64_t grants() const noexcept { return grants_.load(std::memory_order_relaxed); }
  std::uint64_t revocations() const noexcept { return revocations_.load(std::memory_order_relaxed); }

 private:
  // The owner's attempt; false: not acquired (its slot is clear again), take the normal path.
  bool fast_lock(biased_lock_thread* me) noexcept STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
    for (auto& slot : me->inside) {
      if (slot.load(std::memory_order_relaxed) != nullptr) continue;
      slot.store(this, std::memory_order_relaxed);
      std::atomic_signal_fence(std::memory_order_seq_cst);  // keep the store before the loads
      if (owner_.load(std::memory_order_relaxed) == me && !locked_.is_locked()) return true;
      slot.store(nullptr, std::memory_order_release);
      return false;
    }
    return false;  // every slot in use: the normal path
  }

  // locked_ just acquired by the normal path (after waiting for it: `waited`): revoke another
  // thread's bias, then count.
  void after_normal_acquire(const biased_lock_thread* me, bool waited) noexcept {
    const biased_lock_thread* owner = owner_.load(std::memory_order_relaxed);  // exact: written under locked_
    if (owner != nullptr && owner != me) {
      revoke(owner);
      owner = nullptr;
    }
    count_normal_acquire(me, owner, waited);
  }

  // Under locked_: one more normal acquisition by `me` (owner_ == owner, null or me). A thread
  // without a record (me null) is never granted the bias. An acquisition that waited starts the
  // streak again: a lock that threads contend for would only move its bias back and forth.
  void count_normal_acquire(const biased_lock_thread* me, const biased_lock_thread* owner, bool waited) noexcept {
    if (last_ != me || waited) {
      last_ = me;
      streak_ = 0;
    }
    if (++streak_ >= bias_after_ && owner == nullptr && me != nullptr) grant(me);
  }

  void revoke(const biased_lock_thread* owner) noexcept;  // biased_lock.cpp
  void grant(const biased_lock_thread* me) noexcept;      // biased_lock.cpp

  std::atomic<const biased_lock_thread*> owner_{nullptr};
  spin_lock locked_;
  // Guarded by locked_.
  const biased_lock_thread* last_ = nullptr;  // the thread of the last normal acquisition
  std::uint32_t streak_ = 0;                  // its consecutive normal acquisitions
  std::uint32_t bias_after_;                  // K
  std::uint32_t max_bias_after_;
  // Written under locked_, read by tests.
  std::atomic<std::uint64_t> grants_{0}, revocations_{0};
};

}  // namespace streamsafe::detail
