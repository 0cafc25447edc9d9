// streamsafe: libstreamsafe_torch.so, the allocator functions PyTorch's
// torch.cuda.memory.CUDAPluggableAllocator loads, plus ctypes-callable extras.
//
//   alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "streamsafe_torch_alloc",
//                                                    "streamsafe_torch_free")
//   torch.cuda.memory.change_current_allocator(alloc)    # before any CUDA allocation
//   lib = ctypes.CDLL(path)                              # the same copy of the library
//   lib.streamsafe_torch_empty_cache()                   # torch.cuda.empty_cache() does not reach it
//
// Signatures: PyTorch calls alloc(size, device, stream) and free(ptr, size, device, stream)
// with `stream` the stream of the allocation (CUDAPluggableAllocator keeps it per pointer), so
// the free is a host free: the last use is on the allocation stream or on streams recorded with
// streamsafe_torch_record_stream (Tensor.record_stream does not reach a pluggable allocator).
// A request of 0 bytes gets a 512-byte block (PyTorch keys its metadata by pointer). Out of
// memory: the message is logged and std::bad_alloc thrown to PyTorch (Python: MemoryError);
// any other failure (no such device, a CUDA error) throws std::runtime_error with the message
// (Python: RuntimeError). Never a null pointer. The process allocator reads STREAMSAFE_ALLOC_CONF once.
//
// Thread safety: every function may be called from any thread; the last-error text is per thread.
#include "core/logging.hpp"

#include <streamsafe/core/errors.hpp>
#include <streamsafe/frontends/allocator.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#define STREAMSAFE_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using streamsafe::cuda::allocator;

thread_local std::string last_error;

void note_error(const char* call, const std::exception& e) noexcept {
  try {
    last_error = std::string(call) + ": " + e.what();
    streamsafe::detail::log().error("{}", last_error);
  } catch (...) {
  }
}

cudaStream_t to_stream(void* stream) noexcept { return static_cast<cudaStream_t>(stream); }

int copy_out(const std::string& text, char* buf, std::size_t len) noexcept {
  if (buf && len > 0) {
    const std::size_t n = std::min(len - 1, text.size());
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
  return static_cast<int>(text.size());
}

}  // namespace

STREAMSAFE_EXPORT void* streamsafe_torch_alloc(size_t size, int device, void* stream) {
  try {
    return allocator::instance().allocate(size == 0 ? 1 : size, device, to_stream(stream));
  } catch (const std::bad_alloc& e) {
    note_error("streamsafe_torch_alloc", e);
    throw std::bad_alloc();
  } catch (const std::exception& e) {
    note_error("streamsafe_torch_alloc", e);
    throw std::runtime_error(last_error);
  }
}

STREAMSAFE_EXPORT void streamsafe_torch_free(void* ptr, size_t /*size*/, int /*device*/, void* /*stream*/) {
  if (!ptr) return;
  try {
    allocator::instance().deallocate(ptr);  // routed to the owning device
  } catch (const std::exception& e) {
    note_error("streamsafe_torch_free", e);
  }
}

// Records a use of the block at ptr on `stream` (a cudaStream_t, e.g. torch Stream.cuda_stream).
// Returns 0, or -1 with streamsafe_torch_last_error() set.
STREAMSAFE_EXPORT int streamsafe_torch_record_stream(void* ptr, void* stream) {
  try {
    allocator::instance().record_stream(ptr, to_stream(stream));
    return 0;
  } catch (const std::exception& e) {
    note_error("streamsafe_torch_record_stream", e);
    return -1;
  }
}

// Releases cached memory of every device behind release fences; returns the bytes released.
STREAMSAFE_EXPORT size_t streamsafe_torch_empty_cache(void) {
  try {
    return allocator::instance().empty_cache();
  } catch (const std::exception& e) {
    note_error("streamsafe_torch_empty_cache", e);
    return 0;
  }
}

