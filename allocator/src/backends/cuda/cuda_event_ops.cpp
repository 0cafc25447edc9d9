// streamsafe: cuda_event_ops (see cuda_event_ops.hpp). Stateless apart from the device index;
// thread-safe.
#include <streamsafe/backends/cuda_check.hpp>
#include <streamsafe/backends/cuda_event_ops.hpp>
#include <streamsafe/backends/device_guard.hpp>
#include <streamsafe/backends/driver_api.hpp>
#include <streamsafe/backends/gpu.hpp>
#include <streamsafe/backends/pinned_host_backend.hpp>
#include <streamsafe/core/errors.hpp>

#include <cuda_runtime_api.h>

#include <cstring>
#include <set>
#include <string>
#include <vector>

namespace streamsafe::cuda {
namespace {

cudaEvent_t to_event(event_handle event) noexcept { return reinterpret_cast<cudaEvent_t>(event); }
cudaStream_t to_stream(stream_handle stream) noexcept {
  return reinterpret_cast<cudaStream_t>(stream);
}

// The answer of cudaEventQuery / cudaStreamQuery: true when done, false when not ready (an
// answer, not an error: cleared); any other result throws backend_error naming the call.
bool completed(cudaError_t result, const char* call, int line) {
  if (result == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  if (result != cudaSuccess) detail::throw_cuda_error(result, call, __FILE__, line);
  return true;
}

int checked_device(int device) {
  const int count = device_count();
  if (device < 0 || device >= count) {
    throw backend_error("streamsafe: CUDA device " + std::to_string(device) + " does not exist (" +
                        std::to_string(count) + " device(s) present)");
  }
  return device;
}

}  // namespace

cuda_event_ops::cuda_event_ops(int device) : device_(checked_device(device)) {
  // The primary context of the device: cudaSetDevice initialises it and makes it current (CUDA
  // 12 and later); the previous device is current again afterwards. (No cudaFree(nullptr): the
  // LD_PRELOAD interposer builds this class and interposes cudaFree.)
  int previous = device_;
  STREAMSAFE_CUDA_CHECK(cudaGetDevice(&previous));
  STREAMSAFE_CUDA_CHECK(cudaSetDevice(device_));
  CUcontext context = nullptr;
  if (driver::ctx_get_current(&context) == CUDA_SUCCESS) primary_context_ = context;
  if (previous != device_) STREAMSAFE_CUDA_CHECK(cudaSetDevice(previous));
}

bool cuda_event_ops::device_is_current() const noexcept {
  CUcontext current = nullptr;
  return primary_context_ != nullptr && driver::ctx_get_current(&current) == CUDA_SUCCESS &&
         current == static_cast<CUcontext>(primary_context_);
}

event_handle cuda_event_ops::create_event() {
  device_guard guard(device_);
  cudaEvent_t event = nullptr;
  STREAMSAFE_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return reinterpret_cast<event_handle>(event);
}

event_handle cuda_event_ops::create_ipc_event() {
  device_guard guard(device_);
  cudaEvent_t event = nullptr;
  STREAMSAFE_CUDA_CHECK(
      cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventInterprocess));
  return reinterpret_cast<event_handle>(event);
}

std::vector<std::uint8_t> cuda_event_ops::export_event(event_handle event) {
  device_guard guard(device_);
  cudaIpcEventHandle_t handle{};
  STREAMSAFE_CUDA_CHECK(cudaIpcGetEventHandle(&handle, to_event(event)));
  const auto* p = reinterpret_cast<const std::uint8_t*>(&handle);
  return std::vector<std::uint8_t>(p, p + sizeof handle);
}

event_handle cuda_event_ops::open_ipc_event(const std::vector<std::uint8_t>& bytes) {
  cudaIpcEventHandle_t handle{};
  if (bytes.size() != sizeof handle) {
    throw backend_error("streamsafe: open_ipc_event on device " + std::to_string(device_) + ": " +
                        std::to_string(bytes.size()) + " bytes are not a cudaIpcEventHandle_t");
  }
  std::memcpy(&handle, bytes.data(), sizeof handle);
  device_guard guard(device_);
  cudaEvent_t event = nullptr;
  STREAMSAFE_CUDA_CHECK(cudaIpcOpenEventHandle(&event, handle));
  return reinterpret_cast<event_handle>(event);
}

void cuda_event_ops::destroy_event(event_handle event) noexcept {
  if (event == 0) return;
  try {
    device_guard guard(device_);
    STREAMSAFE_CUDA_CHECK_NOTHROW(cudaEventDestroy(to_event(event)));
  } catch (...) {
    // The guard could not make the device current (its failure is already cleared); destroy
    // anyway: cudaEventDestroy does not need the event's device to be current.
    STREAMSAFE_CUDA_CHECK_NOTHROW(cudaEventDestroy(to_event(event)));
  }
}

// The event calls go through the driver API, which costs less than the runtime's wrappers (see
// driver_api.hpp). The handles are the same objects in both APIs (cudaEvent_t is CUevent,
// cudaStream_t is CUstream, including the legacy and per-thread stream values).
namespace {

// True for the driver results after which the runtime call must do the work: a thread on which
// the runtime has not bound a context yet (it binds one lazily), or no driver entry points.
bool needs_runtime(CUresult r) noexcept {
  return r == CUDA_ERROR_INVALID_CONTEXT || r == CUDA_ERROR_NOT_INITIALIZED;
}

CUevent to_cu(event_handle event) noexcept { return reinterpret_cast<CUevent>(event); }
CUstream to_cu_stream(stream_handle stream) noexcept { return reinterpret_cast<CUstream>(stream); }

// Runs a driver call with `device` current: without the device guard when it already is
// (`device_current`); a failure there is tried once more under the guard, which is the answer then.
template <class DriverCall>
CUresult on_device(bool device_current, int device, DriverCall call) {
  if (device_current) {
    const CUresult r = call();
    if (r == CUDA_SUCCESS || r == CUDA_ERROR_NOT_READY) return r;
  }
  device_guard guard(device);
  return call();
}

}  // namespace

void cuda_event_ops::record_event(event_handle event, stream_handle stream) {
  const CUresult r = on_device(device_is_current(), device_, [&] {
    return driver::event_record(to_cu(event), to_cu_stream(stream));
  });
  if (r == CUDA_SUCCESS) return;
  if (!needs_runtime(r))
    detail::throw_cu_error(r, "cuEventRecord(event, stream)", __FILE__, __LINE__);
  device_guard guard(device_);
  STREAMSAFE_CUDA_CHECK(cudaEventRecord(to_event(event), to_stream(stream)));
}

bool cuda_event_ops::query_event(event_handle event) {
  const CUresult r = on_device(device_is_current(), device_,
                               [&] { return driver::event_query(to_cu(event)); });
  if (r == CUDA_SUCCESS) return true;
  if (r == CUDA_ERROR_NOT_READY) return false;
  if (!needs_runtime(r)) detail::throw_cu_error(r, "cuEventQuery(event)", __FILE__, __LINE__);
  device_guard guard(device_);
  return completed(cudaEventQuery(to_event(event)), "cudaEventQuery(event)", __LINE__);
}

void cuda_event_ops::synchronize_event(event_handle event) {
  device_guard guard(device_);
  STREAMSAFE_CUDA_CHECK(cudaEventSynchronize(to_event(event)));
}

void cuda_event_ops::stream_wait_event(stream_handle stream, event_handle event) {
  const CUresult r = on_device(device_is_current(), device_, [&] {
    return driver::stream_wait_event(to_cu_stream(stream), to_cu(event), 0);
  });
  if (r == CUDA_SUCCESS) return;
  if (!needs_runtime(r))
    detail::throw_cu_error(r, "cuStreamWaitEvent(stream, event)", __FILE__, __LINE__);
  device_guard guard(device_);
  STREAMSAFE_CUDA_CHECK(cudaStreamWaitEvent(to_stream(stream), to_event(event), 0));
}

bool cuda_event_ops::query_stream(stream_handle stream) {
  device_guard guard(device_);
  return completed(cudaStreamQuery(to_stream(stream)), "cudaStreamQuery(stream)", __LINE__);
}

void cuda_event_ops::synchronize_device() {
  device_guard guard(device_);
  STREAMSAFE_CUDA_CHECK(cudaDeviceSynchronize());
}

std::uint64_t cuda_event_ops::capture_id(stream_handle stream) noexcept {
  if (stream == 0) return 0;
  try {
    device_guard guard(device_);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    if (cudaStreamGetCaptureInfo(to_stream(stream), &status, &id) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return status == cudaStreamCaptureStatusNone ? 0 : static_cast<std::uint64_t>(id);
  } catch (...) {
    return 0;
  }
}

namespace {

// The capture dependencies of a capturing stream (empty when it is not capturing).
std::vector<cudaGraphNode_t> capture_dependencies(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaGraphNode_t* deps = nullptr;
  std::size_t n = 0;
#if CUDART_VERSION >= 13000
  STREAMSAFE_CUDA_CHECK(
      cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &deps, nullptr, &n));
#else
  STREAMSAFE_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &deps, &n));
#endif
  if (status != cudaStreamCaptureStatusActive || !deps) return {};
  return {deps, deps + n};
}

