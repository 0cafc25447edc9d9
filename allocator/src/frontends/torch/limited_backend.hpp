// streamsafe PyTorch extension: limited_backend (internal), the device backend under each
// device's streamsafe allocator: it enforces torch.cuda.set_per_process_memory_fraction (a cap
// on the bytes backed by device memory) and reports segment events to the memory history
// (torch_history.cpp defines note()).
#pragma once

#include <streamsafe/backends/forwarding_backend.hpp>

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace streamsafe::torch_ext {

namespace cda = c10::CachingDeviceAllocator;

class torch_allocator;

// The owned real backend, a base so that it exists before forwarding_backend refers to it.
struct owned_backend {
  std::unique_ptr<device_backend> owned;
};

// Forwards every call to the device's real backend (forwarding_backend); refuses growth beyond a
// per-device cap on reserved bytes (set_per_process_memory_fraction) as the device being out of
// memory, so that streamsafe's out-of-memory path (release behind a fence, retry, out_of_memory)
// applies; and reports segment events to the history.
//
// pluggable_backend: the segments of a MemPool with its own allocator (a CUDAPluggableAllocator)
// come from that allocator's raw_alloc / raw_delete, as in PyTorch; events and streams are the
// real backend's.
class limited_backend final : private owned_backend, public forwarding_backend {
 public:
  // backed_bytes: the device's bytes backed by memory, shared by every limited_backend of the
  // device (the main allocator's and each MemPool allocator's), so that the cap is device-wide.
  limited_backend(std::unique_ptr<device_backend> inner, std::atomic<std::size_t>* limit_bytes,
                  std::atomic<std::size_t>* backed_bytes, torch_allocator* owner)
      : owned_backend{std::move(inner)}, forwarding_backend(*owned), limit_bytes_(limit_bytes),
        owner_(owner), backed_bytes_(*backed_bytes) {}

  void* allocate_segment(std::size_t size_bytes) override {
    if (!take(size_bytes)) return nullptr;
    void* p = nullptr;
    try {
      p = inner().allocate_segment(size_bytes);
    } catch (...) {
      backed_bytes_.fetch_sub(size_bytes);
      throw;
    }
    if (!p) {
      backed_bytes_.fetch_sub(size_bytes);
      return nullptr;
    }
    note(cda::TraceEntry::SEGMENT_ALLOC, p, size_bytes);
    return p;
  }
  void free_segment(void* base, std::size_t size_bytes) override {
    inner().free_segment(base, size_bytes);
    backed_bytes_.fetch_sub(size_bytes);
    note(cda::TraceEntry::SEGMENT_FREE, base, size_bytes);
  }
  bool map(void* addr, std::size_t size_bytes) override {
    if (!take(size_bytes)) return false;
    bool ok = false;
    try {
      ok = inner().map(addr, size_bytes);
    } catch (...) {
      backed_bytes_.fetch_sub(size_bytes);
      throw;
    }
    if (!ok) {
      backed_bytes_.fetch_sub(size_bytes);
      return false;
    }
    note(cda::TraceEntry::SEGMENT_MAP, addr, size_bytes);
    return true;
  }
  void unmap(void* addr, std::size_t size_bytes) override {
    inner().unmap(addr, size_bytes);
    backed_bytes_.fetch_sub(forget(reinterpret_cast<std::uintptr_t>(addr), size_bytes));
    note(cda::TraceEntry::SEGMENT_UNMAP, addr, size_bytes);
  }
  // The core maps queued memory a second time for another stream (reclaim.cpp): no new memory,
  // so nothing is taken from the cap, and the memory goes back at the unmap of its last address.
  bool map_alias(void* addr, const void* from, std::size_t size_bytes) override {
    if (!inner().map_alias(addr, from, size_bytes)) return false;
    const std::size_t gran = inner().map_granularity_bytes();
    const auto dst = reinterpret_cast<std::uintptr_t>(addr);
    const auto src = reinterpret_cast<std::uintptr_t>(from);
    std::lock_guard<std::mutex> lk(alias_mu_);
    for (std::size_t off = 0; off < size_bytes; off += gran) {
      auto it = memory_of_.find(src + off);
      if (it == memory_of_.end()) {  // first aliased: a name for the memory
        it = memory_of_.emplace(src + off, ++last_memory_).first;
        refs_[it->second] = 1;
      }
      memory_of_[dst + off] = it->second;
      ++refs_[it->second];
    }
    return true;
  }

 private:
  bool take(std::size_t size_bytes) {
    const std::size_t limit = limit_bytes_->load(std::memory_order_relaxed);
    const std::size_t before = backed_bytes_.fetch_add(size_bytes);
    if (limit != 0 && before + size_bytes > limit) {
      backed_bytes_.fetch_sub(size_bytes);
      return false;
    }
    return true;
  }
  void note(cda::TraceEntry::Action action, void* addr, std::size_t size_bytes) noexcept;
  // The bytes of [addr, addr + size) whose memory goes back with this unmap (not still mapped at
  // another address, map_alias).
  std::size_t forget(std::uintptr_t addr, std::size_t size_bytes) {
    std::lock_guard<std::mutex> lk(alias_mu_);
    if (memory_of_.empty()) return size_bytes;
    const std::size_t gran = inner().map_granularity_bytes();
    std::size_t freed = 0;
    for (std::size_t off = 0; off < size_bytes; off += gran) {
      auto it = memory_of_.find(addr + off);
      if (it == memory_of_.end()) {
        freed += gran;
        continue;
      }
      const std::uint64_t memory = it->second;
      memory_of_.erase(it);
      if (--refs_[memory] == 0) {
        refs_.erase(memory);
        freed += gran;
      }
    }
    return freed;
  }

  std::mutex alias_mu_;
  std::unordered_map<std::uintptr_t, std::uint64_t> memory_of_;  // aliased granule -> memory
  std::unordered_map<std::uint64_t, int> refs_;                  // memory -> its addresses
  std::uint64_t last_memory_ = 0;
  std::atomic<std::size_t>* limit_bytes_;
  torch_allocator* owner_;
  std::atomic<std::size_t>& backed_bytes_;
};

class pluggable_backend final : private owned_backend, public forwarding_backend {
 public:
  pluggable_backend(std::unique_ptr<device_backend> inner,
                    std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator)
      : owned_backend{std::move(inner)}, forwarding_backend(*owned),
        allocator_(std::move(allocator)) {}

  void* allocate_segment(std::size_t size_bytes) override;  // torch_mempool.cpp
  void free_segment(void* base, std::size_t size_bytes) override;

 private:
  std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator_;
};

}  // namespace streamsafe::torch_ext
