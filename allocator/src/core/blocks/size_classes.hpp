// streamsafe core: size rounding and segment sizing (internal).
//
// Thresholds follow PyTorch's CUDACachingAllocator (c10/cuda/CUDACachingAllocator.cpp):
// 512-byte granularity, a small pool for requests up to 1 MiB served from 2 MiB segments,
// 20 MiB segments for requests below 10 MiB, larger ones rounded up to 2 MiB.
// Pure constexpr functions: no state, no lock.
#pragma once

#include <cstddef>

namespace streamsafe::detail {

inline constexpr std::size_t k_min_block_bytes = 512;
inline constexpr std::size_t k_small_request_bytes = std::size_t{1} << 20;
inline constexpr std::size_t k_small_segment_bytes = std::size_t{2} << 20;
inline constexpr std::size_t k_large_segment_bytes = std::size_t{20} << 20;
inline constexpr std::size_t k_min_large_alloc_bytes = std::size_t{10} << 20;
inline constexpr std::size_t k_round_large_bytes = std::size_t{2} << 20;
// Largest request accepted before rounding could overflow.
inline constexpr std::size_t k_max_request_bytes = ~std::size_t{0} / 2;

inline constexpr std::size_t round_up(std::size_t n, std::size_t multiple) noexcept {
  return (n + multiple - 1) / multiple * multiple;
}

inline constexpr std::size_t round_request(std::size_t size_bytes) noexcept {
  return size_bytes < k_min_block_bytes ? k_min_block_bytes
                                        : round_up(size_bytes, k_min_block_bytes);
}

// PyTorch's roundup_power2_divisions: a size between two powers of two rounds up to the next of
// `divisions` equal steps (steps of at least 512 B), then to a multiple of 512. 0 or 1 division:
// no rounding beyond 512 B, as PyTorch's round_size.
inline constexpr std::size_t round_power2_divisions(std::size_t size_bytes,
                                                    std::size_t divisions) noexcept {
  if (divisions <= 1 || size_bytes <= k_min_block_bytes) return round_request(size_bytes);
  std::size_t floor = std::size_t{1}
                      << (63 - __builtin_clzll(static_cast<unsigned long long>(size_bytes)));
  if (floor == size_bytes) return size_bytes;
  std::size_t step = floor / divisions;
  if (step < k_min_block_bytes) step = k_min_block_bytes;
  return round_request(round_up(size_bytes, step));
}

inline constexpr bool is_small(std::size_t rounded_bytes) noexcept {
  return rounded_bytes <= k_small_request_bytes;
}

// Bytes of a new cudaMalloc segment for a rounded request.
inline constexpr std::size_t segment_bytes_for(std::size_t rounded_bytes) noexcept {
  if (is_small(rounded_bytes)) return k_small_segment_bytes;
  if (rounded_bytes < k_min_large_alloc_bytes) return k_large_segment_bytes;
  return round_up(rounded_bytes, k_round_large_bytes);
}

}  // namespace streamsafe::detail
