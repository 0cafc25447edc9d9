// streamsafe preload: the real CUDA runtime entry points (see real_cuda.hpp).
#include "real_cuda.hpp"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

namespace streamsafe::preload {
namespace {

template <class F>
void fetch(F& into, const char* name, bool required) {
  void* symbol = dlsym(RTLD_NEXT, name);
  if (!symbol && required) {
    std::fprintf(
        stderr,
        "streamsafe preload: the CUDA runtime's %s was not found (%s); the program must use "
        "the shared CUDA runtime (nvcc -cudart shared)\n",
        name, dlerror());
    std::abort();
  }
  into = reinterpret_cast<F>(symbol);
}

}  // namespace

const real_api& real() {
  static const real_api api = [] {
    real_api a;
    fetch(a.malloc, "cudaMalloc", true);
    fetch(a.free, "cudaFree", true);
    fetch(a.malloc_async, "cudaMallocAsync", true);
    fetch(a.free_async, "cudaFreeAsync", true);
    fetch(a.malloc_async_ptsz, "cudaMallocAsync_ptsz", false);
    fetch(a.free_async_ptsz, "cudaFreeAsync_ptsz", false);
    fetch(a.stream_create, "cudaStreamCreate", true);
    fetch(a.stream_create_with_flags, "cudaStreamCreateWithFlags", true);
    fetch(a.stream_create_with_priority, "cudaStreamCreateWithPriority", true);
    fetch(a.stream_destroy, "cudaStreamDestroy", true);
    return a;
  }();
  return api;
}

}  // namespace streamsafe::preload
