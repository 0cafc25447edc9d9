// streamsafe core: the stream lock type (internal): spin_lock (spin_lock.hpp, one atomic
// exchange per acquire), a Lockable clang thread-safety capability. A lock biased toward the
// stream's thread was measured against it on the H200 and did not earn its place
// (docs/benchmarks.md, "The stream lock").
#pragma once

#include "core/common/spin_lock.hpp"

namespace streamsafe::detail {
using stream_lock = spin_lock;
}  // namespace streamsafe::detail
