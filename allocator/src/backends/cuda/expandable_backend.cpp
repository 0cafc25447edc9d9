// streamsafe: expandable_backend (see expandable_backend.hpp). The chunk table is guarded by
// mutex_, held only around table reads and updates, never across a driver call.
#include "core/common/format.hpp"

#include <streamsafe/backends/capture_mode.hpp>
#include <streamsafe/backends/cuda_check.hpp>
#include <streamsafe/backends/device_guard.hpp>
#include <streamsafe/backends/driver_api.hpp>
#include <streamsafe/backends/expandable_backend.hpp>
#include <streamsafe/core/errors.hpp>

#include <cuda_runtime_api.h>

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace streamsafe::cuda {
namespace {

constexpr std::size_t min_granularity = std::size_t{2} << 20;

std::string hex(CUdeviceptr address) {
  return streamsafe::detail::hex(static_cast<std::uintptr_t>(address));
}

[[noreturn]] void invalid_range(const char* call, CUdeviceptr base, std::size_t size_bytes,
                                const char* why) {
  throw backend_error(std::string("streamsafe: expandable backend ") + call + "(" + hex(base) +
                      ", " + std::to_string(size_bytes) + "): " + why);
}

}  // namespace

expandable_backend::expandable_backend(int device) : cuda_event_ops(device) {
  driver::load();
  device_guard guard(device);
  STREAMSAFE_CUDA_CHECK(cudaFree(nullptr));  // the primary context exists before any cuMem*
  prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop_.location.id = device;
  prop_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  // A device without virtual memory management fails here (CUDA_ERROR_NOT_SUPPORTED).
  std::size_t recommended = 0;
  STREAMSAFE_CU_CHECK(driver::mem_get_allocation_granularity(&recommended, &prop_,
                                                             CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  if (recommended == 0) recommended = min_granularity;
  granularity_ = (min_granularity + recommended - 1) / recommended * recommended;
  CUmemAccessDesc self{};
  self.location = prop_.location;
  self.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  access_.push_back(self);
  int count = 0;
  STREAMSAFE_CUDA_CHECK(cudaGetDeviceCount(&count));
  for (int peer = 0; peer < count; ++peer) {
    if (peer == device) continue;
    int can_access = 0;
    STREAMSAFE_CUDA_CHECK(cudaDeviceCanAccessPeer(&can_access, peer, device));
    if (can_access == 0) continue;
    peers_.push_back(peer);
    CUmemAccessDesc desc = self;
    desc.location.id = peer;
    access_.push_back(desc);
  }
  std::size_t free_bytes = 0;
  STREAMSAFE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes_));
}

expandable_backend::~expandable_backend() {
  chunk_table left;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    left.swap(chunks_);
  }
  if (left.empty()) return;
  std::optional<device_guard> guard;
  try {
    const std::string message = "streamsafe: expandable backend destroyed with " +
                                std::to_string(left.size()) +
                                " chunk(s) still mapped; synchronising the device and releasing";
    detail::log_message(spdlog::level::warn, message.c_str());
    guard.emplace(device());
    STREAMSAFE_CUDA_CHECK_NOTHROW(cudaDeviceSynchronize());
  } catch (...) {
    // No guard (or no message): release anyway, the driver calls name their own addresses.
  }
  for (const auto& [address, m] : left) {
    bool elsewhere = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      elsewhere = mapped_elsewhere(m.handle);
    }
    if (elsewhere) {
      STREAMSAFE_CU_CHECK_NOTHROW(driver::mem_unmap(address, m.size_bytes));
    } else {
      unmap_and_release(address, &m, 1);
    }
  }
}

bool expandable_backend::mapped_elsewhere(CUmemGenericAllocationHandle handle) {
  auto it = extra_mappings_.find(handle);
  if (it == extra_mappings_.end()) return false;
  if (--it->second == 0) extra_mappings_.erase(it);
  return true;
}

std::size_t expandable_backend::rounded_size(std::size_t size_bytes) const {
  if (size_bytes == 0) return granularity_;
  if (size_bytes > std::numeric_limits<std::size_t>::max() - granularity_) {
    throw backend_error("streamsafe: expandable backend: size " + std::to_string(size_bytes) +
                        " overflows when rounded up to the granularity");
  }
  return (size_bytes + granularity_ - 1) / granularity_ * granularity_;
}

