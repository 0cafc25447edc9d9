// Internal to streamsafe_kernels: the global timer, element access (fp32 / bf16, scalar and
// 4-wide), argument checks, and the host side of the foreach chunking (multi-tensor apply).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "streamsafe/kernels/optimizers.hpp"

namespace streamsafe::kernels::detail {

using bf16 = __nv_bfloat16;

// The GPU's global timer, in nanoseconds (for bounded spins).
__device__ __forceinline__ std::uint64_t globaltimer_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---- element access ---------------------------------------------------------------------------

__device__ __forceinline__ float load1(const float* p) { return *p; }
__device__ __forceinline__ float load1(const bf16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store1(float* p, float x) { *p = x; }
__device__ __forceinline__ void store1(bf16* p, float x) { *p = __float2bfloat16_rn(x); }

// 4 consecutive elements; p must be aligned to 4 elements (16 B for float, 8 B for bf16).
__device__ __forceinline__ void load4(const float* p, float (&x)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  x[0] = v.x;
  x[1] = v.y;
  x[2] = v.z;
  x[3] = v.w;
}
__device__ __forceinline__ void store4(float* p, const float (&x)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
}
__device__ __forceinline__ void load4(const bf16* p, float (&x)[4]) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  x[0] = __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(v.x & 0xffffu)));
  x[1] = __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(v.x >> 16)));
  x[2] = __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(v.y & 0xffffu)));
  x[3] = __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(v.y >> 16)));
}
__device__ __forceinline__ void store4(bf16* p, const float (&x)[4]) {
  const unsigned b0 = __bfloat16_as_ushort(__float2bfloat16_rn(x[0]));
  const unsigned b1 = __bfloat16_as_ushort(__float2bfloat16_rn(x[1]));
  const unsigned b2 = __bfloat16_as_ushort(__float2bfloat16_rn(x[2]));
  const unsigned b3 = __bfloat16_as_ushort(__float2bfloat16_rn(x[3]));
  *reinterpret_cast<uint2*>(p) = make_uint2(b0 | (b1 << 16), b2 | (b3 << 16));
}

template <typename T>
__device__ __forceinline__ bool vec4_aligned(const T* p) {
  return reinterpret_cast<std::uintptr_t>(p) % (4 * sizeof(T)) == 0;
}

// ---- launch geometry --------------------------------------------------------------------------

inline constexpr int step_block_threads = 256;     // per-parameter kernels (grid-stride)
inline constexpr unsigned step_max_blocks = 8192;  // grid-stride beyond this
inline constexpr int foreach_block_threads = 512;  // one block per (tensor, chunk)

// Grid for a grid-stride kernel over n elements processed 4 at a time where aligned.
inline unsigned step_grid(std::size_t n) {
  const std::size_t items = (n + 3) / 4;
  std::size_t blocks = (items + step_block_threads - 1) / step_block_threads;
  if (blocks < 1) blocks = 1;
  if (blocks > step_max_blocks) blocks = step_max_blocks;
  return static_cast<unsigned>(blocks);
}

inline bool valid_dtype(dtype d) { return d == dtype::f32 || d == dtype::bf16; }

// ---- multi-tensor apply (host side) -----------------------------------------------------------
//
// Kernel-argument metadata for one foreach launch: the pointers (Depth per tensor) and sizes of up
// to MaxTensors tensors, and for each block the (tensor slot, chunk index) it processes. Passed by
// value as a kernel argument, so it must stay within the classic 4 KiB kernel-parameter limit.
template <int Depth, int MaxTensors, int MaxBlocks>
struct foreach_args {
  void* ptrs[Depth][MaxTensors];
  std::uint64_t sizes[MaxTensors];
  std::uint32_t block_chunk[MaxBlocks];
  std::uint8_t block_tensor[MaxBlocks];
};

// Walks the non-empty tensors, packing (tensor, chunk) pairs into Args; calls launch(args, blocks)
// whenever the tensor slots or the block slots are full, and once at the end. A tensor whose chunks
// do not all fit is carried over into slot 0 of the next launch. Returns the first launch error.
// With Launch returning cudaSuccess without launching, this also counts launches.
template <int Depth, int MaxTensors, int MaxBlocks, typename Pointers, typename Launch>
cudaError_t multi_tensor_apply(const tensor_list& list, Pointers&& pointers, Launch&& launch) {
  static_assert(MaxTensors <= 256, "block_tensor is 8 bits");
  foreach_args<Depth, MaxTensors, MaxBlocks> args{};
  int ntensors = 0;
  int nblocks = 0;
  for (const tensor_ref& t : list.tensors) {
    if (t.n == 0) continue;
    void* p[Depth];
    pointers(t, p);
    for (int d = 0; d < Depth; ++d) args.ptrs[d][ntensors] = p[d];
    args.sizes[ntensors] = t.n;
    ++ntensors;
    const std::size_t nchunks = (t.n + foreach_chunk_elements - 1) / foreach_chunk_elements;
    for (std::size_t c = 0; c < nchunks; ++c) {
      args.block_tensor[nblocks] = static_cast<std::uint8_t>(ntensors - 1);
      args.block_chunk[nblocks] = static_cast<std::uint32_t>(c);
      ++nblocks;
      const bool last_chunk = c + 1 == nchunks;
      const bool tensors_full = ntensors == MaxTensors && last_chunk;
      const bool blocks_full = nblocks == MaxBlocks;
      if (tensors_full || blocks_full) {
        const cudaError_t err = launch(args, nblocks);
        if (err != cudaSuccess) return err;
        nblocks = 0;
        if (last_chunk) {
          ntensors = 0;
        } else {  // the rest of this tensor's chunks go with the next launch
          for (int d = 0; d < Depth; ++d) args.ptrs[d][0] = args.ptrs[d][ntensors - 1];
          args.sizes[0] = args.sizes[ntensors - 1];
          ntensors = 1;
        }
      }
    }
  }
  if (nblocks > 0) return launch(args, nblocks);
  return cudaSuccess;
}

}  // namespace streamsafe::kernels::detail
