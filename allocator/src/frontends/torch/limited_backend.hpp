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
#include <memory>

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
    backed_bytes_.fetch_sub(size_bytes);
    note(cda::TraceEntry::SEGMENT_UNMAP, addr, size_bytes);
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
