// streamsafe: libstreamsafe_torch.so, the allocator functions PyTorch's
// torch.cuda.memory.CUDAPluggableAllocator loads, plus ctypes-callable extras.
//
//   alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "streamsafe_torch_alloc",
//                                                    "streamsafe_torch_free")
//   torch.cuda.memory.change_current_allocator(alloc)    # before any CUDA allocation
//   lib = ctypes.CDLL(path)                              # the same copy of the library
//   lib.streamsafe_torch_empty_cache()
// streamsafe.torch.install_pluggable() also wires the hooks of alloc._allocator (set_reset_fn,
// set_record_stream_fn, ..., the CUDA graph pool hooks; end of this file), so that
// torch.cuda.empty_cache() and Tensor.record_stream reach streamsafe.
//
// Signatures: PyTorch calls alloc(size, device, stream) and free(ptr, size, device, stream)
// with `stream` the stream of the allocation (CUDAPluggableAllocator keeps it per pointer), so
// the free is a host free: the last use is on the allocation stream or on streams recorded with
// streamsafe_torch_record_stream (or Tensor.record_stream once set_record_stream_fn is wired).
// A request of 0 bytes gets a 512-byte block (PyTorch keys its metadata by pointer). Out of
// memory: the message is logged and std::bad_alloc thrown to PyTorch (Python: MemoryError);
// any other failure (no such device, a CUDA error) throws std::runtime_error with the message
// (Python: RuntimeError). Never a null pointer. The process allocator reads STREAMSAFE_ALLOC_CONF
// once.
//
// Thread safety: every function may be called from any thread; the last-error text is per thread.
#include "core/common/format.hpp"
#include "core/common/logging.hpp"

#include <streamsafe/core/errors.hpp>
#include <streamsafe/core/snapshot.hpp>
#include <streamsafe/frontends/allocator.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

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

}  // namespace

namespace streamsafe_torch_detail {
void route_capture(int device, cudaStream_t stream);
extern std::atomic<int>& captures_announced_ref();
}  // namespace streamsafe_torch_detail

STREAMSAFE_EXPORT void* streamsafe_torch_alloc(size_t size, int device, void* stream) {
  try {
    if (streamsafe_torch_detail::captures_announced_ref().load(std::memory_order_relaxed) > 0)
      streamsafe_torch_detail::route_capture(device, to_stream(stream));
    return allocator::instance().allocate(size == 0 ? 1 : size, device, to_stream(stream));
  } catch (const std::bad_alloc& e) {
    note_error("streamsafe_torch_alloc", e);
    throw std::bad_alloc();
  } catch (const std::exception& e) {
    note_error("streamsafe_torch_alloc", e);
    throw std::runtime_error(last_error);
  }
}

STREAMSAFE_EXPORT void streamsafe_torch_free(void* ptr, size_t /*size*/, int /*device*/,
                                             void* /*stream*/) {
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
        "{\"device\": %d, \"allocated_bytes.all.current\": %lld, \"allocated_bytes.all.peak\": "
        "%lld, "
        "\"reserved_bytes.all.current\": %lld, \"reserved_bytes.all.peak\": %lld, "
        "\"active_bytes.all.current\": %lld, \"active_bytes.all.peak\": %lld, "
        "\"inactive_split_bytes.all.current\": %lld, \"requested_bytes.all.peak\": %lld, "
        "\"segment.all.current\": %lld, \"allocation.all.current\": %lld, \"num_alloc_retries\": "
        "%llu, "
        "\"num_ooms\": %llu, \"num_device_alloc\": %llu, \"num_device_free\": %llu, "
        "\"num_sync_all_streams\": %llu, \"events_recorded\": %llu, \"stream_waits\": %llu, "
        "\"fence_waits\": %llu, \"fence_wait_ns\": %llu, \"releases_deferred\": %llu, "
        "\"bytes_released\": %llu, "
        "\"pending_release_bytes\": %llu}",
        device, static_cast<long long>(s.allocated_bytes.current),
        static_cast<long long>(s.allocated_bytes.peak),
        static_cast<long long>(s.reserved_bytes.current),
        static_cast<long long>(s.reserved_bytes.peak),
        static_cast<long long>(s.active_bytes.current), static_cast<long long>(s.active_bytes.peak),
        static_cast<long long>(s.inactive_split_bytes.current),
        static_cast<long long>(s.requested_bytes.peak), static_cast<long long>(s.segment.current),
        static_cast<long long>(s.allocation.current),
        static_cast<unsigned long long>(s.num_alloc_retries),
        static_cast<unsigned long long>(s.num_ooms),
        static_cast<unsigned long long>(s.num_device_alloc),
        static_cast<unsigned long long>(s.num_device_free),
        static_cast<unsigned long long>(s.num_sync_all_streams),
        static_cast<unsigned long long>(s.events_recorded),
        static_cast<unsigned long long>(s.stream_waits),
        static_cast<unsigned long long>(s.fence_waits),
        static_cast<unsigned long long>(s.fence_wait_ns),
        static_cast<unsigned long long>(s.releases_deferred),
        static_cast<unsigned long long>(s.bytes_released),
        static_cast<unsigned long long>(d ? d->pending_release_bytes() : 0));
    return streamsafe::detail::copy_text(text, buf, len);
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

