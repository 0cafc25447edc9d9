// streamsafe-replay: the GPU replay device (--gpu): a streamsafe::cuda backend of the kind the
// options ask for, and one non-blocking CUDA stream per trace stream other than 0. Streams are
// destroyed with the device, after the allocator built on it (replay.cpp keeps that order).
// Builds everywhere (CUDA runtime only); where there is no GPU make_gpu_device throws.
#include "replay.hpp"

#include <streamsafe/backends/cuda_malloc_backend.hpp>
#include <streamsafe/backends/expandable_backend.hpp>
#include <streamsafe/backends/gpu.hpp>
#include <streamsafe/core/errors.hpp>

#include <cuda_runtime_api.h>

#include <string>
#include <unordered_map>

namespace streamsafe::replay {
namespace {

class gpu_replay_device final : public replay_device {
 public:
  gpu_replay_device(int device, backend_kind kind) : device_(device), kind_(kind) {
    if (kind == backend_kind::expandable)
      backend_ = std::make_unique<cuda::expandable_backend>(device);
    else backend_ = std::make_unique<cuda::cuda_malloc_backend>(device);
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) name_ = prop.name;
  }
  ~gpu_replay_device() override {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    for (auto& [id, s] : streams_) cudaStreamDestroy(reinterpret_cast<cudaStream_t>(s));
    cudaSetDevice(previous);
  }

  device_backend& backend() override { return *backend_; }

  stream_handle stream(std::uint64_t trace_stream) override {
    if (trace_stream == 0) return 0;
    auto it = streams_.find(trace_stream);
    if (it != streams_.end()) return it->second;
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    cudaStream_t s = nullptr;
    const cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaSetDevice(previous);
    if (err != cudaSuccess) {
      throw backend_error(std::string("streamsafe-replay: cudaStreamCreateWithFlags on device ") +
                          std::to_string(device_) + ": " + cudaGetErrorName(err) + ": " +
                          cudaGetErrorString(err));
    }
    const auto handle = reinterpret_cast<stream_handle>(s);
    streams_.emplace(trace_stream, handle);
    return handle;
  }

  std::string description() const override {
    return "GPU " + std::to_string(device_) + (name_.empty() ? "" : " (" + name_ + ")") + ", " +
           to_string(kind_) + " backend";
  }

 private:
  int device_;
  backend_kind kind_;
  std::string name_;
  std::unique_ptr<device_backend> backend_;
  std::unordered_map<std::uint64_t, stream_handle> streams_;
};

}  // namespace

std::unique_ptr<replay_device> make_gpu_device(int device, backend_kind kind) {
  const int count = cuda::device_count();
  if (device < 0 || device >= count) {
    throw backend_error("streamsafe-replay: --gpu " + std::to_string(device) + ": " +
                        (count == 0 ? std::string("no GPU on this machine")
                                    : "only " + std::to_string(count) + " GPU(s) here"));
  }
  return std::make_unique<gpu_replay_device>(device, kind);
}

}  // namespace streamsafe::replay
