// streamsafe core: the growth hook (internal): what differs between the two backend kinds in the
// growth policy (growth_policy.cpp, serve_path.cpp), behind one interface, as RMM's pool keeps one
// expand_pool over a small resource per kind. One implementation per kind, one file each, its
// class that file's alone: cuda_malloc_growth.cpp (whole cudaMalloc segments: a growth is a new
// segment; room is made by giving back the whole free segments the whole-segment rule refuses;
// queued memory and other pools' memory move over as whole segments) and expandable_growth.cpp
// (address ranges mapped chunk by chunk: a growth maps chunks; room is made by queueing idle
// chunks and mapping them again by alias). The coordinator owns one, chosen once by its
// constructor (caching_allocator.cpp), fixed from then on (read without a lock); the policy
// decides when each is called, the hook how, through the coordinator's mechanisms (growth.cpp,
// reclaim.cpp, release.cpp). A hook holds no state: the coordinator is passed to every call, so
// that clang's lock analysis ties `m.mu_` to the caller's own mu_ (a reference held by the hook
// would be another lock to it). The locks are those of the functions they wrap: mu_, and the
// growing pool's stream lock (st.mu, or p's owner by convention, allocator_impl.hpp).
#pragma once

#include "core/allocator_impl.hpp"

#include <cstddef>
#include <memory>

namespace streamsafe {

struct caching_allocator::impl::growth_hook {
  growth_hook() = default;
  growth_hook(const growth_hook&) = delete;
  growth_hook& operator=(const growth_hook&) = delete;
  virtual ~growth_hook() = default;
  static std::unique_ptr<growth_hook> for_cuda_malloc();  // cuda_malloc_growth.cpp
  static std::unique_ptr<growth_hook> for_expandable();   // expandable_growth.cpp

  // The bytes a growth of p for `rounded` bytes maps (the headroom check, steps 2 and 5).
  virtual std::size_t growth_bytes_locked(const impl& m, const pool& p, std::size_t rounded) const
      STREAMSAFE_REQUIRES(m.mu_) = 0;
  // The growth itself (grow_locked): new memory for p within the limit; null: none.
  virtual block* grow_locked(impl& m, pool& p, std::size_t rounded) STREAMSAFE_REQUIRES(m.mu_) = 0;
  // Step 5, before a growth is decided: what the next growth's choice needs ahead of it.
  virtual void prepare_growth_locked(impl& m, stream_state& st, pool& p)
      STREAMSAFE_REQUIRES(m.mu_, st.mu) = 0;
  // Step 5: whether a growth past the peak first makes room from idle memory...
  virtual bool makes_room_first_locked(const impl& m, const pool& p, std::size_t rounded) const
      STREAMSAFE_REQUIRES(m.mu_) = 0;
  // ...and the growth after making that room (never a host wait; slk dropped around releases).
  virtual block* grow_after_room_locked(impl& m, device_lock& dlk,
                                        detail::unique_lock<stream_lock>& slk, stream_state& st,
                                        pool& p, std::size_t rounded)
      STREAMSAFE_REQUIRES(m.mu_, st.mu) = 0;
  // Step 1: another pool's queued memory, behind a wait of p's stream on its release fence,
  // keeping the growth's rules; *in_flight (may be null) set when the release worker's release
  // in flight is what stands in the way (the caller waits for it and asks again).
  virtual block* reclaim_queued_locked(impl& m, pool& p, std::size_t rounded, bool* in_flight)
      STREAMSAFE_REQUIRES(m.mu_) = 0;
  // Step 7, no wait left: the same, the rules giving way (the out-of-memory path's last resort).
  virtual block* reclaim_queued_last_resort_locked(impl& m, pool& p, std::size_t rounded)
      STREAMSAFE_REQUIRES(m.mu_) = 0;
  // Step 6, at the limit: other pools' free memory (slk dropped around what takes their locks).
  virtual block* take_from_other_pools_locked(impl& m, detail::unique_lock<stream_lock>& slk,
                                              stream_state& st, pool& p, std::size_t rounded)
      STREAMSAFE_REQUIRES(m.mu_, st.mu) = 0;
  // A graph's private pool (capture.cpp, graph_pool_route.cpp): new device memory only, no move
  // or reclaim; side: 0, or a side stream joined into the capture (memory of its own).
  virtual block* new_memory_locked(impl& m, pool& p, std::size_t rounded, stream_handle side)
      STREAMSAFE_REQUIRES(m.mu_) = 0;
  // pause/resume keep a tag's addresses: only mappings can (sleep.cpp).
  virtual bool supports_pause() const noexcept = 0;
};

}  // namespace streamsafe
