// streamsafe core: the stream lock type (internal), chosen at build time by the CMake option
// STREAMSAFE_STREAM_LOCK: biased (default; biased_lock.hpp, no atomic read-modify-write for the
// thread that keeps taking it) or spin (spin_lock.hpp, one atomic exchange per acquire). Both
// satisfy Lockable and are clang thread-safety capabilities.
#pragma once

#if defined(STREAMSAFE_STREAM_LOCK_SPIN)
#include "spin_lock.hpp"
namespace streamsafe::detail {
using stream_lock = spin_lock;
inline constexpr const char* k_stream_lock_name = "spin";
}  // namespace streamsafe::detail
#else
#include "biased_lock.hpp"
namespace streamsafe::detail {
using stream_lock = biased_lock;
inline constexpr const char* k_stream_lock_name = "biased";
}  // namespace streamsafe::detail
#endif