std::vector<cudaGraphNode_t> node_dependencies(cudaGraphNode_t node) {
  std::size_t n = 0;
#if CUDART_VERSION >= 13000
  STREAMSAFE_CUDA_CHECK(cudaGraphNodeGetDependencies(node, nullptr, nullptr, &n));
  std::vector<cudaGraphNode_t> deps(n);
  if (n) STREAMSAFE_CUDA_CHECK(cudaGraphNodeGetDependencies(node, deps.data(), nullptr, &n));
#else
  STREAMSAFE_CUDA_CHECK(cudaGraphNodeGetDependencies(node, nullptr, &n));
  std::vector<cudaGraphNode_t> deps(n);
  if (n) STREAMSAFE_CUDA_CHECK(cudaGraphNodeGetDependencies(node, deps.data(), &n));
#endif
  deps.resize(n);
  return deps;
}

}  // namespace

std::vector<std::uintptr_t> cuda_event_ops::capture_position(stream_handle stream) {
  if (stream == 0) return {};
  device_guard guard(device_);
  std::vector<std::uintptr_t> out;
  for (cudaGraphNode_t n : capture_dependencies(to_stream(stream)))
    out.push_back(reinterpret_cast<std::uintptr_t>(n));
  return out;
}

bool cuda_event_ops::capture_follows(stream_handle stream,
                                     const std::vector<std::uintptr_t>& position) {
  if (stream == 0) return false;
  device_guard guard(device_);
  std::set<std::uintptr_t> wanted(position.begin(), position.end());
  std::set<cudaGraphNode_t> seen;
  std::vector<cudaGraphNode_t> todo = capture_dependencies(to_stream(stream));
  while (!todo.empty() && !wanted.empty()) {  // backward from the stream's frontier
    cudaGraphNode_t n = todo.back();
    todo.pop_back();
    if (!seen.insert(n).second) continue;
    wanted.erase(reinterpret_cast<std::uintptr_t>(n));
    for (cudaGraphNode_t d : node_dependencies(n)) todo.push_back(d);
  }
  return wanted.empty();
}