// ---- the other hooks of torch.cuda.memory.CUDAPluggableAllocator (PyTorch 2.11)
// ------------------ Wired by streamsafe.torch.install_pluggable() through alloc._allocator.set_*;
// the signatures are those PyTorch casts the addresses to (the pool hooks take C++ types:
// MempoolId_t is a pair of unsigned long long, the filter a std::function).

namespace {

using mempool_id = std::pair<unsigned long long, unsigned long long>;
using stream_filter = std::function<bool(cudaStream_t)>;

// A capture PyTorch announced (beginAllocateToPool, called before cudaStreamBeginCapture with a
// filter but not the stream). The first allocation on a stream the filter accepts, once that
// stream captures, tells streamsafe (notify_capture_begin just after the capture began, which the
// core's contract allows); endAllocateToPool ends it.
struct pool_capture {
  mempool_id pool;
  int device = 0;
  stream_filter filter;
  cudaStream_t stream = nullptr;
  bool begun = false;
  std::uint64_t graph = 0;
};
struct pool_entry {
  int device = 0;
  int use_count = 0;
  std::vector<std::uint64_t> graphs;
};
std::mutex pool_mutex;
std::vector<pool_capture> pool_captures;  // guarded by pool_mutex
std::map<mempool_id, pool_entry> pools;   // guarded by pool_mutex
std::atomic<int> captures_announced{0};

}  // namespace

namespace streamsafe_torch_detail {
// Called by streamsafe_torch_alloc while a capture is announced: routes the stream's first
// allocation inside the capture to streamsafe's graph pool. Throws for use_mem_pool-style
// routing (a filter that accepts a stream that is not capturing).
void route_capture(int device, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(pool_mutex);
  for (pool_capture& c : pool_captures) {
    if (c.device != device || (c.begun && c.stream == stream)) continue;
    if (c.begun || !c.filter || !c.filter(stream)) continue;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) (void)cudaGetLastError();
    if (status != cudaStreamCaptureStatusActive) {
      throw std::runtime_error(
          "streamsafe: allocating to a memory pool outside a CUDA graph capture "
          "(torch.cuda.use_mem_pool, "
          "MemPool) is not supported; streamsafe keeps private pools for CUDA graph captures only");
    }
    // The device's allocator directly: the front end's notify_capture_begin(stream) asks the
    // stream's device (cudaStreamGetDevice), which a capturing stream refuses.
    c.graph = allocator::instance().device_allocator(device).notify_capture_begin(
        streamsafe::cuda::to_stream_handle(stream));
    c.stream = stream;
    c.begun = true;
    return;
  }
}
}  // namespace streamsafe_torch_detail

// set_init_fn: nothing to do (devices get their allocator on first use).
STREAMSAFE_EXPORT void streamsafe_torch_init(int /*device_count*/) {}

// set_reset_fn: torch.cuda.empty_cache(): release behind fences (wait or defer as configured).
STREAMSAFE_EXPORT void streamsafe_torch_reset(void) { (void)streamsafe_torch_empty_cache(); }

// set_memory_fraction_fn: torch.cuda.set_per_process_memory_fraction. The process allocator's
// limit is fixed when it is created; refused by name.
STREAMSAFE_EXPORT void streamsafe_torch_memory_fraction(double fraction, int device) {
  throw std::runtime_error("streamsafe (pluggable allocator): set_per_process_memory_fraction(" +
                           std::to_string(fraction) + ", " + std::to_string(device) +
                           ") is not supported; set memory_fraction:F in STREAMSAFE_ALLOC_CONF or "
                           "use streamsafe.torch.install()");
}

