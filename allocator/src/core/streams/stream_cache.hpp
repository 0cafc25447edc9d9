// streamsafe core: each thread's cache of the stream states it used last (internal).
// Read and written by its own thread only, so no lock guards it; an entry names its allocator
// (caching_allocator::impl::id_), and a cached state is used only while its `alive` flag holds
// (a destroyed stream's state stays allocated until its allocator goes, so the pointer is safe).
// Defined in streams.cpp; read by the fast paths of allocate.cpp and free.cpp.
#pragma once

#include <streamsafe/backends/device_backend.hpp>

#include <cstdint>

namespace streamsafe::detail {

struct stream_cache_entry {
  std::uint64_t owner = 0;  // the allocator's id
  stream_handle stream = 0;
  void* state = nullptr;  // its caching_allocator::impl::stream_state
};

struct thread_cache {
  static constexpr int k_streams = 4;
  stream_cache_entry streams[k_streams];
  unsigned next = 0;
  stream_cache_entry last_used;  // the state of this thread's last allocation
};

// initial-exec: one TLS access without __tls_get_addr, also in position-independent code (the
// 128 bytes fit glibc's static TLS surplus, so a dlopen'ed library may use it too).
extern thread_local thread_cache t_cache __attribute__((tls_model("initial-exec")));

}  // namespace streamsafe::detail
