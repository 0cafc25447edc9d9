// streamsafe: cuda::cub_allocator, cub::CachingDeviceAllocator's interface over cuda::allocator.
//
// Code written against cub::CachingDeviceAllocator switches by changing the type: the same
// member functions (DeviceAllocate with and without a device, DeviceFree with and without a
// device, FreeAllCached, SetMaxCachedBytes), the same constructors, public fields and constants,
// all returning cudaError_t and never throwing. Header-only; needs no CUB header.
//
// Semantics, as CUB documents them:
//  * DeviceAllocate(device, &p, bytes, s): p may be used on s at once. Once freed, the block is
//    reusable at once on s and on other streams after the work enqueued on s before the free has
//    completed (streamsafe enforces that with an event, and with record_stream uses if any).
//    device -1 (INVALID_DEVICE_ORDINAL): the current device. bytes 0 gives a valid (512-byte)
//    block, as CUB's smallest bin does.
//  * DeviceFree(p) / DeviceFree(device, p): a host free, routed to the device that owns p
//    whatever `device` and the current device say. A null p succeeds.
// Differences from CUB (docs/drop-in.md):
//  * Blocks come from streamsafe's size classes, not CUB's geometric bins: bin_growth, min_bin
//    and max_bin are kept (public, as in CUB) but do not change the rounding; no request is
//    served "uncached".
//  * The cache is streamsafe's (allocator::instance() unless another allocator is given),
//    shared with every other user of that allocator. max_cached_bytes is unlimited unless
//    given: when a DeviceFree leaves more than max_cached_bytes cached (reserved - allocated) on
//    its device, that device's safe cached memory is released (empty_cache, defer mode: never
//    blocks, fences what other streams may still use).
//  * FreeAllCached releases streamsafe's cache on every device behind release fences (no
//    device synchronisation); the destructor releases nothing (no CUDA call at exit).
//  * Unknown, interior or double-freed pointers return cudaErrorInvalidValue (CUB would hand
//    an unknown pointer to cudaFree).
// Error codes: cudaErrorMemoryAllocation (out of memory), cudaErrorInvalidValue (bad pointer,
// null d_ptr, bad alignment), cudaErrorInvalidDevice (no such device), cudaErrorNoDevice (no
// GPU), cudaErrorUnknown (another CUDA failure). The reason is logged at debug level (logger
// "streamsafe", STREAMSAFE_LOG_LEVEL=debug); with debug set it is also printed to stderr, as
// CubDebug does.
// Thread safety: every member may be called from any thread (the settings are plain fields, as
// in CUB: set them before sharing the object).
#pragma once

#include <streamsafe/core/errors.hpp>
#include <streamsafe/frontends/allocator.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdio>
#include <exception>
#include <stdexcept>

namespace streamsafe::cuda {

class cub_allocator {
 public:
  static constexpr unsigned int INVALID_BIN = static_cast<unsigned int>(-1);
  static constexpr std::size_t INVALID_SIZE = static_cast<std::size_t>(-1);
  static constexpr int INVALID_DEVICE_ORDINAL = -1;

  // CUB's constructors. The bin parameters are recorded only; max_cached_bytes is honoured.
  cub_allocator(unsigned int bin_growth_, unsigned int min_bin_ = 1,
                unsigned int max_bin_ = INVALID_BIN, std::size_t max_cached_bytes_ = INVALID_SIZE,
                bool skip_cleanup_ = false)
      : bin_growth(bin_growth_), min_bin(min_bin_), max_bin(max_bin_),
        max_cached_bytes(max_cached_bytes_), skip_cleanup(skip_cleanup_) {}
  cub_allocator(bool skip_cleanup_ = false, bool debug_ = false)  // NOLINT: implicit, as CUB's
      : skip_cleanup(skip_cleanup_), debug(debug_) {}
  // Over another streamsafe allocator (tests, several caches), which must outlive this object.
  explicit cub_allocator(allocator& alloc, bool debug_ = false) : debug(debug_), alloc_(&alloc) {}

