// SignSGD with decoupled weight decay: p <- p * decay - lr * sign(g), decay = 1 - lr*wd.
#include <cstddef>
#include <cstdint>

#include "detail.cuh"
#include "streamsafe/kernels/optimizers.hpp"

namespace streamsafe::kernels {
namespace {

using detail::bf16;

inline constexpr int signsgd_depth = 2;  // param, grad
inline constexpr int signsgd_max_tensors = static_cast<int>(signsgd_foreach_max_tensors_per_launch);
inline constexpr int signsgd_max_blocks = static_cast<int>(foreach_max_chunks_per_launch);
using signsgd_args = detail::foreach_args<signsgd_depth, signsgd_max_tensors, signsgd_max_blocks>;
static_assert(sizeof(signsgd_args) + 2 * sizeof(float) <= 4096, "kernel arguments over 4 KiB");

// sign(+-0) = 0, NaN propagates. Explicit _rn operations: no FMA contraction, so the result is
// the plain IEEE float evaluation of p*decay - lr*s.
__device__ __forceinline__ float signsgd_update(float p, float g, float decay, float lr) {
  const float s = g > 0.f ? 1.f : (g < 0.f ? -1.f : (g == 0.f ? 0.f : g));
  return __fsub_rn(__fmul_rn(p, decay), __fmul_rn(lr, s));
}

// Elements [0, n) of p/g, this thread taking first, first + stride, ... (in 4-element groups
// where every pointer is aligned for it).
template <typename P>
__device__ __forceinline__ void signsgd_range(P* __restrict__ p, const float* __restrict__ g,
                                              std::uint64_t n, float decay, float lr,
                                              std::uint64_t first, std::uint64_t stride) {
  std::uint64_t scalar_from = 0;
  if (detail::vec4_aligned(p) && detail::vec4_aligned(g)) {
    const std::uint64_t nvec = n / 4;
    for (std::uint64_t i = first; i < nvec; i += stride) {
      float pv[4];
      float gv[4];
      detail::load4(p + 4 * i, pv);
      detail::load4(g + 4 * i, gv);
#pragma unroll
      for (int k = 0; k < 4; ++k) pv[k] = signsgd_update(pv[k], gv[k], decay, lr);
      detail::store4(p + 4 * i, pv);
    }
    scalar_from = nvec * 4;
  }
  for (std::uint64_t i = scalar_from + first; i < n; i += stride) {
    detail::store1(p + i, signsgd_update(detail::load1(p + i), g[i], decay, lr));
  }
}

template <typename P>
__global__ void __launch_bounds__(detail::step_block_threads)
    signsgd_step_kernel(P* __restrict__ p, const float* __restrict__ g, std::uint64_t n,
                        float decay, float lr) {
  const std::uint64_t first = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  signsgd_range(p, g, n, decay, lr, first, stride);
}

template <typename P>
__global__ void __launch_bounds__(detail::foreach_block_threads)
    signsgd_foreach_kernel(const signsgd_args args, float decay, float lr) {
  const int t = args.block_tensor[blockIdx.x];
  const std::uint64_t start = static_cast<std::uint64_t>(args.block_chunk[blockIdx.x]) *
                              foreach_chunk_elements;
  const std::uint64_t rest = args.sizes[t] - start;
  const std::uint64_t n = rest < foreach_chunk_elements ? rest : foreach_chunk_elements;
  P* p = static_cast<P*>(args.ptrs[0][t]) + start;
  const float* g = static_cast<const float*>(args.ptrs[1][t]) + start;
  signsgd_range(p, g, n, decay, lr, threadIdx.x, blockDim.x);
}

template <typename P>
cudaError_t signsgd_foreach_typed(const tensor_list& list, float decay, float lr,
                                  cudaStream_t stream) {
  return detail::multi_tensor_apply<signsgd_depth, signsgd_max_tensors, signsgd_max_blocks>(
      list,
      [](const tensor_ref& t, void*(&ptrs)[signsgd_depth]) {
        ptrs[0] = t.param;
        ptrs[1] = const_cast<float*>(t.grad);
      },
      [&](const signsgd_args& args, int blocks) {
        signsgd_foreach_kernel<P>
            <<<static_cast<unsigned>(blocks), detail::foreach_block_threads, 0, stream>>>(
                args, decay, lr);
        return cudaGetLastError();
      });
}

cudaError_t check_list(const tensor_list& list) {
  if (!detail::valid_dtype(list.param_dtype)) return cudaErrorInvalidValue;
  for (const tensor_ref& t : list.tensors) {
    if (t.n != 0 && (t.param == nullptr || t.grad == nullptr)) return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

}  // namespace

std::size_t signsgd_foreach_launch_count(const tensor_list& tensors) {
  std::size_t launches = 0;
  (void)detail::multi_tensor_apply<signsgd_depth, signsgd_max_tensors, signsgd_max_blocks>(
      tensors, [](const tensor_ref&, void*(&ptrs)[signsgd_depth]) { ptrs[0] = ptrs[1] = nullptr; },
      [&](const signsgd_args&, int) {
        ++launches;
        return cudaSuccess;
      });
  return launches;
}

cudaError_t signsgd_step(void* param, dtype param_dtype, const float* grad, std::size_t n, float lr,
                         float weight_decay, cudaStream_t stream) {
  if (!detail::valid_dtype(param_dtype)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (param == nullptr || grad == nullptr) return cudaErrorInvalidValue;
  const float decay = 1.0f - lr * weight_decay;
  const unsigned blocks = detail::step_grid(n);
  if (param_dtype == dtype::f32) {
    signsgd_step_kernel<float><<<blocks, detail::step_block_threads, 0, stream>>>(
        static_cast<float*>(param), grad, n, decay, lr);
  } else {
    signsgd_step_kernel<bf16><<<blocks, detail::step_block_threads, 0, stream>>>(
        static_cast<bf16*>(param), grad, n, decay, lr);
  }
  return cudaGetLastError();
}

cudaError_t signsgd_foreach(const tensor_list& tensors, float lr, float weight_decay,
                            cudaStream_t stream) {
  if (const cudaError_t err = check_list(tensors); err != cudaSuccess) return err;
  const float decay = 1.0f - lr * weight_decay;
  if (tensors.param_dtype == dtype::f32) {
    return signsgd_foreach_typed<float>(tensors, decay, lr, stream);
  }
  return signsgd_foreach_typed<bf16>(tensors, decay, lr, stream);
}

}  // namespace streamsafe::kernels
