// race_repro: device_ops on a real GPU (kernels from streamsafe_kernels, VMM memory).
#include "ops.hpp"

#include <streamsafe/backends/expandable_backend.hpp>
#include <streamsafe/kernels/optimizers.hpp>

#include <cuda_runtime_api.h>

#include <chrono>
#include <stdexcept>
#include <string>

namespace race_repro {
namespace {

namespace k = streamsafe::kernels;
using streamsafe::stream_handle;

cudaStream_t cu(stream_handle s) { return reinterpret_cast<cudaStream_t>(s); }

class gpu_ops final : public device_ops {
 public:
  explicit gpu_ops(int device) : device_(device), backend_(device) {
    check(cudaSetDevice(device_), "cudaSetDevice");
    check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  }
  ~gpu_ops() override =
      default;  // streams and events die with the process (context may be poisoned)

  streamsafe::device_backend& backend() override { return backend_; }

  stream_handle new_stream() override {
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    return reinterpret_cast<stream_handle>(s);
  }
  void init_tensor(void* p, std::size_t bytes, stream_handle s) override {
    note(k::launch_fill(p, bytes, 0x3c, cu(s)));
  }
  void write_gradient(float* g, std::size_t n, stream_handle s) override {
    note(k::launch_fill(g, n * sizeof(float), 0xbc, cu(s)));  // bytes 0xbcbcbcbc: a negative float
  }
  void optimizer_step(optimizer_kind kind, const std::vector<tensor>& tensors, int step,
                      stream_handle s) override {
    const float lr = 1e-4f, wd = 0.01f;
    switch (kind) {
      case optimizer_kind::signsgd_per_parameter:
        for (const auto& t : tensors)
          note(k::signsgd_step(t.param, k::dtype::f32, t.grad, t.n, lr, wd, cu(s)));
        break;
      case optimizer_kind::signsgd_foreach: {
        k::tensor_list list(k::dtype::f32);
        for (const auto& t : tensors) list.add(t.param, t.grad, t.n);
        note(k::signsgd_foreach(list, lr, wd, cu(s)));
        break;
      }
      case optimizer_kind::adamw_foreach: {
        k::tensor_list list(k::dtype::f32);
        for (const auto& t : tensors) list.add(t.param, t.grad, t.exp_avg, t.exp_avg_sq, t.n);
        k::adamw_hparams hp;
        hp.lr = lr;
        note(k::adamw_foreach(list, hp, step, cu(s)));
        break;
      }
    }
  }
  void stream_wait(stream_handle waiter, stream_handle on) override {
    note(cudaEventRecord(event_, cu(on)));
    note(cudaStreamWaitEvent(cu(waiter), event_, 0));
  }
  void spin(stream_handle s, double ms) override { note(k::launch_spin(cu(s), ms)); }
  void synchronize_device() override { note(cudaDeviceSynchronize()); }
  std::string finish_stream(stream_handle s) override {
    note(cudaStreamSynchronize(cu(s)));
    if (first_error_ != cudaSuccess) {
      return std::string(cudaGetErrorName(first_error_)) + ": " + cudaGetErrorString(first_error_);
    }
    return {};
  }
  double now_ms() override {
    return std::chrono::duration<double, std::milli>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

 private:
  void note(cudaError_t e) {
    if (e != cudaSuccess && first_error_ == cudaSuccess) first_error_ = e;
  }
  static void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess)
      throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
  }

  int device_;
  streamsafe::cuda::expandable_backend backend_;
  cudaEvent_t event_ = nullptr;
  cudaError_t first_error_ = cudaSuccess;
};

}  // namespace

std::unique_ptr<device_ops> make_gpu_ops(int device) { return std::make_unique<gpu_ops>(device); }

}  // namespace race_repro