CUdeviceptr expandable_backend::checked_range(void* addr, std::size_t size_bytes,
                                              const char* call) const {
  const auto base = static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(addr));
  if (base == 0 || size_bytes == 0 || base % granularity_ != 0 || size_bytes % granularity_ != 0) {
    invalid_range(call, base, size_bytes,
                  ("address and size must be non-zero multiples of the granularity (" +
                   std::to_string(granularity_) + " bytes)")
                      .c_str());
  }
  if (base > std::numeric_limits<CUdeviceptr>::max() - size_bytes) {
    invalid_range(call, base, size_bytes, "the range wraps around the address space");
  }
  return base;
}

void expandable_backend::unmap_and_release(CUdeviceptr base, const mapping* maps,
                                           std::size_t count) const noexcept {
  for (std::size_t i = 0; i < count; ++i) {
    STREAMSAFE_CU_CHECK_NOTHROW(driver::mem_unmap(base, maps[i].size_bytes));
    STREAMSAFE_CU_CHECK_NOTHROW(driver::mem_release(maps[i].handle));
    base += maps[i].size_bytes;
  }
}

void* expandable_backend::allocate_segment(std::size_t size_bytes) {
  if (size_bytes > total_bytes_) return nullptr;  // can never fit
  const std::size_t size = rounded_size(size_bytes);
  CUdeviceptr base = 0;
  {
    device_guard guard(device());
    relaxed_capture_mode relaxed;  // growth is legal during a graph capture
    const CUresult result = driver::mem_address_reserve(&base, size, granularity_, 0, 0);
    if (result == CUDA_ERROR_OUT_OF_MEMORY) return nullptr;
    if (result != CUDA_SUCCESS) {
      detail::throw_cu_error(result, "cuMemAddressReserve(&base, size, granularity, 0, 0)",
                             __FILE__, __LINE__);
    }
  }
  void* const segment = reinterpret_cast<void*>(static_cast<std::uintptr_t>(base));
  bool mapped = false;
  try {
    mapped = map(segment, size);
  } catch (...) {
    release_address_range(segment, size);
    throw;
  }
  if (!mapped) {
    release_address_range(segment, size);
    return nullptr;
  }
  return segment;
}

void expandable_backend::free_segment(void* base, std::size_t size_bytes) {
  if (base == nullptr) return;
  const std::size_t size = rounded_size(size_bytes);
  unmap(base, size);
  release_address_range(base, size);
}

void* expandable_backend::reserve_address_range(std::size_t size_bytes) {
  const std::size_t size = rounded_size(size_bytes);
  device_guard guard(device());
  relaxed_capture_mode relaxed;  // growth is legal during a graph capture
  CUdeviceptr base = 0;
  STREAMSAFE_CU_CHECK(driver::mem_address_reserve(&base, size, granularity_, 0, 0));
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(base));
}

void expandable_backend::release_address_range(void* base, std::size_t size_bytes) {
  if (base == nullptr) return;
  const std::size_t size = rounded_size(size_bytes);
  const CUdeviceptr address = checked_range(base, size, "release_address_range");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = chunks_.lower_bound(address);
    if (it != chunks_.end() && it->first < address + size) {
      invalid_range("release_address_range", address, size,
                    ("the chunk at " + hex(it->first) + " is still mapped").c_str());
    }
  }
  device_guard guard(device());
  STREAMSAFE_CU_CHECK(driver::mem_address_free(address, size));
}

