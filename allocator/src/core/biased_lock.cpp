// streamsafe core: the biased stream lock's slow side (see biased_lock.hpp for the algorithm and
// why it is correct): granting and revoking the bias, and the heavy fence, Linux membarrier(2).
#include "biased_lock.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

#if defined(__linux__)
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__SANITIZE_THREAD__)
#define STREAMSAFE_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define STREAMSAFE_TSAN 1
#endif
#endif

namespace streamsafe::detail {
namespace {

#if defined(__linux__) && defined(__NR_membarrier)
long membarrier(int cmd) noexcept { return syscall(__NR_membarrier, cmd, 0U, 0); }

// Registers the process for private expedited membarrier (needed once per process before the
// command may be used); false where the kernel lacks it or a sandbox refuses it.
[[maybe_unused]] bool register_membarrier() noexcept {
  const long cmds = membarrier(MEMBARRIER_CMD_QUERY);
  if (cmds < 0 || (cmds & MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0) return false;
  return membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0;
}

// The heavy fence: a full memory barrier in every running thread of this process, and in this one.
void heavy_fence() noexcept {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) != 0) {
    // A bias was granted, so registration succeeded; the kernel cannot forget it. Continuing
    // would break mutual exclusion.
    std::fputs("streamsafe: membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) failed after registration\n", stderr);
    std::abort();
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);
}
#else
[[maybe_unused]] bool register_membarrier() noexcept { return false; }
void heavy_fence() noexcept { std::abort(); }  // unreachable: no bias is ever granted
#endif

}  // namespace

// Thread records: allocated once, never freed (a revoker may read an exited owner's record), and
// handed from an exiting thread to a new one through the free list (under its mutex).
namespace {

// Never destroyed: threads may exit after static destructors have run.
struct record_pool {
  std::mutex mu;
  std::vector<biased_lock_thread*> free;  // capacity >= all records, so giving one back never throws
  std::size_t records = 0;
};
record_pool& pool() {
  static auto* p = new record_pool();
  return *p;
}

// Gives this thread's record back when its thread_local destructors run.
struct record_holder {
  biased_lock_thread* record = nullptr;
  bool gone = false;
  ~record_holder() {
    gone = true;
    t_biased_lock_thread = nullptr;
    if (record == nullptr) return;
    for (auto& slot : record->inside) slot.store(nullptr, std::memory_order_relaxed);  // holds none now
    record_pool& p = pool();
    std::lock_guard<std::mutex> lk(p.mu);
    p.free.push_back(record);
  }
};
thread_local record_holder t_holder;

}  // namespace

biased_lock_thread* this_biased_lock_thread() noexcept {
  if (t_biased_lock_thread != nullptr) return t_biased_lock_thread;
  record_holder& h = t_holder;
  if (h.gone) return nullptr;  // its destructor has run (the storage lives until the thread ends)
  try {
    record_pool& p = pool();
    std::lock_guard<std::mutex> lk(p.mu);
    if (p.free.empty()) {
      p.free.reserve(p.records + 1);
      h.record = new biased_lock_thread();
      ++p.records;
    } else {
      h.record = p.free.back();
      p.free.pop_back();
    }
  } catch (...) {
    return nullptr;  // out of memory: this thread takes the normal path only
  }
  t_biased_lock_thread = h.record;
  return h.record;
}

bool biased_lock::bias_supported() noexcept {
#if defined(STREAMSAFE_TSAN)
  return false;  // ThreadSanitizer does not model membarrier's fence (see biased_lock.hpp)
#else
  static const bool supported = register_membarrier();  // once per process, thread-safe
  return supported;
#endif
}

void biased_lock::grant(const biased_lock_thread* me) noexcept {
  streak_ = 0;
  if (!bias_supported()) return;
  owner_.store(me, std::memory_order_relaxed);  // published to other threads by locked_'s release
  grants_.fetch_add(1, std::memory_order_relaxed);
}

void biased_lock::revoke(const biased_lock_thread* owner) noexcept {
  owner_.store(nullptr, std::memory_order_relaxed);
  heavy_fence();
  // The old owner's fast-path critical section, if any, ends with its release of its slot.
  spin_until([&] {
    for (const auto& slot : owner->inside) {
      if (slot.load(std::memory_order_acquire) == this) return false;
    }
    return true;
  });
  revocations_.fetch_add(1, std::memory_order_relaxed);
  bias_after_ = static_cast<std::uint32_t>(std::min<std::uint64_t>(max_bias_after_, std::uint64_t{bias_after_} * 2));
}

}  // namespace streamsafe::detail
