// streamsafe preload: libstreamsafe_preload.so, a cudaMalloc interposer for programs linked
// against the shared CUDA runtime (LD_PRELOAD=libstreamsafe_preload.so program ...).
//
// Interposed: cudaMalloc, cudaFree, cudaMallocAsync, cudaFreeAsync (and their _ptsz forms for
// code built with --default-stream per-thread), cudaStreamCreate, cudaStreamCreateWithFlags,
// cudaStreamCreateWithPriority, cudaStreamDestroy. Everything else (cudaMallocPitch,
// cudaMalloc3D, cudaMallocManaged, cudaMallocHost, pools, ...) reaches the runtime untouched;
// cudaFree and cudaFreeAsync pass pointers streamsafe did not hand out to the real calls.
//
// Contracts kept:
//  * cudaMalloc memory is usable at once by any stream: it is served from a private
//    non-blocking stream's pool per device, only from memory that no stream can still touch
//    (when the caching allocator reuses a block behind a stream wait on that private stream,
//    the stream is synchronised before cudaMalloc returns).
//  * cudaFree(p): p is not handed out again until all work enqueued before the free, on every
//    stream of the device, has completed. Frees are queued in the device's open batch; a batch
//    is closed by one fence, an event per stream (the legacy default stream, which every
//    blocking stream, per-thread default streams included, is ordered with, plus every
//    non-blocking stream the interposer knows), never one per free. A closed batch's pointers go
//    back to the caching allocator (host free: idle memory) once all its events completed.
//    Batches are closed at the next allocation on the device while fewer than
//    k_batches_in_flight are pending, and at every cudaStreamDestroy. Unlike the real cudaFree,
//    the call does not synchronise the device.
//  * cudaMallocAsync / cudaFreeAsync are stream-ordered (the caching allocator's allocate /
//    stream-ordered free). On a stream that is capturing a CUDA graph they go to the runtime.
// Out of memory: the device's batches are closed and waited for (host wait on exactly their
// events), the caching allocator releases its cache safely and retries; if it still fails the
// REAL call is made, whose result (a foreign pointer, or the runtime's error) is returned.
//
// Configuration: STREAMSAFE_ALLOC_CONF (the allocator's options), STREAMSAFE_PRELOAD=0 (pass
// everything through), STREAMSAFE_LOG_LEVEL=info (a statistics summary at exit).
// Thread safety and lock order: interposer.hpp.
#include "interposer.hpp"
#include "real_cuda.hpp"

#include <streamsafe/backends/gpu.hpp>
#include <streamsafe/core/errors.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstring>
#include <string>

#define STREAMSAFE_EXPORT extern "C" __attribute__((visibility("default")))

// Declared by cuda_runtime_api.h only for per-thread-default-stream builds.
extern "C" cudaError_t cudaMallocAsync_ptsz(void** ptr, size_t size, cudaStream_t stream);
extern "C" cudaError_t cudaFreeAsync_ptsz(void* ptr, cudaStream_t stream);

