// streamsafe core: the room a growth has (internal): the rules, in one place, that compare
// reserved bytes and a growth of `bytes` with the memory limit and with the growth policy's peak
// (the high-water mark of reserved bytes, growth_state.hpp). A value read under the device lock
// (impl::growth_room_locked), then plain arithmetic: no lock, no CUDA, testable alone
// (tests/core/growth_room_test.cpp). The policy that uses it: growth_policy.cpp.
#pragma once

#include "core/ledger/ledger.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace streamsafe::detail {

struct growth_room {
  std::size_t reserved = 0;    // reserved bytes now
  std::size_t limit = 0;       // the memory limit (growth_limits::limit_bytes)
  std::size_t high_water = 0;  // the most bytes ever reserved at once

  // The growth policy's peak: the high-water mark, or the limit when that is lower.
  std::size_t peak() const noexcept { return std::min(limit, high_water); }
  // Every rule below compares reserved + bytes with a bound without computing the sum, so that
  // no request size wraps around to "fits".
  // A growth of `bytes` keeps reserved at or below the limit (the ledger's rule).
  bool fits_limit(std::size_t bytes) const noexcept {
    return ledger::may_hold(reserved, bytes, limit);
  }
  // A growth of `bytes` raises the high-water mark.
  bool raises_peak(std::size_t bytes) const noexcept {
    return reserved > high_water || bytes > high_water - reserved;
  }
  // A growth of `bytes` costs nothing new: within both the limit and the high-water mark.
  bool within_peak(std::size_t bytes) const noexcept {
    return ledger::may_hold(reserved, bytes, peak());
  }
  // A growth past the high-water mark that the limit still allows (room is made first).
  bool past_peak_within_limit(std::size_t bytes) const noexcept {
    return raises_peak(bytes) && fits_limit(bytes);
  }
  // The bytes of a growth of `bytes` beyond the peak (0: none; SIZE_MAX at most).
  std::size_t excess_over_peak(std::size_t bytes) const noexcept {
    const std::size_t top = peak();
    if (reserved < top) return bytes > top - reserved ? bytes - (top - reserved) : 0;
    const std::size_t over = reserved - top;  // already past the peak (a limit lowered later)
    return bytes > SIZE_MAX - over ? SIZE_MAX : bytes + over;
  }
  // What can still grow within the peak (the fast path's hint).
  std::size_t headroom() const noexcept { return peak() > reserved ? peak() - reserved : 0; }
};

}  // namespace streamsafe::detail