bool expandable_backend::map(void* addr, std::size_t size_bytes) {
  // One physical allocation for the whole range: the allocator maps in its own chunk size and
  // unmaps only whole chunks, so fewer, larger handles mean fewer driver calls.
  const CUdeviceptr base = checked_range(addr, size_bytes, "map");
  if (size_bytes > total_bytes_) return false;  // can never fit
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = chunks_.upper_bound(base);
    if (it != chunks_.begin() && std::prev(it)->first + std::prev(it)->second.size_bytes > base)
      --it;
    if (it != chunks_.end() && it->first < base + size_bytes) {
      invalid_range("map", base, size_bytes,
                    ("the range at " + hex(it->first) + " is already mapped").c_str());
    }
  }
  device_guard guard(device());
  relaxed_capture_mode relaxed;  // growth is legal during a graph capture (not captured)
  CUmemGenericAllocationHandle handle{};
  // Shareable physical memory (IPC, export_memory) unless the device refuses the handle type.
  CUmemAllocationProp prop = prop_;
  const bool shareable = shareable_.load(std::memory_order_relaxed);
  if (shareable) prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUresult failure = driver::mem_create(&handle, size_bytes, &prop, 0);
  if (shareable && (failure == CUDA_ERROR_NOT_SUPPORTED || failure == CUDA_ERROR_INVALID_VALUE)) {
    shareable_.store(false, std::memory_order_relaxed);
    failure = driver::mem_create(&handle, size_bytes, &prop_, 0);
  }
  if (failure == CUDA_ERROR_OUT_OF_MEMORY) return false;
  if (failure != CUDA_SUCCESS) {
    detail::throw_cu_error(failure, "cuMemCreate(&handle, size, &prop, 0)", __FILE__, __LINE__);
  }
  const char* failed_call = nullptr;
  failure = driver::mem_map(base, size_bytes, 0, handle, 0);
  if (failure != CUDA_SUCCESS) {
    failed_call = "cuMemMap(base, size, 0, handle, 0)";
    STREAMSAFE_CU_CHECK_NOTHROW(driver::mem_release(handle));
  } else {
    // Read/write for the device and every peer that can access it (one call for all).
    failure = driver::mem_set_access(base, size_bytes, access_.data(), access_.size());
    if (failure != CUDA_SUCCESS) {
      failed_call = "cuMemSetAccess(base, size, access (device and peers), count)";
      const mapping m{handle, size_bytes};
      unmap_and_release(base, &m, 1);
    }
#ifndef NDEBUG
    // The debug check of K13: the driver reports read/write access for the device and each
    // capable peer on this mapping, as on every other mapping of the range (the same access_).
    for (std::size_t i = 0; failure == CUDA_SUCCESS && i < access_.size(); ++i) {
      unsigned long long flags = 0;
      failure = driver::mem_get_access(&flags, &access_[i].location, base);
      if (failure == CUDA_SUCCESS && flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        failure = CUDA_ERROR_INVALID_VALUE;
      if (failure != CUDA_SUCCESS) {
        failed_call = "cuMemGetAccess(&flags, location (device or peer), base): not read/write";
        const mapping m{handle, size_bytes};
        unmap_and_release(base, &m, 1);
      }
    }
#endif
  }
  if (failure != CUDA_SUCCESS) {
    if (failure == CUDA_ERROR_OUT_OF_MEMORY) return false;
    detail::throw_cu_error(failure, failed_call, __FILE__, __LINE__);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  chunks_.emplace(base, mapping{handle, size_bytes});
  return true;
}

void expandable_backend::unmap(void* addr, std::size_t size_bytes) {
  // The range must be a union of whole ranges that map() mapped, back to back.
  const CUdeviceptr base = checked_range(addr, size_bytes, "unmap");
  std::vector<mapping> maps;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    CUdeviceptr at = base;
    for (auto it = chunks_.find(base); at < base + size_bytes; ++it) {
      if (it == chunks_.end() || it->first != at ||
          it->first + it->second.size_bytes > base + size_bytes) {
        invalid_range("unmap", base, size_bytes,
                      ("the range at " + hex(at) + " is not exactly a mapped range").c_str());
      }
      maps.push_back(it->second);
      at += it->second.size_bytes;
    }
  }
  device_guard guard(device());
  CUdeviceptr at = base;
  for (const mapping& m : maps) {
    CUresult result = driver::mem_unmap(at, m.size_bytes);
    if (result == CUDA_SUCCESS) {
      bool elsewhere = false;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        chunks_.erase(at);  // gone from the address space, whatever the release says
        elsewhere = mapped_elsewhere(m.handle);
      }
      if (!elsewhere) result = driver::mem_release(m.handle);
    }
    if (result != CUDA_SUCCESS) {
      detail::throw_cu_error(result, "cuMemUnmap/cuMemRelease(range)", __FILE__, __LINE__);
    }
    at += m.size_bytes;
  }
}

