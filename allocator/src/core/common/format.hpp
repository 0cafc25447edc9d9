// streamsafe core: text formatting shared by messages and summaries (internal, header-only).
// hex() writes an address or a stream handle as 0x...; human_bytes() a byte count in binary
// units ("8.09 GiB", "512 B"); bytes_with_count() the same followed by the exact count, for
// error messages ("1.50 MiB (1572864 bytes)"); with_commas() a count with thousands
// separators; copy_text() a string into a C caller's buffer. No state, no locks.
#pragma once

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
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

// A count with thousands separators ("1,048,576").
inline std::string with_commas(std::uint64_t v) {
  const std::string digits = std::to_string(v);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// Copies `text` into the caller's buffer of `len` bytes (C entry points: truncated,
// NUL-terminated; nothing written when buf is null or len 0); returns text's full length.
inline int copy_text(const std::string& text, char* buf, std::size_t len) noexcept {
  if (buf && len > 0) {
    const std::size_t n = len - 1 < text.size() ? len - 1 : text.size();
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
  return static_cast<int>(text.size());
}

inline std::string bytes_with_count(std::size_t bytes) {
  return human_bytes(static_cast<std::int64_t>(bytes)) + " (" + std::to_string(bytes) + " bytes)";
}

}  // namespace streamsafe::detail
