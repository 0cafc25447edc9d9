// streamsafe: cuda_malloc_backend, the device backend whose segments are plain cudaMalloc /
// cudaFree allocations on one device. No virtual memory management: supports_expandable() is
// false and reserve/map/unmap throw backend_error. Events, streams and memory info come from
// cuda_event_ops.
//
// allocate_segment returns nullptr when cudaMalloc runs out of memory (the runtime's error is
// cleared); every other failure throws backend_error. free_segment calls cudaFree, which
// synchronises the device implicitly (free_segment_synchronizes() is true): the allocator fences
// before it anyway, and in empty_cache defer mode frees only while every stream it knows is idle.
//
// IPC: export_memory is cudaIpcGetMemHandle of the segment (64 bytes) and the block's offset in
// it; import_memory is cudaIpcOpenMemHandle (cudaIpcMemLazyEnablePeerAccess) plus that offset,
// close_imported_memory cudaIpcCloseMemHandle. No file descriptors.
//
// Thread safety: the table of imports is guarded by a mutex (never held across a driver call);
// every call may come from any thread and runs under a device_guard for the backend's device.
#pragma once

#include <streamsafe/backends/cuda_event_ops.hpp>

#include <cstddef>
#include <map>
#include <mutex>

namespace streamsafe::cuda {

class cuda_malloc_backend final : public cuda_event_ops {
 public:
  // Throws backend_error when `device` does not exist (on a machine without a GPU: always).
  explicit cuda_malloc_backend(int device);

  const char* name() const noexcept override { return "cuda_malloc"; }

  void* allocate_segment(std::size_t size_bytes) override;
  void free_segment(void* base, std::size_t size_bytes) override;
  bool free_segment_synchronizes() const noexcept override { return true; }  // cudaFree

  bool supports_expandable() const noexcept override { return false; }
  // 0: this backend maps nothing.
  std::size_t map_granularity_bytes() const noexcept override { return 0; }
  void* reserve_address_range(std::size_t size_bytes) override;
  void release_address_range(void* base, std::size_t size_bytes) override;
  bool map(void* addr, std::size_t size_bytes) override;
  void unmap(void* addr, std::size_t size_bytes) override;

  ipc_memory export_memory(std::uintptr_t segment_base, std::size_t segment_bytes,
                           std::uintptr_t addr, std::size_t size_bytes) override;
  std::uintptr_t import_memory(const ipc_memory& memory) override;
  void close_imported_memory(std::uintptr_t addr) override;

 private:
  std::mutex mutex_;
  std::multimap<std::uintptr_t, void*> imports_;  // imported address -> opened segment base
};

}  // namespace streamsafe::cuda
