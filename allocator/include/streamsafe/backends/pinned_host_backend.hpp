// streamsafe: pinned_host_backend, pinned host memory as segments of a device backend.
//
// allocate_segment is cudaHostAlloc(cudaHostAllocPortable) (nullptr when the host is out of
// memory), free_segment cudaFreeHost, which may wait for the device: free_segment_synchronizes()
// is true, so the caching allocator frees a host segment behind its fence and, in defer mode,
// only while every stream it knows is idle. Streams, events and copies are the device's
// (cuda_event_ops). A caching_allocator over it (backend_kind::cuda_malloc) is a stream-ordered
// pinned host allocator: a block freed with deallocate(p, s) or after record_stream is reused
// only behind events, and empty_cache never frees memory a pending copy reads (case K18).
// Offload uses it through device_backend::host_backend().
// Thread safety: stateless apart from the device index; any thread.
#pragma once

#include <streamsafe/backends/cuda_event_ops.hpp>

#include <cstddef>

namespace streamsafe::cuda {

class pinned_host_backend final : public cuda_event_ops {
 public:
  explicit pinned_host_backend(int device);

  const char* name() const noexcept override { return "pinned_host"; }
  void* allocate_segment(std::size_t size_bytes) override;
  void free_segment(void* base, std::size_t size_bytes) override;
  bool free_segment_synchronizes() const noexcept override { return true; }
  bool supports_expandable() const noexcept override { return false; }
  std::size_t map_granularity_bytes() const noexcept override { return 0; }
  void* reserve_address_range(std::size_t size_bytes) override;
  void release_address_range(void* base, std::size_t size_bytes) override;
  bool map(void* addr, std::size_t size_bytes) override;
  void unmap(void* addr, std::size_t size_bytes) override;
  device_backend* host_backend() noexcept override { return nullptr; }
};

}  // namespace streamsafe::cuda
