// streamsafe benchmarks: PyTorch's c10 CUDA caching allocator behind the ABI-neutral functions
// of c10_baseline.hpp. The only translation unit that includes PyTorch headers; compiled with
// PyTorch's _GLIBCXX_USE_CXX11_ABI (see bench/benchmarks.cmake).
#include "c10_baseline.hpp"

#include <c10/core/Device.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifndef STREAMSAFE_BENCH_TORCH_VERSION
#define STREAMSAFE_BENCH_TORCH_VERSION "unknown"
#endif

// c10's "does this device have a primary context" hook. libtorch_cuda registers it when it
// loads; the baseline links only libc10_cuda, whose placeholder throws ("Should never been
// called") from inside a DataPtr's deleter (recordStream's path sets the device through it),
// which terminates the process. The baseline registers a real answer from the driver instead.
namespace c10::cuda::_internal {
void setHasPrimaryContext(bool (*func)(c10::DeviceIndex));
}

namespace streamsafe_bench::c10_baseline {
namespace {

using primary_ctx_get_state_fn = int (*)(int device, unsigned int* flags, int* active);

bool has_primary_context(c10::DeviceIndex device) {
  static const primary_ctx_get_state_fn get_state = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &fn, 12000,
                                         cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<primary_ctx_get_state_fn>(nullptr);
    }
    return reinterpret_cast<primary_ctx_get_state_fn>(fn);
  }();
  if (get_state == nullptr) return false;
  unsigned int flags = 0;
  int active = 0;
  return get_state(static_cast<int>(device), &flags, &active) == 0 && active != 0;
}

namespace cca = c10::cuda::CUDACachingAllocator;

struct owned_block {
  void* ptr;
  c10::DataPtr data;
};

// This thread's owned blocks (the record_stream scenario keeps one or two alive at a time, so a
// linear search is a handful of compares).
thread_local std::vector<owned_block> t_owned;

c10::DeviceIndex current_device_index() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) throw std::runtime_error("cudaGetDevice failed");
  return static_cast<c10::DeviceIndex>(device);
}

c10::cuda::CUDAStream external_stream(void* stream) {
  return c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream),
                                          current_device_index());
}

std::vector<owned_block>::iterator find_owned(void* ptr) {
  for (auto it = t_owned.begin(); it != t_owned.end(); ++it) {
    if (it->ptr == ptr) return it;
  }
  throw std::logic_error("c10 baseline: pointer not allocated by allocate_owned on this thread");
}

}  // namespace

bool initialize(char* why, std::size_t why_size) noexcept {
  try {
    int count = 0;
    const cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      std::snprintf(why, why_size, "no CUDA device (%s)", cudaGetErrorName(status));
      return false;
    }
    cca::CUDAAllocator* a = cca::get();
    if (a == nullptr) {
      std::snprintf(why, why_size, "c10::cuda::CUDACachingAllocator::get() is null");
      return false;
    }
    c10::cuda::_internal::setHasPrimaryContext(has_primary_context);
    if (!a->initialized()) cca::init(count);
    return true;
  } catch (const std::exception& e) {
    std::snprintf(why, why_size, "%s", e.what());
  } catch (...) {
    std::snprintf(why, why_size, "unknown exception");
  }
  return false;
}

const char* torch_version() noexcept { return STREAMSAFE_BENCH_TORCH_VERSION; }

void* allocate(std::size_t bytes, void* stream) {
  return cca::raw_alloc_with_stream(bytes, static_cast<cudaStream_t>(stream));
}

void deallocate(void* ptr) { cca::raw_delete(ptr); }

void* allocate_owned(std::size_t bytes, void* stream) {
  c10::cuda::setCurrentCUDAStream(external_stream(stream));
  c10::DataPtr data = cca::get()->allocate(bytes);
  void* ptr = data.get();
  t_owned.push_back(owned_block{ptr, std::move(data)});
  return ptr;
}

void record_stream(void* ptr, void* stream) {
  auto it = find_owned(ptr);
  cca::recordStream(it->data, external_stream(stream));
}

void deallocate_owned(void* ptr) {
  auto it = find_owned(ptr);
  if (it != t_owned.end() - 1) std::swap(*it, t_owned.back());
  t_owned.pop_back();  // the DataPtr's deleter frees the block
}

void empty_cache() { cca::emptyCache(); }

void reset_peak_reserved() { cca::resetPeakStats(current_device_index()); }

std::int64_t peak_reserved_bytes() {
  return cca::getDeviceStats(current_device_index()).reserved_bytes[0].peak;
}

std::int64_t reserved_bytes() {
  return cca::getDeviceStats(current_device_index()).reserved_bytes[0].current;
}

}  // namespace streamsafe_bench::c10_baseline
