// streamsafe core: per-thread stream handles (cudaStreamPerThread) as one stream per host thread.
//
// A handle the backend marks with stream_is_per_thread names a different stream in every host
// thread. The core keys each thread's stream by a per-thread key of its own, and only that
// thread can name the stream to the driver. Keys lie in [2^62, 2^63): real stream handles are
// user-space pointers or small integers below that, graph keys and the tombstone above it.
// Layout: k_per_thread_base + (thread number << 8) + the handle (below 256; CUDA's is 2).
// Thread numbers start at 1 and are never reused (a thread id can be, once joined).
#pragma once

#include <streamsafe/backends/device_backend.hpp>

#include <cstdint>

namespace streamsafe::detail {

inline constexpr stream_handle k_per_thread_base = stream_handle{1} << 62;
inline constexpr stream_handle k_per_thread_end = stream_handle{1} << 63;
inline constexpr stream_handle k_per_thread_max_handle = 0xff;

// This thread's number (1, 2, ...), assigned on first use.
std::uint64_t this_thread_number() noexcept;

constexpr bool is_per_thread_key(stream_handle s) noexcept {
  return s >= k_per_thread_base && s < k_per_thread_end;
}
inline stream_handle per_thread_key(stream_handle handle) noexcept {
  return k_per_thread_base + (static_cast<stream_handle>(this_thread_number()) << 8) + handle;
}
constexpr stream_handle per_thread_handle_of(stream_handle key) noexcept {
  return key & k_per_thread_max_handle;
}
// True when `key` is the calling thread's own per-thread stream (only it can name the stream).
inline bool own_per_thread_key(stream_handle key) noexcept {
  return ((key - k_per_thread_base) >> 8) == this_thread_number();
}

}  // namespace streamsafe::detail
