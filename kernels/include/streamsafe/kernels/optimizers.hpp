// streamsafe optimizer kernels: a host API callable from plain C++ (g++), no CUDA C++ syntax.
//
// Every launcher enqueues its work on the given stream and returns the launch status
// (cudaGetLastError() right after the launch; the first failing launch of a foreach call ends the
// call). Invalid arguments (a null pointer with a non-zero size, an unknown dtype, an AdamW step
// below 1, a beta outside [0, 1)) return cudaErrorInvalidValue before anything is launched;
// empty work (n == 0, an empty list) returns cudaSuccess and launches nothing. Nothing here
// synchronises: memory passed in must stay valid until the stream has run the work.
//
// Parameters are fp32 or bf16 (bf16 passed as void*, two bytes per element, read and written
// with round-to-nearest-even); gradients and the AdamW moments are always fp32; all math is fp32.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace streamsafe::kernels {

// Element type of a parameter tensor.
enum class dtype : int { f32 = 0, bf16 = 1 };

// One tensor of a foreach call. exp_avg/exp_avg_sq (the AdamW moments m and v) are used by
// adamw_foreach only and may stay null for signsgd_foreach.
struct tensor_ref {
  void* param = nullptr;
  const float* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  std::size_t n = 0;  // elements
};

// The tensors of one foreach call; all parameters share one dtype (group by dtype, as PyTorch's
// foreach optimizers do). Zero-sized entries are skipped.
struct tensor_list {
  dtype param_dtype = dtype::f32;
  std::vector<tensor_ref> tensors;

  tensor_list() = default;
  explicit tensor_list(dtype d) : param_dtype(d) {}

  void add(void* param, const float* grad, std::size_t n) {
    tensor_ref t;
    t.param = param;
    t.grad = grad;
    t.n = n;
    tensors.push_back(t);
  }
  void add(void* param, const float* grad, float* exp_avg, float* exp_avg_sq, std::size_t n) {
    tensor_ref t;
    t.param = param;
    t.grad = grad;
    t.exp_avg = exp_avg;
    t.exp_avg_sq = exp_avg_sq;
    t.n = n;
    tensors.push_back(t);
  }
};

// Foreach chunking (multi-tensor apply): each tensor is cut into chunks of this many elements, one
// thread block per (tensor, chunk) pair; one launch carries the metadata of up to
// *_max_tensors_per_launch tensors and *_max_chunks_per_launch pairs in its kernel arguments.
inline constexpr std::size_t foreach_chunk_elements = 65536;
inline constexpr std::size_t signsgd_foreach_max_tensors_per_launch = 64;
inline constexpr std::size_t adamw_foreach_max_tensors_per_launch = 36;
inline constexpr std::size_t foreach_max_chunks_per_launch = 320;

// How many kernel launches signsgd_foreach / adamw_foreach make for this list (host only; no
// CUDA call). Counts the non-empty tensors only.
std::size_t signsgd_foreach_launch_count(const tensor_list& tensors);
std::size_t adamw_foreach_launch_count(const tensor_list& tensors);

// ---- SignSGD with decoupled weight decay -------------------------------------------------------
// p <- p * (1 - lr*weight_decay) - lr * sign(g), sign(+-0) = 0 (a NaN gradient propagates).
// (1 - lr*weight_decay) is rounded to float once on the host.

// One launch for one tensor of n elements.
cudaError_t signsgd_step(void* param, dtype param_dtype, const float* grad, std::size_t n, float lr,
                         float weight_decay, cudaStream_t stream);

// All tensors of the list (param, grad, n) in as few launches as the chunking allows.
cudaError_t signsgd_foreach(const tensor_list& tensors, float lr, float weight_decay,
                            cudaStream_t stream);

// ---- AdamW (bias-corrected, decoupled weight decay) -------------------------------------------
// With t = step (1 for the first step):
//   p <- p * (1 - lr*weight_decay)
//   m <- beta1*m + (1-beta1)*g ;  v <- beta2*v + (1-beta2)*g*g
//   p <- p - lr * (m / (1-beta1^t)) / (sqrt(v / (1-beta2^t)) + eps)
// The bias corrections 1-beta^t are computed on the host in double and rounded to float.
struct adamw_hparams {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-2f;
};

// One launch for one tensor: param (param_dtype), grad, exp_avg (m), exp_avg_sq (v), n elements.
cudaError_t adamw_step(void* param, dtype param_dtype, const float* grad, float* exp_avg,
                       float* exp_avg_sq, std::size_t n, const adamw_hparams& hp, std::int64_t step,
                       cudaStream_t stream);

// All tensors of the list (param, grad, exp_avg, exp_avg_sq, n), chunked as above.
cudaError_t adamw_foreach(const tensor_list& tensors, const adamw_hparams& hp, std::int64_t step,
                          cudaStream_t stream);

// ---- Helpers for tests and the race example ---------------------------------------------------

// Keeps the stream busy for about `milliseconds` (one block, one thread spinning on the GPU's
// global timer). milliseconds must be in [0, 3.6e6] (one hour) and not NaN.
cudaError_t launch_spin(cudaStream_t stream, double milliseconds);

// A kernel writes `value` to each of the `bytes` bytes at device address p (any alignment).
cudaError_t launch_fill(void* p, std::size_t bytes, unsigned char value, cudaStream_t stream);

// A kernel reads the `bytes` bytes at p and atomically ADDS their sum (each byte unsigned) into
// *sum, a device-accessible counter the caller has initialised (e.g. with cudaMemsetAsync).
cudaError_t launch_read_sum(const void* p, std::size_t bytes, unsigned long long* sum,
                            cudaStream_t stream);

}  // namespace streamsafe::kernels