bool expandable_backend::map_alias(void* addr, const void* from, std::size_t size_bytes) {
  const CUdeviceptr base = checked_range(addr, size_bytes, "map_alias");
  const CUdeviceptr source = checked_range(const_cast<void*>(from), size_bytes, "map_alias");
  std::vector<mapping> maps;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    CUdeviceptr at = source;
    for (auto it = chunks_.find(source); at < source + size_bytes; ++it) {
      if (it == chunks_.end() || it->first != at ||
          it->first + it->second.size_bytes > source + size_bytes) {
        invalid_range("map_alias", source, size_bytes,
                      ("the range at " + hex(at) + " is not exactly a mapped range").c_str());
      }
      maps.push_back(it->second);
      at += it->second.size_bytes;
    }
    auto it = chunks_.lower_bound(base);
    if (it != chunks_.end() && it->first < base + size_bytes) {
      invalid_range("map_alias", base, size_bytes,
                    ("the range at " + hex(it->first) + " is already mapped").c_str());
    }
  }
  device_guard guard(device());
  relaxed_capture_mode relaxed;
  CUdeviceptr at = base;
  std::size_t done = 0;
  CUresult failure = CUDA_SUCCESS;
  for (; done < maps.size(); ++done) {
    const mapping& m = maps[done];
    failure = driver::mem_map(at, m.size_bytes, 0, m.handle, 0);
    if (failure != CUDA_SUCCESS) break;
    failure = driver::mem_set_access(at, m.size_bytes, access_.data(), access_.size());
    if (failure != CUDA_SUCCESS) {
      STREAMSAFE_CU_CHECK_NOTHROW(driver::mem_unmap(at, m.size_bytes));
      break;
    }
    at += m.size_bytes;
  }
  if (failure != CUDA_SUCCESS) {
    at = base;
    for (std::size_t i = 0; i < done; ++i) {  // nothing stays mapped
      STREAMSAFE_CU_CHECK_NOTHROW(driver::mem_unmap(at, maps[i].size_bytes));
      at += maps[i].size_bytes;
    }
    if (failure == CUDA_ERROR_OUT_OF_MEMORY) return false;
    detail::throw_cu_error(failure, "cuMemMap/cuMemSetAccess(alias)", __FILE__, __LINE__);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  at = base;
  for (const mapping& m : maps) {
    chunks_.emplace(at, m);
    ++extra_mappings_[m.handle];
    at += m.size_bytes;
  }
  return true;
}

namespace {

struct ipc_header {
  std::uint64_t offset;  // of the block's first byte from the first range's start
  std::uint64_t size;    // the block's bytes
  std::uint64_t ranges;  // how many ranges (and descriptors) follow
};

}  // namespace

device_backend::ipc_memory expandable_backend::export_memory(std::uintptr_t /*segment_base*/,
                                                             std::size_t /*segment_bytes*/,
                                                             std::uintptr_t addr,
                                                             std::size_t size_bytes) {
  const auto lo = static_cast<CUdeviceptr>(addr);
  const CUdeviceptr hi = lo + size_bytes;
  std::vector<std::pair<CUdeviceptr, mapping>> ranges;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = chunks_.upper_bound(lo);
    if (it == chunks_.begin()) invalid_range("export_memory", lo, size_bytes, "not mapped");
    --it;
    CUdeviceptr at = it->first;
    for (; it != chunks_.end() && it->first < hi; ++it) {
      if (it->first != at) invalid_range("export_memory", lo, size_bytes, "a hole in the range");
      ranges.emplace_back(it->first, it->second);
      at += it->second.size_bytes;
    }
    if (ranges.empty() || at < hi) invalid_range("export_memory", lo, size_bytes, "not mapped");
  }
  ipc_memory out;
  ipc_header h{lo - ranges.front().first, size_bytes, ranges.size()};
  out.bytes.resize(sizeof h + ranges.size() * sizeof(std::uint64_t));
  std::memcpy(out.bytes.data(), &h, sizeof h);
  device_guard guard(device());
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    const std::uint64_t bytes = ranges[i].second.size_bytes;
    std::memcpy(out.bytes.data() + sizeof h + i * sizeof bytes, &bytes, sizeof bytes);
    int fd = -1;
    const CUresult r = driver::mem_export_to_shareable_handle(
        &fd, ranges[i].second.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDA_SUCCESS) {
      for (int f : out.fds) ::close(f);
      if (!shareable()) {
        throw backend_error("streamsafe: expandable backend export_memory on device " +
                            std::to_string(device()) +
                            ": the device does not support shareable (POSIX file descriptor) "
                            "physical memory");
      }
      detail::throw_cu_error(r, "cuMemExportToShareableHandle(&fd, handle, POSIX_FD, 0)", __FILE__,
                             __LINE__);
    }
    out.fds.push_back(fd);
  }
  return out;
}

