// streamsafe preload: the CUDA runtime's own entry points for the calls the preload library
// interposes, fetched with dlsym(RTLD_NEXT) on first use. Code inside libstreamsafe_preload.so
// must reach these calls only through real(): a direct call to cudaMalloc (or cudaFree,
// cudaStream*) from inside the library binds to the library's own definition and recurses.
//
// Thread safety: real() initialises once (function-local static) and is read-only afterwards.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace streamsafe::preload {

struct real_api {
  cudaError_t (*malloc)(void**, std::size_t) = nullptr;
  cudaError_t (*free)(void*) = nullptr;
  cudaError_t (*malloc_async)(void**, std::size_t, cudaStream_t) = nullptr;
  cudaError_t (*free_async)(void*, cudaStream_t) = nullptr;
  cudaError_t (*malloc_async_ptsz)(void**, std::size_t, cudaStream_t) = nullptr;
  cudaError_t (*free_async_ptsz)(void*, cudaStream_t) = nullptr;
  cudaError_t (*stream_create)(cudaStream_t*) = nullptr;
  cudaError_t (*stream_create_with_flags)(cudaStream_t*, unsigned int) = nullptr;
  cudaError_t (*stream_create_with_priority)(cudaStream_t*, unsigned int, int) = nullptr;
  cudaError_t (*stream_destroy)(cudaStream_t) = nullptr;
};

// Aborts with a message naming the symbol when the runtime does not provide one (the program
// does not use the shared CUDA runtime, libcudart.so).
const real_api& real();

}  // namespace streamsafe::preload
