// AdamW (bias-corrected Adam with decoupled weight decay), fp32 moments, fp32/bf16 params.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "detail.cuh"
#include "streamsafe/kernels/optimizers.hpp"

namespace streamsafe::kernels {
namespace {

using detail::bf16;

// Per-step constants, computed once on the host.
struct adamw_consts {
  float lr;
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float decay;  // 1 - lr*weight_decay
  float bc1;    // 1 - beta1^t
  float bc2;    // 1 - beta2^t
};

inline constexpr int adamw_depth = 4;  // param, grad, exp_avg, exp_avg_sq
inline constexpr int adamw_max_tensors = static_cast<int>(adamw_foreach_max_tensors_per_launch);
inline constexpr int adamw_max_blocks = static_cast<int>(foreach_max_chunks_per_launch);
using adamw_args = detail::foreach_args<adamw_depth, adamw_max_tensors, adamw_max_blocks>;
static_assert(sizeof(adamw_args) + sizeof(adamw_consts) <= 4096, "kernel arguments over 4 KiB");

__device__ __forceinline__ void adamw_update(float& p, float g, float& m, float& v,
                                             const adamw_consts& c) {
  p = p * c.decay;
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * g * g;
  const float mhat = m / c.bc1;
  const float vhat = v / c.bc2;
  p = p - c.lr * mhat / (sqrtf(vhat) + c.eps);
}

template <typename P>
__device__ __forceinline__ void adamw_range(P* __restrict__ p, const float* __restrict__ g,
                                            float* __restrict__ m, float* __restrict__ v,
                                            std::uint64_t n, const adamw_consts& c,
                                            std::uint64_t first, std::uint64_t stride) {
  std::uint64_t scalar_from = 0;
  if (detail::vec4_aligned(p) && detail::vec4_aligned(g) && detail::vec4_aligned(m) &&
      detail::vec4_aligned(v)) {
    const std::uint64_t nvec = n / 4;
    for (std::uint64_t i = first; i < nvec; i += stride) {
      float pv[4];
      float gv[4];
      float mv[4];
      float vv[4];
      detail::load4(p + 4 * i, pv);
      detail::load4(g + 4 * i, gv);
      detail::load4(m + 4 * i, mv);
      detail::load4(v + 4 * i, vv);
#pragma unroll
      for (int k = 0; k < 4; ++k) adamw_update(pv[k], gv[k], mv[k], vv[k], c);
      detail::store4(p + 4 * i, pv);
      detail::store4(m + 4 * i, mv);
      detail::store4(v + 4 * i, vv);
    }
    scalar_from = nvec * 4;
  }
  for (std::uint64_t i = scalar_from + first; i < n; i += stride) {
    float pi = detail::load1(p + i);
    float mi = m[i];
    float vi = v[i];
    adamw_update(pi, g[i], mi, vi, c);
    detail::store1(p + i, pi);
    m[i] = mi;
    v[i] = vi;
  }
}

template <typename P>
__global__ void __launch_bounds__(detail::step_block_threads)
    adamw_step_kernel(P* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                      float* __restrict__ v, std::uint64_t n, const adamw_consts c) {
  const std::uint64_t first = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  adamw_range(p, g, m, v, n, c, first, stride);
}

template <typename P>
__global__ void __launch_bounds__(detail::foreach_block_threads)
    adamw_foreach_kernel(const adamw_args args, const adamw_consts c) {
  const int t = args.block_tensor[blockIdx.x];
  const std::uint64_t start = static_cast<std::uint64_t>(args.block_chunk[blockIdx.x]) *
                              foreach_chunk_elements;
  const std::uint64_t rest = args.sizes[t] - start;
  const std::uint64_t n = rest < foreach_chunk_elements ? rest : foreach_chunk_elements;
  P* p = static_cast<P*>(args.ptrs[0][t]) + start;
  const float* g = static_cast<const float*>(args.ptrs[1][t]) + start;
  float* m = static_cast<float*>(args.ptrs[2][t]) + start;
  float* v = static_cast<float*>(args.ptrs[3][t]) + start;
  adamw_range(p, g, m, v, n, c, threadIdx.x, blockDim.x);
}

// Validates the hyperparameters and step; fills the per-step constants.
cudaError_t make_consts(const adamw_hparams& hp, std::int64_t step, adamw_consts& c) {
  if (step < 1) return cudaErrorInvalidValue;
  if (!(hp.beta1 >= 0.f && hp.beta1 < 1.f) || !(hp.beta2 >= 0.f && hp.beta2 < 1.f)) {
    return cudaErrorInvalidValue;
  }
  const double t = static_cast<double>(step);
  c.lr = hp.lr;
  c.beta1 = hp.beta1;
  c.beta2 = hp.beta2;
  c.one_minus_beta1 = 1.0f - hp.beta1;
  c.one_minus_beta2 = 1.0f - hp.beta2;
  c.eps = hp.eps;
  c.decay = 1.0f - hp.lr * hp.weight_decay;
  c.bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(hp.beta1), t));
  c.bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(hp.beta2), t));
  return cudaSuccess;
}