std::uintptr_t expandable_backend::import_memory(const ipc_memory& memory) {
  const auto close_all = [&] {
    for (int f : memory.fds) ::close(f);
  };
  ipc_header h{};
  if (memory.bytes.size() < sizeof h) {
    close_all();
    throw backend_error("streamsafe: expandable backend import_memory: not an expandable export");
  }
  std::memcpy(&h, memory.bytes.data(), sizeof h);
  if (h.ranges == 0 || memory.bytes.size() != sizeof h + h.ranges * sizeof(std::uint64_t) ||
      memory.fds.size() != h.ranges) {
    close_all();
    throw backend_error(
        "streamsafe: expandable backend import_memory: the export's ranges and descriptors "
        "disagree (exported by the other backend kind?)");
  }
  import_record rec{0, 0, {}};
  for (std::size_t i = 0; i < h.ranges; ++i) {
    std::uint64_t bytes = 0;
    std::memcpy(&bytes, memory.bytes.data() + sizeof h + i * sizeof bytes, sizeof bytes);
    rec.pieces.push_back(static_cast<std::size_t>(bytes));
    rec.bytes += static_cast<std::size_t>(bytes);
  }
  device_guard guard(device());
  CUresult r = driver::mem_address_reserve(&rec.base, rec.bytes, granularity_, 0, 0);
  if (r != CUDA_SUCCESS) {
    close_all();
    detail::throw_cu_error(r, "cuMemAddressReserve(import)", __FILE__, __LINE__);
  }
  std::size_t mapped = 0;
  CUdeviceptr at = rec.base;
  const char* failed = nullptr;
  for (std::size_t i = 0; i < h.ranges && !failed; ++i) {
    CUmemGenericAllocationHandle handle{};
    r = driver::mem_import_from_shareable_handle(
        &handle, reinterpret_cast<void*>(static_cast<std::uintptr_t>(memory.fds[i])),
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS) {
      failed = "cuMemImportFromShareableHandle(&handle, fd, POSIX_FD)";
      break;
    }
    r = driver::mem_map(at, rec.pieces[i], 0, handle, 0);
    STREAMSAFE_CU_CHECK_NOTHROW(driver::mem_release(handle));  // the mapping keeps it alive
    if (r != CUDA_SUCCESS) {
      failed = "cuMemMap(import)";
      break;
    }
    ++mapped;
    // Read/write for the device and its peers, per mapped range as map() does.
    r = driver::mem_set_access(at, rec.pieces[i], access_.data(), access_.size());
    if (r != CUDA_SUCCESS) {
      failed = "cuMemSetAccess(import)";
      break;
    }
    at += rec.pieces[i];
  }
  close_all();
  if (failed) {
    at = rec.base;
    for (std::size_t i = 0; i < mapped; ++i) {
      STREAMSAFE_CU_CHECK_NOTHROW(driver::mem_unmap(at, rec.pieces[i]));
      at += rec.pieces[i];
    }
    STREAMSAFE_CU_CHECK_NOTHROW(driver::mem_address_free(rec.base, rec.bytes));
    detail::throw_cu_error(r, failed, __FILE__, __LINE__);
  }
  const std::uintptr_t addr = static_cast<std::uintptr_t>(rec.base) + h.offset;
  std::lock_guard<std::mutex> lock(mutex_);
  imports_.emplace(addr, std::move(rec));
  return addr;
}

void expandable_backend::close_imported_memory(std::uintptr_t addr) {
  import_record rec{0, 0, {}};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = imports_.find(addr);
    if (it == imports_.end()) {
      throw backend_error("streamsafe: expandable backend close_imported_memory on device " +
                          std::to_string(device()) + ": nothing imported at " + hex(addr));
    }
    rec = std::move(it->second);
    imports_.erase(it);
  }
  device_guard guard(device());
  CUdeviceptr at = rec.base;
  for (std::size_t bytes : rec.pieces) {
    STREAMSAFE_CU_CHECK(driver::mem_unmap(at, bytes));
    at += bytes;
  }
  STREAMSAFE_CU_CHECK(driver::mem_address_free(rec.base, rec.bytes));
}

std::size_t expandable_backend::mapped_chunk_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return chunks_.size();
}

}  // namespace streamsafe::cuda
