// The growth policy's rules on reserved bytes, the limit and the peak (growth_room.hpp), driven
// alone, without an allocator: each rule at its edges, the limit below the high-water mark (a
// limit lowered after a peak, or the high-water mark above the limit), and sizes near overflow.
#include "core/growth/growth_room.hpp"

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>

using streamsafe::detail::growth_room;

namespace {
constexpr std::size_t MiB = std::size_t{1} << 20;
}  // namespace

TEST_CASE(
    "growth_room: a growth within the peak costs nothing, past it within the limit makes room "
    "first, past the limit never",
    "[core][growth]") {
  const growth_room r{600 * MiB, 1024 * MiB, 800 * MiB};  // reserved, limit, high-water mark
  CHECK(r.peak() == 800 * MiB);
  CHECK(r.headroom() == 200 * MiB);
  // Up to the mark: within the peak, nothing raised.
  CHECK(r.within_peak(200 * MiB));
  CHECK_FALSE(r.raises_peak(200 * MiB));
  CHECK(r.excess_over_peak(200 * MiB) == 0);
  CHECK_FALSE(r.past_peak_within_limit(200 * MiB));
  // One byte past the mark, within the limit: room is made first.
  CHECK_FALSE(r.within_peak(200 * MiB + 1));
  CHECK(r.raises_peak(200 * MiB + 1));
  CHECK(r.excess_over_peak(200 * MiB + 1) == 1);
  CHECK(r.past_peak_within_limit(200 * MiB + 1));
  // Up to the limit, and one byte past it.
  CHECK(r.fits_limit(424 * MiB));
  CHECK(r.past_peak_within_limit(424 * MiB));
  CHECK_FALSE(r.fits_limit(424 * MiB + 1));
  CHECK_FALSE(r.past_peak_within_limit(424 * MiB + 1));
  CHECK(r.excess_over_peak(424 * MiB + 1) == 224 * MiB + 1);
}

TEST_CASE("growth_room: with the limit below the high-water mark the limit is the peak",
          "[core][growth]") {
  // The mark was set before a lower limit applied: growth below the mark still may not pass
  // the limit, and nothing counts as raising the peak there.
  const growth_room r{600 * MiB, 700 * MiB, 900 * MiB};
  CHECK(r.peak() == 700 * MiB);
  CHECK(r.headroom() == 100 * MiB);
  CHECK(r.within_peak(100 * MiB));
  CHECK_FALSE(r.within_peak(150 * MiB));  // below the mark, past the limit
  CHECK_FALSE(r.raises_peak(150 * MiB));  // ...and no new peak
  CHECK_FALSE(r.fits_limit(150 * MiB));
  CHECK_FALSE(r.past_peak_within_limit(150 * MiB));
  CHECK(r.excess_over_peak(150 * MiB) == 50 * MiB);
  // At or above the limit already (reserved = limit): no headroom, nothing fits.
  const growth_room full{700 * MiB, 700 * MiB, 900 * MiB};
  CHECK(full.headroom() == 0);
  CHECK(full.fits_limit(0));
  CHECK_FALSE(full.fits_limit(1));
}

TEST_CASE("growth_room: an empty allocator, and sizes near the top of size_t", "[core][growth]") {
  const growth_room empty{0, 1024 * MiB, 0};  // nothing reserved yet: every growth is a new peak
  CHECK(empty.peak() == 0);
  CHECK(empty.headroom() == 0);
  CHECK(empty.within_peak(0));
  CHECK(empty.raises_peak(1));
  CHECK(empty.past_peak_within_limit(1024 * MiB));
  CHECK_FALSE(empty.past_peak_within_limit(1024 * MiB + 1));
  // A request near SIZE_MAX must not wrap around to "fits".
  const growth_room r{600 * MiB, 1024 * MiB, 800 * MiB};
  CHECK_FALSE(r.fits_limit(SIZE_MAX));
  CHECK_FALSE(r.fits_limit(SIZE_MAX - 300 * MiB));
  CHECK_FALSE(r.past_peak_within_limit(SIZE_MAX - 300 * MiB));
  CHECK(r.raises_peak(SIZE_MAX - 300 * MiB));  // 600 MiB + this would wrap to 300 MiB - 1
  CHECK_FALSE(r.within_peak(SIZE_MAX - 300 * MiB));
  CHECK(r.excess_over_peak(SIZE_MAX - 300 * MiB) == SIZE_MAX - 500 * MiB);
  CHECK(r.excess_over_peak(SIZE_MAX) == SIZE_MAX - 200 * MiB);
  // Reserved already past the peak (the limit lowered below it): the excess saturates.
  const growth_room over{900 * MiB, 700 * MiB, 900 * MiB};
  CHECK(over.excess_over_peak(0) == 200 * MiB);
  CHECK(over.excess_over_peak(SIZE_MAX) == SIZE_MAX);
  CHECK(over.raises_peak(1));
  CHECK_FALSE(over.fits_limit(0));
}