template <typename P>
cudaError_t adamw_foreach_typed(const tensor_list& list, const adamw_consts& c,
                                cudaStream_t stream) {
  return detail::multi_tensor_apply<adamw_depth, adamw_max_tensors, adamw_max_blocks>(
      list,
      [](const tensor_ref& t, void*(&ptrs)[adamw_depth]) {
        ptrs[0] = t.param;
        ptrs[1] = const_cast<float*>(t.grad);
        ptrs[2] = t.exp_avg;
        ptrs[3] = t.exp_avg_sq;
      },
      [&](const adamw_args& args, int blocks) {
        adamw_foreach_kernel<P>
            <<<static_cast<unsigned>(blocks), detail::foreach_block_threads, 0, stream>>>(args, c);
        return cudaGetLastError();
      });
}

}  // namespace

std::size_t adamw_foreach_launch_count(const tensor_list& tensors) {
  std::size_t launches = 0;
  (void)detail::multi_tensor_apply<adamw_depth, adamw_max_tensors, adamw_max_blocks>(
      tensors,
      [](const tensor_ref&, void*(&ptrs)[adamw_depth]) {
        for (void*& p : ptrs) p = nullptr;
      },
      [&](const adamw_args&, int) {
        ++launches;
        return cudaSuccess;
      });
  return launches;
}

cudaError_t adamw_step(void* param, dtype param_dtype, const float* grad, float* exp_avg,
                       float* exp_avg_sq, std::size_t n, const adamw_hparams& hp, std::int64_t step,
                       cudaStream_t stream) {
  if (!detail::valid_dtype(param_dtype)) return cudaErrorInvalidValue;
  adamw_consts c{};
  if (const cudaError_t err = make_consts(hp, step, c); err != cudaSuccess) return err;
  if (n == 0) return cudaSuccess;
  if (param == nullptr || grad == nullptr || exp_avg == nullptr || exp_avg_sq == nullptr) {
    return cudaErrorInvalidValue;
  }
  const unsigned blocks = detail::step_grid(n);
  if (param_dtype == dtype::f32) {
    adamw_step_kernel<float><<<blocks, detail::step_block_threads, 0, stream>>>(
        static_cast<float*>(param), grad, exp_avg, exp_avg_sq, n, c);
  } else {
    adamw_step_kernel<bf16><<<blocks, detail::step_block_threads, 0, stream>>>(
        static_cast<bf16*>(param), grad, exp_avg, exp_avg_sq, n, c);
  }
  return cudaGetLastError();
}

cudaError_t adamw_foreach(const tensor_list& tensors, const adamw_hparams& hp, std::int64_t step,
                          cudaStream_t stream) {
  if (!detail::valid_dtype(tensors.param_dtype)) return cudaErrorInvalidValue;
  adamw_consts c{};
  if (const cudaError_t err = make_consts(hp, step, c); err != cudaSuccess) return err;
  for (const tensor_ref& t : tensors.tensors) {
    if (t.n != 0 && (t.param == nullptr || t.grad == nullptr || t.exp_avg == nullptr ||
                     t.exp_avg_sq == nullptr)) {
      return cudaErrorInvalidValue;
    }
  }
  if (tensors.param_dtype == dtype::f32) return adamw_foreach_typed<float>(tensors, c, stream);
  return adamw_foreach_typed<bf16>(tensors, c, stream);
}

}  // namespace streamsafe::kernels
