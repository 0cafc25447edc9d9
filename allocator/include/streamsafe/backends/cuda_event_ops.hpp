// streamsafe: cuda_event_ops, the part of a CUDA device backend that both CUDA backends share:
// the device binding, events, stream waits and queries, device synchronisation, memory info
// and the capture query. The segment calls are left to the derived backend
// (cuda_malloc_backend, expandable_backend).
//
// Events are created with cudaEventDisableTiming; stream and event handles are cudaStream_t /
// cudaEvent_t values cast to std::uintptr_t (0 is the legacy default stream). Every call runs
// under a device_guard for the backend's device. Errors throw streamsafe::backend_error, except
// destroy_event, which logs.
//
// Thread safety: no state besides the device index; every call may come from any thread.
#pragma once

#include <streamsafe/backends/device_backend.hpp>

#include <cstddef>
#include <memory>
#include <mutex>

namespace streamsafe::cuda {

class cuda_event_ops : public device_backend {
 public:
  cuda_event_ops(const cuda_event_ops&) = delete;
  cuda_event_ops& operator=(const cuda_event_ops&) = delete;

  int device() const noexcept final { return device_; }

  event_handle create_event() final;
  void destroy_event(event_handle event) noexcept final;
  void record_event(event_handle event, stream_handle stream) final;
  bool query_event(event_handle event) final;
  void synchronize_event(event_handle event) final;
  void stream_wait_event(stream_handle stream, event_handle event) final;
  bool query_stream(stream_handle stream) final;  // cudaStreamQuery
  void synchronize_device() final;
  void memory_info(std::size_t& free_bytes, std::size_t& total_bytes) final;
  // cudaStreamIsCapturing (active or invalidated); false for stream 0 and on any error.
  bool stream_is_capturing(stream_handle stream) noexcept final;
  std::uint64_t capture_id(stream_handle stream) noexcept final;  // cudaStreamGetCaptureInfo
  // The stream's capture dependencies (graph nodes); follows: a backward walk of the graph from
  // the stream's dependencies reaches every node of the position.
  std::vector<std::uintptr_t> capture_position(stream_handle stream) final;
  bool capture_follows(stream_handle stream, const std::vector<std::uintptr_t>& position) final;
  // cudaStreamPerThread (handle 2): a different stream in every thread.
  bool stream_is_per_thread(stream_handle stream) const noexcept final { return stream == 2; }
  stream_handle create_stream() final;
  void destroy_stream(stream_handle stream) final;
  void copy_async(void* dst, const void* src, std::size_t bytes, stream_handle stream) final;
  // Pinned host memory of this device (pinned_host_backend); nullptr if it cannot be made.
  device_backend* host_backend() noexcept override;
  // IPC events: cudaEventCreateWithFlags(cudaEventDisableTiming | cudaEventInterprocess),
  // cudaIpcGetEventHandle (64 bytes), cudaIpcOpenEventHandle, cudaEventDestroy.
  event_handle create_ipc_event() final;
  std::vector<std::uint8_t> export_event(event_handle event) final;
  event_handle open_ipc_event(const std::vector<std::uint8_t>& bytes) final;

 protected:
  // Throws backend_error when `device` is not a valid device index here (no GPU: always).
  explicit cuda_event_ops(int device);
  ~cuda_event_ops() override = default;

 private:
  // True when the device's primary context is already current on this thread: the event calls
  // then skip the device guard's cudaGetDevice (tens of ns each on the H200).
  bool device_is_current() const noexcept;

  int device_;
  void* primary_context_ = nullptr;  // the device's primary CUcontext (null: unknown)
  std::once_flag host_once_;
  std::unique_ptr<device_backend> host_;  // the pinned_host_backend, made by host_backend()
};

}  // namespace streamsafe::cuda