namespace streamsafe::preload {
namespace {

// The device of an allocation stream: the current device for the special handles.
bool stream_device(interposer& ip, cudaStream_t stream, int& device) {
  if (special(stream)) return cudaGetDevice(&device) == cudaSuccess;
  stream_info info;
  if (!ip.learn(stream, info)) return false;
  device = info.device;
  return true;
}

bool capturing(cudaStream_t stream) noexcept {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

// Allocation through the caching allocator with the out-of-memory path; nullptr when the
// caching allocator cannot serve it (the caller then makes the real call).
void* serve(interposer& ip, int device, std::size_t size, cudaStream_t stream) {
  cuda::allocator& a = ip.alloc();
  if (device < 0 || device >= std::min(a.device_count(), k_max_devices)) return nullptr;
  ip.prepare(device);
  try {
    return a.allocate(size, device, stream);
  } catch (const out_of_memory&) {
    ip.flush(device);
  } catch (const std::exception& e) {
    ip.slot(device).count.errors++;
    detail::log().error("preload: allocation of {} bytes on device {}: {}", size, device, e.what());
    return nullptr;
  }
  try {
    return a.allocate(size, device, stream);
  } catch (const std::exception& e) {
    detail::log().warn("preload: {}; trying the CUDA runtime", e.what());
    return nullptr;
  }
}

cudaError_t malloc_async_impl(void** ptr, std::size_t size, cudaStream_t stream, bool ptsz) {
  const real_api& r = real();
  auto pass = [&] {
    auto f = ptsz && r.malloc_async_ptsz ? r.malloc_async_ptsz : r.malloc_async;
    if (ptsz && !r.malloc_async_ptsz && stream == nullptr) stream = cudaStreamPerThread;
    return f(ptr, size, stream);
  };
  interposer& ip = interposer::get();
  if (!ip.enabled() || !ptr || size == 0 || capturing(stream)) return pass();
  if (ptsz && stream == nullptr) stream = cudaStreamPerThread;
  int device = -1;
  try {
    if (!stream_device(ip, stream, device)) return pass();
    void* p = serve(ip, device, size, stream);
    if (!p) {
      ip.slot(device).count.passthrough_allocs++;
      return pass();
    }
    ip.slot(device).count.malloc_asyncs++;
    *ptr = p;
    return cudaSuccess;
  } catch (const std::exception& e) {
    detail::log().error("preload: cudaMallocAsync: {}", e.what());
    return pass();
  }
}

cudaError_t free_async_impl(void* ptr, cudaStream_t stream, bool ptsz) {
  const real_api& r = real();
  auto pass = [&] {
    auto f = ptsz && r.free_async_ptsz ? r.free_async_ptsz : r.free_async;
    if (ptsz && !r.free_async_ptsz && stream == nullptr) stream = cudaStreamPerThread;
    return f(ptr, stream);
  };
  interposer& ip = interposer::get();
  if (!ip.enabled() || !ptr) return pass();
  cuda::allocator& a = ip.alloc();
  const int owner = a.owner_device(ptr);
  if (owner < 0 || owner >= k_max_devices) {
    if (owner < 0) {
      int device = 0;
      if (cudaGetDevice(&device) == cudaSuccess && device < k_max_devices)
        ip.slot(device).count.passthrough_frees++;
    }
    return pass();
  }
  if (ptsz && stream == nullptr) stream = cudaStreamPerThread;
  device_slot& slot = ip.slot(owner);
  if (capturing(stream)) {
    detail::log().error(
        "preload: cudaFreeAsync of a streamsafe block on a capturing stream is not supported");
    return cudaErrorStreamCaptureUnsupported;
  }
  stream_info info;
  (void)ip.learn(stream, info);
  std::lock_guard<std::mutex> lk(slot.mutex);
  if (slot.queued.count(ptr)) return cudaErrorInvalidValue;  // already freed by cudaFree
  try {
    a.deallocate(ptr, stream);
  } catch (const invalid_pointer& e) {
    detail::log().debug("preload: cudaFreeAsync: {}", e.what());
    return cudaErrorInvalidValue;
  } catch (const std::exception& e) {
    slot.count.errors++;
    detail::log().error("preload: cudaFreeAsync: {}", e.what());
    return cudaErrorUnknown;
  }
  slot.count.free_asyncs++;
  return cudaSuccess;
}

}  // namespace
}  // namespace streamsafe::preload

using streamsafe::preload::interposer;
using streamsafe::preload::real;

STREAMSAFE_EXPORT cudaError_t cudaMalloc(void** devPtr, size_t size) {
  interposer& ip = interposer::get();
  if (!ip.enabled() || !devPtr || size == 0) return real().malloc(devPtr, size);
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess || device >= streamsafe::preload::k_max_devices)
    return real().malloc(devPtr, size);
  try {
    // The device's allocator, and with its backend the private stream cudaMalloc is served on.
    streamsafe::cuda::allocator& a = ip.alloc();
    (void)a.device_allocator(device);
    streamsafe::preload::device_slot& slot = ip.slot(device);
    const cudaStream_t private_stream = slot.private_stream.load();
    (void)streamsafe::preload::watching_backend::take_wait_note();
    void* p = streamsafe::preload::serve(ip, device, size, private_stream);
    if (!p) {
      slot.count.passthrough_allocs++;
      return real().malloc(devPtr, size);
    }
    if (streamsafe::preload::watching_backend::take_wait_note()) {
      // Reused behind a stream wait on the private stream: idle for every stream once it ran.
      slot.count.private_syncs++;
      const cudaError_t e = cudaStreamSynchronize(private_stream);
      if (e != cudaSuccess) {
        a.deallocate(p, private_stream);
        return e;
      }
    }
    slot.count.mallocs++;
    *devPtr = p;
    return cudaSuccess;
  } catch (const std::exception& e) {
    streamsafe::detail::log().error("preload: cudaMalloc: {}", e.what());
    return real().malloc(devPtr, size);
  }
}

STREAMSAFE_EXPORT cudaError_t cudaFree(void* devPtr) {
  interposer& ip = interposer::get();
  if (!devPtr || !ip.enabled()) return real().free(devPtr);  // cudaFree(0) initialises the context
  try {
    streamsafe::cuda::allocator& a = ip.alloc();
    const int owner = a.owner_device(devPtr);
    if (owner < 0 || owner >= streamsafe::preload::k_max_devices) {
      int device = 0;
      if (owner < 0 && cudaGetDevice(&device) == cudaSuccess &&
          device < streamsafe::preload::k_max_devices) {
        ip.slot(device).count.passthrough_frees++;
      }
      return real().free(devPtr);
    }
    streamsafe::preload::device_slot& slot = ip.slot(owner);
    std::lock_guard<std::mutex> lk(slot.mutex);
    // Checked again under the slot's lock: batches go back to the allocator under it.
    const streamsafe::caching_allocator* d = a.find_device_allocator(owner);
    if (!d || d->find_block(devPtr).address == 0 || slot.queued.count(devPtr))
      return cudaErrorInvalidValue;
    slot.queued.insert(devPtr);
    slot.open.push_back(devPtr);
    slot.count.frees++;
    return cudaSuccess;
  } catch (const std::exception& e) {
    streamsafe::detail::log().error("preload: cudaFree: {}", e.what());
    return cudaErrorUnknown;
  }
}

