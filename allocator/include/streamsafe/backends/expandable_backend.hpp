// streamsafe: expandable_backend, the device backend built on CUDA virtual memory management
// (the driver's cuMem* calls, reached through streamsafe::cuda::driver, never linked).
//
//  * map_granularity_bytes(): the recommended granularity of pinned device memory on the
//    device, at least 2 MiB (rounded up to a multiple of it).
//  * reserve_address_range / release_address_range: cuMemAddressReserve / cuMemAddressFree,
//    sizes rounded up to the granularity (the same rounding on both sides).
//  * map(addr, size): ONE physical allocation (cuMemCreate) of the whole range, cuMemMap'ed,
//    then cuMemSetAccess read/write for the device AND for every peer device that can access
//    it (cudaDeviceCanAccessPeer, asked once at construction; peer_devices()). So kernels on a
//    peer device may read and write any block of an expandable segment, including chunks
//    mapped later, first mapping or remapping (K13); a device without peer capability is left
//    out and the map goes on. Debug builds (NDEBUG off) check each mapping with cuMemGetAccess
//    and fail the map when the device or a peer lacks read/write access. VMM memory needs no
//    cudaDeviceEnablePeerAccess. Out of memory: nothing stays
//    mapped and map returns false. The caching allocator maps one chunk per call
//    (expandable_chunk_mb).
//  * unmap(addr, size): cuMemUnmap + cuMemRelease of each mapped range inside; the range must
//    be a union of whole ranges given to map(). NO synchronisation: the allocator fences
//    before it (this is the call that faults under pending work).
//  * allocate_segment / free_segment: reserve + map of the rounded size / unmap + release, so
//    the backend also serves as a plain segment source.
// Events, streams and memory info come from cuda_event_ops. Every driver call runs under a
// device_guard for the backend's device. Failures other than out-of-memory throw
// streamsafe::backend_error.
//
// IPC: physical memory is created shareable (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) where
// the device supports it (else map falls back to no handle type and export_memory throws).
// export_memory(block): one descriptor per mapped range under the block
// (cuMemExportToShareableHandle), with the ranges' sizes and the block's offset; import_memory
// reserves one address range, imports each descriptor (cuMemImportFromShareableHandle), maps
// it there, grants read/write to the device and its peers, and closes the descriptors;
// close_imported_memory unmaps and frees that range (no synchronisation). The imported physical
// memory stays alive while mapped, whatever the producer does with its own mapping.
//
// Destruction: chunks still mapped are reported (log), then released after a device
// synchronisation (the one place this backend waits: nothing else could release them).
//
// Thread safety: the chunk table (range address -> physical handle and size) is guarded by a mutex,
// held only around table updates, never across driver calls; every call may come from any
// thread. Concurrent calls on overlapping ranges are a caller error (the driver refuses them).
#pragma once

#include <streamsafe/backends/cuda_event_ops.hpp>

#include <cuda.h>

#include <atomic>
#include <cstddef>
#include <map>
#include <mutex>
#include <vector>

namespace streamsafe::cuda {

class expandable_backend final : public cuda_event_ops {
 public:
  // Throws backend_error when `device` does not exist, lacks virtual memory management, or
  // the driver entry points cannot be loaded (on a machine without a GPU: always).
  explicit expandable_backend(int device);
  ~expandable_backend() override;

  const char* name() const noexcept override { return "expandable"; }

  void* allocate_segment(std::size_t size_bytes) override;
  void free_segment(void* base, std::size_t size_bytes) override;

  bool supports_expandable() const noexcept override { return true; }
  std::size_t map_granularity_bytes() const noexcept override { return granularity_; }
  void* reserve_address_range(std::size_t size_bytes) override;
  void release_address_range(void* base, std::size_t size_bytes) override;
  bool map(void* addr, std::size_t size_bytes) override;
  void unmap(void* addr, std::size_t size_bytes) override;
  // cuMemMap of the physical allocations mapped at [from, from+size) at addr too, with the same
  // access; each allocation is released (cuMemRelease) once, at the unmap of its last mapping.
  bool map_alias(void* addr, const void* from, std::size_t size_bytes) override;

  ipc_memory export_memory(std::uintptr_t segment_base, std::size_t segment_bytes,
                           std::uintptr_t addr, std::size_t size_bytes) override;
  std::uintptr_t import_memory(const ipc_memory& memory) override;
  void close_imported_memory(std::uintptr_t addr) override;
  // True when map() creates shareable (POSIX file descriptor) physical memory.
  bool shareable() const noexcept { return shareable_.load(std::memory_order_relaxed); }

  // Ranges mapped now, one per map() call (statistics, tests).
  std::size_t mapped_chunk_count() const;
  // The other devices that map() grants read/write access to (those that can access this
  // device's memory), in increasing order; empty on a single-GPU machine.
  const std::vector<int>& peer_devices() const noexcept { return peers_; }

 private:
  struct mapping {
    CUmemGenericAllocationHandle handle;
    std::size_t size_bytes;
  };
  // One entry per map() call: one physical allocation, mapped at its address.
  using chunk_table = std::map<CUdeviceptr, mapping>;

  std::size_t rounded_size(std::size_t size_bytes) const;
  CUdeviceptr checked_range(void* addr, std::size_t size_bytes, const char* call) const;
  void unmap_and_release(CUdeviceptr base, const mapping* maps, std::size_t count) const noexcept;

  struct import_record {
    CUdeviceptr base;                 // the reserved range
    std::size_t bytes;                // its size
    std::vector<std::size_t> pieces;  // mapped sizes, in address order
  };

  CUmemAllocationProp prop_{};
  std::atomic<bool> shareable_{true};  // cleared when the device refuses POSIX_FD handles
  std::multimap<std::uintptr_t, import_record> imports_;  // guarded by mutex_
  std::vector<int> peers_;
  std::vector<CUmemAccessDesc> access_;  // read/write for the device, then each peer
  std::size_t granularity_ = 0;
  std::size_t total_bytes_ = 0;
  mutable std::mutex mutex_;
  chunk_table chunks_;  // guarded by mutex_
  // Physical allocations mapped at more than one address (map_alias): the extra mappings.
  std::map<CUmemGenericAllocationHandle, int> extra_mappings_;  // guarded by mutex_
  // True (and one extra mapping fewer) when handle stays mapped elsewhere: no release yet.
  bool mapped_elsewhere(CUmemGenericAllocationHandle handle);  // mutex_ held
};

}  // namespace streamsafe::cuda
