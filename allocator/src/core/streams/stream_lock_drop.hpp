// streamsafe core: a stream lock the caller holds, dropped and retaken around a call that must
// not run under it (a release, a wait). The analysis follows st.mu through these two: it cannot
// tie a lock object passed by reference to the mutex it holds. Used by the growth policy and the
// serve path.
#pragma once

#include "core/common/thread_annotations.hpp"
#include "core/streams/stream_state.hpp"

namespace streamsafe::detail {

inline void drop_stream_lock(unique_lock<stream_lock>& slk, stream_state& st)
    STREAMSAFE_RELEASE(st.mu) STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
  slk.unlock();
}
inline void retake_stream_lock(unique_lock<stream_lock>& slk, stream_state& st)
    STREAMSAFE_ACQUIRE(st.mu) STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
  slk.lock();
}

}  // namespace streamsafe::detail