// Finishes deferred releases whose fences completed; never blocks. Returns bytes released.
STREAMSAFE_EXPORT size_t streamsafe_torch_reclaim(void) {
  try {
    return allocator::instance().reclaim();
  } catch (const std::exception& e) {
    note_error("streamsafe_torch_reclaim", e);
    return 0;
  }
}

// The device's statistics as one JSON object (PyTorch's key names for the shared ones) into buf,
// NUL-terminated and truncated to len; returns the length of the whole text, -1 on error.
STREAMSAFE_EXPORT int streamsafe_torch_stats_json(int device, char* buf, size_t len) {
  try {
    allocator& a = allocator::instance();
    const streamsafe::statistics s = a.stats(device);
    const streamsafe::caching_allocator* d = a.find_device_allocator(device);
    char text[2048];
    std::snprintf(
        text, sizeof text,
        "{\"device\": %d, \"allocated_bytes.all.current\": %lld, \"allocated_bytes.all.peak\": %lld, "
        "\"reserved_bytes.all.current\": %lld, \"reserved_bytes.all.peak\": %lld, "
        "\"active_bytes.all.current\": %lld, \"active_bytes.all.peak\": %lld, "
        "\"inactive_split_bytes.all.current\": %lld, \"requested_bytes.all.peak\": %lld, "
        "\"segment.all.current\": %lld, \"allocation.all.current\": %lld, \"num_alloc_retries\": %llu, "
        "\"num_ooms\": %llu, \"num_device_alloc\": %llu, \"num_device_free\": %llu, "
        "\"num_sync_all_streams\": %llu, \"events_recorded\": %llu, \"stream_waits\": %llu, "
        "\"fence_waits\": %llu, \"fence_wait_ns\": %llu, \"releases_deferred\": %llu, \"bytes_released\": %llu, "
        "\"pending_release_bytes\": %llu}",
        device, static_cast<long long>(s.allocated_bytes.current), static_cast<long long>(s.allocated_bytes.peak),
        static_cast<long long>(s.reserved_bytes.current), static_cast<long long>(s.reserved_bytes.peak),
        static_cast<long long>(s.active_bytes.current), static_cast<long long>(s.active_bytes.peak),
        static_cast<long long>(s.inactive_split_bytes.current), static_cast<long long>(s.requested_bytes.peak),
        static_cast<long long>(s.segment.current), static_cast<long long>(s.allocation.current),
        static_cast<unsigned long long>(s.num_alloc_retries), static_cast<unsigned long long>(s.num_ooms),
        static_cast<unsigned long long>(s.num_device_alloc), static_cast<unsigned long long>(s.num_device_free),
        static_cast<unsigned long long>(s.num_sync_all_streams), static_cast<unsigned long long>(s.events_recorded),
        static_cast<unsigned long long>(s.stream_waits), static_cast<unsigned long long>(s.fence_waits),
        static_cast<unsigned long long>(s.fence_wait_ns), static_cast<unsigned long long>(s.releases_deferred),
        static_cast<unsigned long long>(s.bytes_released),
        static_cast<unsigned long long>(d ? d->pending_release_bytes() : 0));
    return copy_out(text, buf, len);
  } catch (const std::exception& e) {
    note_error("streamsafe_torch_stats_json", e);
    return -1;
  }
}

// Resets the peaks of the device's statistics. Returns 0, or -1 (bad device).
STREAMSAFE_EXPORT int streamsafe_torch_reset_peak_stats(int device) {
  try {
    allocator& a = allocator::instance();
    (void)a.stats(device);  // validates the index
    if (streamsafe::caching_allocator* d = a.find_device_allocator(device)) d->reset_peak_stats();
    return 0;
  } catch (const std::exception& e) {
    note_error("streamsafe_torch_reset_peak_stats", e);
    return -1;
  }
}

// The calling thread's message for its last failed call ("" when none).
STREAMSAFE_EXPORT const char* streamsafe_torch_last_error(void) { return last_error.c_str(); }
