// Helper kernels for the tests and the race example: hold a stream (spin), write memory from a
// kernel (fill), read memory from a kernel (read_sum).
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "detail.cuh"
#include "streamsafe/kernels/optimizers.hpp"

namespace streamsafe::kernels {
namespace {

inline constexpr int bytes_block_threads = 256;
inline constexpr std::size_t bytes_max_blocks = 4096;

using detail::globaltimer_ns;

__global__ void spin_kernel(std::uint64_t ns) {
  const std::uint64_t start = globaltimer_ns();
  for (;;) {
    const std::uint64_t elapsed = globaltimer_ns() - start;
    if (elapsed >= ns) break;
    const std::uint64_t left = ns - elapsed;
    __nanosleep(static_cast<unsigned>(left < 1000 ? left : 1000));
  }
}

// Splits [p, p+bytes) into an unaligned head, 16-byte words, and a tail.
struct byte_split {
  std::size_t head;        // bytes before the first 16-byte boundary (at most `bytes`)
  std::size_t words;       // 16-byte words after the head
  std::size_t tail_start;  // first byte after the words
};

__device__ __forceinline__ byte_split split_bytes(const void* p, std::size_t bytes) {
  const std::uintptr_t addr = reinterpret_cast<std::uintptr_t>(p);
  std::size_t head = (16 - (addr & 15u)) & 15u;
  if (head > bytes) head = bytes;
  const std::size_t words = (bytes - head) / 16;
  return byte_split{head, words, head + words * 16};
}

__global__ void __launch_bounds__(bytes_block_threads)
    fill_kernel(unsigned char* p, std::size_t bytes, unsigned char value) {
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const byte_split s = split_bytes(p, bytes);
  if (first < s.head) p[first] = value;  // head < 16 <= threads in the grid
  const unsigned v32 = 0x01010101u * value;
  const uint4 w = make_uint4(v32, v32, v32, v32);
  uint4* body = reinterpret_cast<uint4*>(p + s.head);
  for (std::size_t i = first; i < s.words; i += stride) body[i] = w;
  for (std::size_t i = s.tail_start + first; i < bytes; i += stride) p[i] = value;
}

__device__ __forceinline__ unsigned byte_sum(unsigned x) {
  return (x & 0xffu) + ((x >> 8) & 0xffu) + ((x >> 16) & 0xffu) + (x >> 24);
}

__global__ void __launch_bounds__(bytes_block_threads)
    read_sum_kernel(const unsigned char* p, std::size_t bytes, unsigned long long* sum) {
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const byte_split s = split_bytes(p, bytes);
  unsigned long long acc = 0;
  if (first < s.head) acc += p[first];
  const uint4* body = reinterpret_cast<const uint4*>(p + s.head);
  for (std::size_t i = first; i < s.words; i += stride) {
    const uint4 w = body[i];
    acc += byte_sum(w.x) + byte_sum(w.y) + byte_sum(w.z) + byte_sum(w.w);
  }
  for (std::size_t i = s.tail_start + first; i < bytes; i += stride) acc += p[i];
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  if ((threadIdx.x & 31u) == 0 && acc != 0) atomicAdd(sum, acc);
}

unsigned bytes_grid(std::size_t bytes) {
  std::size_t blocks = (bytes / 16 + bytes_block_threads - 1) / bytes_block_threads;
  if (blocks < 1) blocks = 1;
  if (blocks > bytes_max_blocks) blocks = bytes_max_blocks;
  return static_cast<unsigned>(blocks);
}

}  // namespace

cudaError_t launch_spin(cudaStream_t stream, double milliseconds) {
  if (!(milliseconds >= 0.0 && milliseconds <= 3.6e6)) return cudaErrorInvalidValue;
  const auto ns = static_cast<std::uint64_t>(std::llround(milliseconds * 1e6));
  spin_kernel<<<1, 1, 0, stream>>>(ns);
  return cudaGetLastError();
}

cudaError_t launch_fill(void* p, std::size_t bytes, unsigned char value, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  if (p == nullptr) return cudaErrorInvalidValue;
  fill_kernel<<<bytes_grid(bytes), bytes_block_threads, 0, stream>>>(static_cast<unsigned char*>(p),
                                                                     bytes, value);
  return cudaGetLastError();
}

cudaError_t launch_read_sum(const void* p, std::size_t bytes, unsigned long long* sum,
                            cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  if (p == nullptr || sum == nullptr) return cudaErrorInvalidValue;
  read_sum_kernel<<<bytes_grid(bytes), bytes_block_threads, 0, stream>>>(
      static_cast<const unsigned char*>(p), bytes, sum);
  return cudaGetLastError();
}

}  // namespace streamsafe::kernels