bool cuda_event_ops::stream_is_capturing(stream_handle stream) noexcept {
  if (stream == 0) return false;  // the legacy stream never captures (and may not be asked)
  try {
    device_guard guard(device_);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(to_stream(stream), &status) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    // An invalidated capture still has to be ended by its owner: it counts as capturing.
    return status != cudaStreamCaptureStatusNone;
  } catch (...) {
    return false;
  }
}

stream_handle cuda_event_ops::create_stream() {
  device_guard guard(device_);
  cudaStream_t stream = nullptr;
  STREAMSAFE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return reinterpret_cast<stream_handle>(stream);
}

void cuda_event_ops::destroy_stream(stream_handle stream) {
  device_guard guard(device_);
  STREAMSAFE_CUDA_CHECK(cudaStreamDestroy(to_stream(stream)));
}

void cuda_event_ops::copy_async(void* dst, const void* src, std::size_t bytes,
                                stream_handle stream) {
  device_guard guard(device_);
  STREAMSAFE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, to_stream(stream)));
}

device_backend* cuda_event_ops::host_backend() noexcept {
  try {
    std::call_once(host_once_, [this] { host_ = std::make_unique<pinned_host_backend>(device_); });
  } catch (...) {
    return nullptr;  // the once_flag stays unset: a later call tries again
  }
  return host_.get();
}

void cuda_event_ops::memory_info(std::size_t& free_bytes, std::size_t& total_bytes) {
  device_guard guard(device_);
  STREAMSAFE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
}

}  // namespace streamsafe::cuda
