// streamsafe core: text formatting shared by messages and summaries (internal, header-only).
// hex() writes an address or a stream handle as 0x...; human_bytes() a byte count in binary
// units ("8.09 GiB", "512 B"); bytes_with_count() the same followed by the exact count, for
// error messages ("1.50 MiB (1572864 bytes)"). No state, no locks.
#pragma once

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <string>

namespace streamsafe::detail {

inline std::string hex(std::uintptr_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, v);
  return buf;
}

// Two decimals from a KiB up; negative counts keep their sign.
inline std::string human_bytes(std::int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  const bool negative = bytes < 0;
  const std::uint64_t magnitude = negative ? 0 - static_cast<std::uint64_t>(bytes)
                                           : static_cast<std::uint64_t>(bytes);
  double v = static_cast<double>(magnitude);
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  char buf[48];
  if (u == 0) std::snprintf(buf, sizeof buf, "%s%" PRIu64 " B", negative ? "-" : "", magnitude);
  else std::snprintf(buf, sizeof buf, "%s%.2f %s", negative ? "-" : "", v, units[u]);
  return buf;
}

inline std::string bytes_with_count(std::size_t bytes) {
  return human_bytes(static_cast<std::int64_t>(bytes)) + " (" + std::to_string(bytes) + " bytes)";
}

}  // namespace streamsafe::detail
