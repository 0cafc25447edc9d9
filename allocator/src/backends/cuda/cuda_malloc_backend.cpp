// streamsafe: cuda_malloc_backend (see cuda_malloc_backend.hpp). Stateless apart from the
// device index; thread-safe.
#include <streamsafe/backends/capture_mode.hpp>
#include <streamsafe/backends/cuda_check.hpp>
#include <streamsafe/backends/cuda_malloc_backend.hpp>
#include <streamsafe/backends/device_guard.hpp>
#include <streamsafe/core/errors.hpp>

#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

namespace streamsafe::cuda {
namespace {

[[noreturn]] void not_supported(const char* call) {
  throw backend_error(std::string("streamsafe: ") + call +
                      " is not supported by cuda_malloc backend (no expandable segments)");
}

}  // namespace

cuda_malloc_backend::cuda_malloc_backend(int device) : cuda_event_ops(device) {}

void* cuda_malloc_backend::allocate_segment(std::size_t size_bytes) {
  device_guard guard(device());
  relaxed_capture_mode relaxed;  // legal during a graph capture; not captured, not replayed
  void* base = nullptr;
  const cudaError_t result = cudaMalloc(&base, size_bytes);
  if (result == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // out of memory is an answer here, not a sticky error
    return nullptr;
  }
  if (result != cudaSuccess) {
    detail::throw_cuda_error(result, "cudaMalloc(&base, size_bytes)", __FILE__, __LINE__);
  }
  return base;
}

void cuda_malloc_backend::free_segment(void* base, std::size_t /*size_bytes*/) {
  if (base == nullptr) return;
  device_guard guard(device());
  STREAMSAFE_CUDA_CHECK(cudaFree(base));
}

void* cuda_malloc_backend::reserve_address_range(std::size_t /*size_bytes*/) {
  not_supported("reserve_address_range");
}

void cuda_malloc_backend::release_address_range(void* /*base*/, std::size_t /*size_bytes*/) {
  not_supported("release_address_range");
}

bool cuda_malloc_backend::map(void* /*addr*/, std::size_t /*size_bytes*/) { not_supported("map"); }

void cuda_malloc_backend::unmap(void* /*addr*/, std::size_t /*size_bytes*/) {
  not_supported("unmap");
}

namespace {

struct ipc_wire {
  cudaIpcMemHandle_t handle;
  std::uint64_t offset;
  std::uint64_t size;
};

}  // namespace

device_backend::ipc_memory cuda_malloc_backend::export_memory(std::uintptr_t segment_base,
                                                              std::size_t /*segment_bytes*/,
                                                              std::uintptr_t addr,
                                                              std::size_t size_bytes) {
  ipc_wire w{};
  {
    device_guard guard(device());
    STREAMSAFE_CUDA_CHECK(cudaIpcGetMemHandle(&w.handle, reinterpret_cast<void*>(segment_base)));
  }
  w.offset = addr - segment_base;
  w.size = size_bytes;
  ipc_memory out;
  out.bytes.resize(sizeof w);
  std::memcpy(out.bytes.data(), &w, sizeof w);
  return out;
}

std::uintptr_t cuda_malloc_backend::import_memory(const ipc_memory& memory) {
  ipc_wire w{};
  if (memory.bytes.size() != sizeof w || !memory.fds.empty()) {
    throw backend_error("streamsafe: cuda_malloc backend import_memory on device " +
                        std::to_string(device()) +
                        ": not an export of a cuda_malloc backend (exported by the other "
                        "backend kind?)");
  }
  std::memcpy(&w, memory.bytes.data(), sizeof w);
  void* base = nullptr;
  {
    device_guard guard(device());
    STREAMSAFE_CUDA_CHECK(cudaIpcOpenMemHandle(&base, w.handle, cudaIpcMemLazyEnablePeerAccess));
  }
  const std::uintptr_t addr = reinterpret_cast<std::uintptr_t>(base) + w.offset;
  std::lock_guard<std::mutex> lock(mutex_);
  imports_.emplace(addr, base);
  return addr;
}

void cuda_malloc_backend::close_imported_memory(std::uintptr_t addr) {
  void* base = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = imports_.find(addr);
    if (it == imports_.end()) {
      throw backend_error("streamsafe: cuda_malloc backend close_imported_memory on device " +
                          std::to_string(device()) + ": nothing imported at that address");
    }
    base = it->second;
    imports_.erase(it);
  }
  device_guard guard(device());
  STREAMSAFE_CUDA_CHECK(cudaIpcCloseMemHandle(base));
}

}  // namespace streamsafe::cuda