// set_base_alloc_fn: the segment that holds ptr (its base, *size its bytes); ptr itself and its
// block size when no segment is found.
STREAMSAFE_EXPORT void* streamsafe_torch_base_alloc(void* ptr, size_t* size) {
  try {
    allocator& a = allocator::instance();
    const int device = a.owner_device(ptr);
    if (device >= 0) {
      const streamsafe::memory_snapshot snap = a.device_allocator(device).snapshot();
      const auto p = reinterpret_cast<std::uintptr_t>(ptr);
      for (const auto& seg : snap.segments) {
        if (p >= seg.address && p < seg.address + seg.size_bytes) {
          if (size) *size = seg.size_bytes;
          return reinterpret_cast<void*>(seg.address);
        }
      }
    }
  } catch (const std::exception& e) {
    note_error("streamsafe_torch_base_alloc", e);
    throw std::runtime_error(last_error);
  }
  throw std::runtime_error("streamsafe_torch_base_alloc: not a block streamsafe handed out");
}

// set_record_stream_fn: Tensor.record_stream. A pointer streamsafe did not hand out (a tensor
// from from_blob) is ignored, as PyTorch's allocator does.
STREAMSAFE_EXPORT void streamsafe_torch_record_stream_fn(void* ptr, cudaStream_t stream) {
  if (!ptr) return;
  try {
    allocator::instance().record_stream(ptr, stream);
  } catch (const streamsafe::invalid_pointer& e) {
    streamsafe::detail::log().debug("streamsafe_torch_record_stream_fn: ignored: {}", e.what());
  } catch (const std::exception& e) {
    note_error("streamsafe_torch_record_stream_fn", e);
    throw std::runtime_error(last_error);
  }
}

// set_begin_allocate_to_pool: a capture into pool `id` is about to begin on `device`.
STREAMSAFE_EXPORT void streamsafe_torch_begin_allocate_to_pool(int device, mempool_id id,
                                                               stream_filter filter) {
  std::lock_guard<std::mutex> lock(pool_mutex);
  pool_entry& p = pools[id];
  p.device = device;
  ++p.use_count;
  pool_capture c;
  c.pool = id;
  c.device = device;
  c.filter = std::move(filter);
  pool_captures.push_back(std::move(c));
  captures_announced.fetch_add(1);
}

// set_end_allocate_to_pool_fn: the capture into `id` ended (after cudaStreamEndCapture).
STREAMSAFE_EXPORT void streamsafe_torch_end_allocate_to_pool(int device, mempool_id id) {
  pool_capture c;
  {
    std::lock_guard<std::mutex> lock(pool_mutex);
    auto it = std::find_if(
        pool_captures.rbegin(), pool_captures.rend(),
        [&](const pool_capture& x) { return x.pool == id && x.device == device; });
    if (it == pool_captures.rend()) return;
    c = *it;
    pool_captures.erase(std::next(it).base());
    captures_announced.fetch_sub(1);
    if (c.begun) pools[id].graphs.push_back(c.graph);
  }
  if (c.begun) {
    try {
      allocator::instance().device_allocator(c.device).notify_capture_end(
          streamsafe::cuda::to_stream_handle(c.stream));
    } catch (const std::exception& e) {
      note_error("streamsafe_torch_end_allocate_to_pool", e);
      throw std::runtime_error(last_error);
    }
  }
}

// set_release_pool: one user of pool `id` (a graph) is gone; with the last, every graph captured
// into it is released to streamsafe (its memory becomes releasable behind fences).
STREAMSAFE_EXPORT void streamsafe_torch_release_pool(int device, mempool_id id) {
  std::vector<std::uint64_t> graphs;
  int pool_device = device;
  {
    std::lock_guard<std::mutex> lock(pool_mutex);
    auto it = pools.find(id);
    if (it == pools.end() || --it->second.use_count > 0) return;
    graphs = std::move(it->second.graphs);
    pool_device = it->second.device;
    pools.erase(it);
  }
  for (std::uint64_t g : graphs) {
    try {
      allocator::instance().notify_graph_released(g, pool_device);
    } catch (const std::exception& e) {
      note_error("streamsafe_torch_release_pool", e);
    }
  }
}

// Bytes waiting in the deferred-release queues of every device.
STREAMSAFE_EXPORT size_t streamsafe_torch_pending_release_bytes(void) {
  try {
    allocator& a = allocator::instance();
    std::size_t total = 0;
    for (int d = 0; d < a.device_count(); ++d)
      if (const auto* c = a.find_device_allocator(d)) total += c->pending_release_bytes();
    return total;
  } catch (const std::exception& e) {
    note_error("streamsafe_torch_pending_release_bytes", e);
    return 0;
  }
}

std::atomic<int>& streamsafe_torch_detail::captures_announced_ref() { return captures_announced; }
