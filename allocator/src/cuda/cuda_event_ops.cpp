// streamsafe: cuda_event_ops (see cuda_event_ops.hpp). Stateless apart from the device index;
// thread-safe.
#include <streamsafe/core/errors.hpp>
#include <streamsafe/cuda/cuda_check.hpp>
#include <streamsafe/cuda/cuda_event_ops.hpp>
#include <streamsafe/cuda/device_guard.hpp>
#include <streamsafe/cuda/gpu.hpp>

#include <cuda_runtime_api.h>

#include <string>

namespace streamsafe::cuda {
namespace {

cudaEvent_t to_event(event_handle event) noexcept { return reinterpret_cast<cudaEvent_t>(event); }
cudaStream_t to_stream(stream_handle stream) noexcept {
  return reinterpret_cast<cudaStream_t>(stream);
}

int checked_device(int device) {
  const int count = device_count();
  if (device < 0 || device >= count) {
    throw backend_error("streamsafe: CUDA device " + std::to_string(device) +
                        " does not exist (" + std::to_string(count) + " device(s) present)");
  }
  return device;
}

}  // namespace

cuda_event_ops::cuda_event_ops(int device) : device_(checked_device(device)) {}

event_handle cuda_event_ops::create_event() {
  device_guard guard(device_);
  cudaEvent_t event = nullptr;
  STREAMSAFE_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
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

void cuda_event_ops::record_event(event_handle event, stream_handle stream) {
  device_guard guard(device_);
  STREAMSAFE_CUDA_CHECK(cudaEventRecord(to_event(event), to_stream(stream)));
}

bool cuda_event_ops::query_event(event_handle event) {
  device_guard guard(device_);
  const cudaError_t result = cudaEventQuery(to_event(event));
  if (result == cudaErrorNotReady) {
    (void)cudaGetLastError();  // "not ready" is an answer, not an error
    return false;
  }
  if (result != cudaSuccess) {
    detail::throw_cuda_error(result, "cudaEventQuery(event)", __FILE__, __LINE__);
  }
  return true;
}

void cuda_event_ops::synchronize_event(event_handle event) {
  device_guard guard(device_);
  STREAMSAFE_CUDA_CHECK(cudaEventSynchronize(to_event(event)));
}

void cuda_event_ops::stream_wait_event(stream_handle stream, event_handle event) {
  device_guard guard(device_);
  STREAMSAFE_CUDA_CHECK(cudaStreamWaitEvent(to_stream(stream), to_event(event), 0));
}

void cuda_event_ops::synchronize_device() {
  device_guard guard(device_);
  STREAMSAFE_CUDA_CHECK(cudaDeviceSynchronize());
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

void cuda_event_ops::memory_info(std::size_t& free_bytes, std::size_t& total_bytes) {
  device_guard guard(device_);
  STREAMSAFE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
}

}  // namespace streamsafe::cuda
