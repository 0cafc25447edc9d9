// streamsafe core: the ledger (internal): every byte the allocator holds on the device, in
// exactly one state, and the one check that keeps reserved bytes within the memory limit.
//
// States of a held byte, and who keeps its count (the fast path's counters stay where they are,
// per stream and per pool kind; the totals are derived when read, never on the fast path):
//   live       allocated blocks                       stream_stats::allocated_bytes (per stream)
//   pending    freed, waiting on other streams' work  stream_stats::pending_bytes (per stream)
//   queued     detached for release behind a fence    release_queue::deferred_bytes, and
//              (empty_cache:wait) a batch whose fence a thread waits on now: ledger (fencing)
//   releasing  a driver call (free_segment, unmap) is giving it back right now: ledger
//   cached     free in a pool                          reserved less every state above
// Paused and offloaded memory (sleep.cpp) is not held on the device: a paused segment keeps
// only its addresses, an offloaded block's contents live in pinned host memory; exported blocks
// (ipc.cpp) are live or pending until their consumers' events, imported ones are another
// process's memory mapped here, not reserved. ledger_view names each for the out-of-memory
// message.
// Invariant: reserved (statistics::reserved_bytes, kept by add_reserved / sub_reserved under the
// device lock) = live + pending + queued + releasing + cached, each byte counted once: a byte
// being released leaves `releasing` and reserved in the same step, after its driver call.
// Rules: may_hold() refuses a growth that would pass the limit, counting `releasing` (the device
// may still hold those bytes); without a limit of the allocator's own (a cap the backend
// enforces), a growth that would raise the peak waits for the releases in flight first
// (growth_policy.cpp), so that memory on its way back is never counted beside the new memory
// that took its place on the device. Lock: impl::ledger_ is GUARDED_BY(mu_).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace streamsafe::detail {

// Every state's bytes at one moment (diagnostics.cpp fills it under the device lock).
struct ledger_view {
  std::size_t reserved = 0;        // the sum of the held states below
  std::size_t live = 0;            // allocated
  std::size_t pending = 0;         // freed, waiting on other streams' work
  std::size_t queued = 0;          // queued for release behind a fence (or for the release worker)
  std::size_t releasing = 0;       // a driver call is giving it back
  std::size_t cached = 0;          // free in a pool
  std::size_t graph = 0;           // of those, held by graphs' private pools not released yet
  std::size_t paused = 0;          // not held: paused tags' memory given back, addresses kept
  std::size_t offloaded_host = 0;  // not held on the device: pinned host copies of paused tags
  std::size_t exported = 0;        // of live and pending: blocks exported to other processes
  std::size_t imported = 0;        // not reserved here: other processes' blocks mapped here
  std::size_t limit = 0;
};

// Bytes in one passing state that a thread holds while the device lock is dropped (a driver
// call, a host fence wait), with each thread's own share, for one owner at a time (a thread in
// that state for two allocators at once counts only the first's).
template <int kind>
class in_flight_bytes {
 public:
  void begin(const void* owner, std::size_t bytes) noexcept {
    total_ += bytes;
    if (t_here_.owner != nullptr && t_here_.owner != owner) return;
    t_here_.owner = owner;
    t_here_.bytes += bytes;
  }
  void end(const void* owner, std::size_t bytes) noexcept {
    total_ -= bytes;
    if (t_here_.owner != owner) return;
    t_here_.bytes -= bytes;
    if (t_here_.bytes == 0) t_here_.owner = nullptr;
  }
  std::size_t total() const noexcept { return total_; }
  // Held by threads other than the caller: what the caller may wait for (never itself).
  std::size_t elsewhere(const void* owner) const noexcept {
    return total_ - (t_here_.owner == owner ? t_here_.bytes : 0);
  }

 private:
  struct here {  // zero-initialized: a thread_local of static storage duration
    const void* owner;
    std::size_t bytes;
  };
  static inline thread_local here t_here_;
  std::size_t total_ = 0;
};

class ledger {
 public:
  // A driver call giving `bytes` back begins / ended (released or not: the caller then moves
  // the bytes to cached, or out of reserved), both on the releasing thread.
  void begin_release(std::size_t bytes) noexcept { releasing_.begin(this, bytes); }
  void end_release(std::size_t bytes) noexcept { releasing_.end(this, bytes); }
  std::size_t releasing_bytes() const noexcept { return releasing_.total(); }
  // Being released by threads other than the caller: what a wait for the releases may wait
  // for (a backend call that runs allocator calls on the releasing thread, as the simulated
  // device's interleaving tests do, must not wait for itself).
  std::size_t releasing_elsewhere_bytes() const noexcept { return releasing_.elsewhere(this); }
  // A host wait on the fence of a batch that no queue holds (empty_cache:wait) begins / ended,
  // on the waiting thread: its bytes are queued for release, out of every pool meanwhile.
  void begin_fence_wait(std::size_t bytes) noexcept { fencing_.begin(this, bytes); }
  void end_fence_wait(std::size_t bytes) noexcept { fencing_.end(this, bytes); }
  std::size_t fencing_bytes() const noexcept { return fencing_.total(); }
  // Behind other threads' fence waits: what the serve path may wait for (never its own).
  std::size_t fencing_elsewhere_bytes() const noexcept { return fencing_.elsewhere(this); }
  // Whether `bytes` more may be held with `reserved` held now (memory being released counts:
  // the device may hold it until its driver call returns).
  static bool may_hold(std::size_t reserved, std::size_t bytes, std::size_t limit) noexcept {
    return bytes <= limit && reserved <= limit - bytes;
  }

 private:
  in_flight_bytes<0> releasing_;
  in_flight_bytes<1> fencing_;
};

// "live 1 MiB, pending other streams' work 2 MiB, ..." (format.hpp's units), for messages.
std::string describe(const ledger_view& v);

}  // namespace streamsafe::detail