STREAMSAFE_EXPORT cudaError_t cudaMallocAsync(void** devPtr, size_t size, cudaStream_t stream) {
  return streamsafe::preload::malloc_async_impl(devPtr, size, stream, false);
}

STREAMSAFE_EXPORT cudaError_t cudaFreeAsync(void* devPtr, cudaStream_t stream) {
  return streamsafe::preload::free_async_impl(devPtr, stream, false);
}

STREAMSAFE_EXPORT cudaError_t cudaMallocAsync_ptsz(void** devPtr, size_t size,
                                                   cudaStream_t stream) {
  return streamsafe::preload::malloc_async_impl(devPtr, size, stream, true);
}

STREAMSAFE_EXPORT cudaError_t cudaFreeAsync_ptsz(void* devPtr, cudaStream_t stream) {
  return streamsafe::preload::free_async_impl(devPtr, stream, true);
}

STREAMSAFE_EXPORT cudaError_t cudaStreamCreate(cudaStream_t* pStream) {
  const cudaError_t e = real().stream_create(pStream);
  if (e == cudaSuccess && interposer::get().enabled())
    interposer::get().note_created(*pStream, cudaStreamDefault);
  return e;
}

STREAMSAFE_EXPORT cudaError_t cudaStreamCreateWithFlags(cudaStream_t* pStream, unsigned int flags) {
  const cudaError_t e = real().stream_create_with_flags(pStream, flags);
  if (e == cudaSuccess && interposer::get().enabled())
    interposer::get().note_created(*pStream, flags);
  return e;
}

STREAMSAFE_EXPORT cudaError_t cudaStreamCreateWithPriority(cudaStream_t* pStream,
                                                           unsigned int flags, int priority) {
  const cudaError_t e = real().stream_create_with_priority(pStream, flags, priority);
  if (e == cudaSuccess && interposer::get().enabled())
    interposer::get().note_created(*pStream, flags);
  return e;
}

STREAMSAFE_EXPORT cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  interposer& ip = interposer::get();
  if (ip.enabled() && !streamsafe::cuda::is_special_stream(stream)) {
    int device = -1;
    if (cudaStreamGetDevice(stream, &device) == cudaSuccess && device >= 0 &&
        device < streamsafe::preload::k_max_devices) {
      try {
        streamsafe::cuda::allocator& a = ip.alloc();
        if (a.find_device_allocator(device)) {
          streamsafe::preload::device_slot& slot = ip.slot(device);
          {
            // Frees queued before this point may have work on this stream: fence it now.
            std::lock_guard<std::mutex> lk(slot.mutex);
            ip.close_open_locked(device, slot, stream);
          }
          a.notify_stream_destroyed(stream, device);
        }
      } catch (const std::exception& e) {
        streamsafe::detail::log().error("preload: cudaStreamDestroy: {}", e.what());
      }
    } else {
      (void)cudaGetLastError();
    }
    ip.forget(stream);
  }
  return real().stream_destroy(stream);
}

// ---- queries for programs that know they run under the preload (ctypes, dlsym) --------------

// Writes the device's statistics as one JSON object into buf (NUL-terminated, truncated to
// len); returns the length the whole text needs, or -1 for a device that does not exist.
STREAMSAFE_EXPORT int streamsafe_preload_stats_json(int device, char* buf, size_t len) {
  try {
    interposer& ip = interposer::get();
    if (device < 0 ||
        device >= std::min(ip.alloc().device_count(), streamsafe::preload::k_max_devices))
      return -1;
    const std::string text = ip.stats_json(device);
    if (buf && len > 0) {
      const std::size_t n = std::min(len - 1, text.size());
      std::memcpy(buf, text.data(), n);
      buf[n] = '\0';
    }
    return static_cast<int>(text.size());
  } catch (...) {
    return -1;
  }
}

// Waits for every queued cudaFree's fence, then releases streamsafe's cache on every device;
// returns the bytes given back to the driver (0 on error).
STREAMSAFE_EXPORT size_t streamsafe_preload_empty_cache(void) {
  try {
    return interposer::get().empty_cache();
  } catch (const std::exception& e) {
    streamsafe::detail::log().error("preload: empty_cache: {}", e.what());
    return 0;
  }
}

// 1 when the interposer serves allocations (STREAMSAFE_PRELOAD is not 0), else 0.
STREAMSAFE_EXPORT int streamsafe_preload_active(void) {
  return interposer::get().enabled() ? 1 : 0;
}
