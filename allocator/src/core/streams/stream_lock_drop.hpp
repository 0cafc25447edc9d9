// streamsafe core: a stream lock the caller holds, dropped and retaken around a call that must
// not run under it (a release, a wait): a scoped guard, the lock back when the scope ends (also
// by an exception). The analysis follows st.mu through it: it cannot tie a lock object passed by
// reference to the mutex it holds. Used by the growth policy, its hooks and the serve path.
#pragma once

#include "core/common/thread_annotations.hpp"
#include "core/streams/stream_state.hpp"

namespace streamsafe::detail {

// Drops st's lock (held in slk) for the scope: `{ stream_lock_dropped dropped(slk, st); ... }`.
class STREAMSAFE_SCOPED_CAPABILITY stream_lock_dropped {
 public:
  stream_lock_dropped(unique_lock<stream_lock>& slk, stream_state& st)
      STREAMSAFE_RELEASE(st.mu) STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS : slk_(slk) {
    slk_.unlock();
  }
  ~stream_lock_dropped() STREAMSAFE_RELEASE() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS { slk_.lock(); }
  stream_lock_dropped(const stream_lock_dropped&) = delete;
  stream_lock_dropped& operator=(const stream_lock_dropped&) = delete;

 private:
  unique_lock<stream_lock>& slk_;
};

}  // namespace streamsafe::detail