  cub_allocator(const cub_allocator&) = delete;
  cub_allocator& operator=(const cub_allocator&) = delete;
  virtual ~cub_allocator() = default;

  cudaError_t SetMaxCachedBytes(std::size_t max_cached_bytes_) {
    max_cached_bytes = max_cached_bytes_;
    return cudaSuccess;
  }

  cudaError_t DeviceAllocate(int device, void** d_ptr, std::size_t bytes,
                             cudaStream_t active_stream = nullptr) {
    if (!d_ptr) return report(cudaErrorInvalidValue, "DeviceAllocate: d_ptr is null");
    *d_ptr = nullptr;
    return guarded("DeviceAllocate", [&] {
      allocator& a = target();
      const int d = device == INVALID_DEVICE_ORDINAL ? a.current_device() : device;
      *d_ptr = a.allocate(bytes == 0 ? 1 : bytes, d, active_stream);
    });
  }

  cudaError_t DeviceAllocate(void** d_ptr, std::size_t bytes,
                             cudaStream_t active_stream = nullptr) {
    return DeviceAllocate(INVALID_DEVICE_ORDINAL, d_ptr, bytes, active_stream);
  }

  cudaError_t DeviceFree(int /*device: the owner is found from the pointer*/, void* d_ptr) {
    if (!d_ptr) return cudaSuccess;
    return guarded("DeviceFree", [&] {
      allocator& a = target();
      const int owner = max_cached_bytes == INVALID_SIZE ? -1 : a.owner_device(d_ptr);
      a.deallocate(d_ptr);
      if (owner >= 0) trim(a, owner);
    });
  }

  cudaError_t DeviceFree(void* d_ptr) { return DeviceFree(INVALID_DEVICE_ORDINAL, d_ptr); }

  cudaError_t FreeAllCached() {
    return guarded("FreeAllCached", [&] { (void)target().empty_cache(); });
  }

  // CUB's public fields (informational here, see above).
  unsigned int bin_growth = 8;
  unsigned int min_bin = 3;
  unsigned int max_bin = 7;
  std::size_t max_cached_bytes = INVALID_SIZE;
  bool skip_cleanup = false;
  bool debug = false;

 private:
  allocator& target() { return alloc_ ? *alloc_ : allocator::instance(); }

  void trim(allocator& a, int device) {
    const statistics s = a.stats(device);
    const auto cached = s.reserved_bytes.current - s.allocated_bytes.current;
    if (cached > 0 && static_cast<std::size_t>(cached) > max_cached_bytes) {
      (void)a.device_allocator(device).empty_cache(empty_cache_mode::defer);
    }
  }

  cudaError_t report(cudaError_t error, const char* what) const noexcept {
    log_debug(what);
    if (debug)
      std::fprintf(stderr, "streamsafe cub_allocator: %s (%s)\n", what, cudaGetErrorName(error));
    return error;
  }

  template <class F>
  cudaError_t guarded(const char* call, F&& f) noexcept {
    try {
      f();
      return cudaSuccess;
    } catch (const out_of_memory& e) {
      return report(cudaErrorMemoryAllocation, e.what());
    } catch (const invalid_pointer& e) {
      return report(cudaErrorInvalidValue, e.what());
    } catch (const std::out_of_range& e) {
      return report(cudaErrorInvalidDevice, e.what());
    } catch (const std::invalid_argument& e) {
      return report(cudaErrorInvalidValue, e.what());
    } catch (const backend_error& e) {
      int count = 0;
      const bool no_gpu = cudaGetDeviceCount(&count) != cudaSuccess || count == 0;
      (void)cudaGetLastError();
      return report(no_gpu ? cudaErrorNoDevice : cudaErrorUnknown, e.what());
    } catch (const std::exception& e) {
      return report(cudaErrorUnknown, e.what());
    } catch (...) {
      return report(cudaErrorUnknown, call);
    }
  }

  allocator* alloc_ = nullptr;  // null: allocator::instance(), looked up at each call
};

}  // namespace streamsafe::cuda
