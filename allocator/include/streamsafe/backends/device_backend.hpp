// streamsafe: the narrow device backend interface.
//
// Every call the caching allocator makes to a device goes through this interface; the core
// includes no CUDA header. Three implementations exist: cuda_malloc_backend (cudaMalloc /
// cudaFree segments), expandable_backend (CUDA virtual memory management: reserve an address
// range, map and unmap physical chunks) and simulated_device (CPU only, deterministic).
//
// Contract, common to every call:
//  * Units are bytes. Addresses are plain host-visible integers of device virtual addresses.
//  * Streams and events are opaque integer handles (a cudaStream_t / cudaEvent_t cast to
//    std::uintptr_t on a GPU; 0 is the legacy default stream).
//  * A backend is bound to one device. The caller need not make that device current: each
//    backend call that touches the driver makes its own device current for the duration of the
//    call (a scoped device guard) and restores the previous one.
//  * Calls that release memory (free_segment, unmap) do NOT wait for pending GPU work, whatever
//    the driver does underneath: the allocator fences before calling them. Calls that block the
//    host are named synchronize_*, with one exception the backend declares:
//    free_segment_synchronizes() is true when free_segment itself waits for all work on the
//    device (cudaFree does); the allocator then frees a segment without waiting (empty_cache
//    defer mode) only while every stream it knows is idle (query_stream).
//  * CUDA graph capture: stream_is_capturing(s) tells whether s is capturing (no host block, no
//    effect on the capture); backends that cannot tell answer false. allocate_segment and map
//    are the only calls the allocator makes for growth while a stream of the device captures,
//    so a CUDA backend makes them capture-safe (relaxed capture mode for that call); the
//    allocator makes no releasing, synchronising or event- or stream-query call meanwhile.
//  * Failure: allocate_segment and map return false/nullptr when the device is out of memory;
//    every other failure throws streamsafe::backend_error naming the call, device and driver
//    error. Thread safety: a backend may be called from several threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace streamsafe {

class device_backend;
// Throws backend_error: `call` is not supported by `backend` (the IPC defaults below).
[[noreturn]] void throw_unsupported(const device_backend& backend, const char* call);

using stream_handle = std::uintptr_t;  // cudaStream_t value; 0 = legacy default stream
using event_handle = std::uintptr_t;   // cudaEvent_t value; 0 = none

class device_backend {
 public:
  virtual ~device_backend() = default;

  virtual int device() const noexcept = 0;
  virtual const char* name() const noexcept = 0;

  // ---- whole segments (cudaMalloc style) -------------------------------------------------
  // Returns a segment of size_bytes (a multiple of 512) aligned to at least 512 bytes, or
  // nullptr when the device is out of memory.
  virtual void* allocate_segment(std::size_t size_bytes) = 0;
  // Gives a segment returned by allocate_segment back to the driver.
  virtual void free_segment(void* base, std::size_t size_bytes) = 0;
  // True when free_segment blocks the host until all work on the device has finished.
  virtual bool free_segment_synchronizes() const noexcept { return false; }

  // ---- expandable segments (virtual memory management) ---------------------------------
  // True when reserve/map/unmap are available. Sizes and addresses passed to map/unmap are
  // multiples of map_granularity_bytes().
  virtual bool supports_expandable() const noexcept = 0;
  virtual std::size_t map_granularity_bytes() const noexcept = 0;
  // Reserves (does not back) a virtual address range; throws backend_error on failure.
  virtual void* reserve_address_range(std::size_t size_bytes) = 0;
  virtual void release_address_range(void* base, std::size_t size_bytes) = 0;
  // Backs [addr, addr+size) with physical memory readable and writable by the device; false
  // when the device is out of memory (nothing stays mapped then).
  virtual bool map(void* addr, std::size_t size_bytes) = 0;
  // Unmaps and frees the physical memory behind [addr, addr+size) (a range map() mapped, or a
  // union of such ranges).
  virtual void unmap(void* addr, std::size_t size_bytes) = 0;
  // Maps at [addr, addr+size) (reserved, not mapped) the physical memory already mapped at
  // [from, from+size) (a union of whole ranges map() mapped), taking no new memory: both ranges
  // then reach the same bytes, and unmap() of either leaves the other mapped (the memory goes
  // back once its last mapping is unmapped). Returns false, mapping nothing, when the backend
  // cannot (the default). No host block; it orders nothing: the caller orders the new range's
  // uses after the old range's.
  virtual bool map_alias(void* /*addr*/, const void* /*from*/, std::size_t /*size_bytes*/) {
    return false;
  }

  // ---- events and streams ---------------------------------------------------------------
  virtual event_handle create_event() = 0;  // timing disabled
  virtual void destroy_event(event_handle event) noexcept = 0;
  virtual void record_event(event_handle event, stream_handle stream) = 0;
  virtual bool query_event(event_handle event) = 0;        // true once complete
  virtual void synchronize_event(event_handle event) = 0;  // blocks the host
  // Blocks the host until the event completes or `timeout_us` has passed; true when complete.
  // The default polls query_event. A bounded wait: the out-of-memory path of empty_cache:defer.
  virtual bool synchronize_event_for(event_handle event, std::uint64_t timeout_us);
  virtual void stream_wait_event(stream_handle stream, event_handle event) = 0;  // no host block
  // True when all work enqueued on `stream` so far has completed (cudaStreamQuery); never blocks.
  // The default records a fresh event and queries it, which may report an idle stream as busy
  // for a moment (the record itself is still in flight).
  virtual bool query_stream(stream_handle stream) {
    const event_handle e = create_event();
    bool idle = false;
    try {
      record_event(e, stream);
      idle = query_event(e);
    } catch (...) {
      destroy_event(e);
      throw;
    }
    destroy_event(e);
    return idle;
  }
  virtual void synchronize_device() = 0;  // blocks the host on every stream
  virtual void memory_info(std::size_t& free_bytes, std::size_t& total_bytes) = 0;
  // True while `stream` is capturing a CUDA graph. Never throws (an error answers false); the
  // legacy default stream (0) is never capturing.
  virtual bool stream_is_capturing(stream_handle /*stream*/) noexcept { return false; }
  // The id of the capture `stream` takes part in (cudaStreamGetCaptureInfo's id), 0 when it is
  // not capturing or the backend cannot tell. A stream joined into another stream's capture by
  // waiting on one of its events has that capture's id. Never throws; capture-safe.
  virtual std::uint64_t capture_id(stream_handle /*stream*/) noexcept { return 0; }
  // Order inside one capture. capture_position(s): where capturing stream s stands now (opaque:
  // the graph nodes its next captured work would depend on; empty when s is not capturing).
  // capture_follows(t, p): true when capturing stream t's next captured work is ordered after
  // every node of p (t waited, through captured events, on what s had captured when p was
  // taken). Both capture-safe; throw backend_error on a driver error. Default: nothing is known
  // to follow.
  virtual std::vector<std::uintptr_t> capture_position(stream_handle /*stream*/) { return {}; }
  virtual bool capture_follows(stream_handle /*stream*/,
                               const std::vector<std::uintptr_t>& /*position*/) {
    return false;
  }
  // True when the handle names a different stream in each host thread (cudaStreamPerThread).
  // The allocator relies on two events recorded on one stream completing in the order they were
  // recorded; for such a handle it queries every event instead.
  virtual bool stream_is_per_thread(stream_handle /*stream*/) const noexcept { return false; }

  // ---- stream-ordered copies and pinned host memory (pause/resume with offload) ----------
  // Optional: the defaults throw backend_error ("not supported by this backend"), and
  // host_backend() answers nullptr; caching_allocator::pause(tag, pause_mode::offload) then
  // throws config_error. A non-blocking stream of the device, owned by the caller until
  // destroy_stream (which does not wait for its work).
  virtual stream_handle create_stream();
  virtual void destroy_stream(stream_handle stream);
  // Enqueues a copy of `bytes` bytes from src to dst on `stream` (either side device memory or
  // pinned host memory of host_backend()); never blocks the host.
  virtual void copy_async(void* dst, const void* src, std::size_t bytes, stream_handle stream);
  // A backend whose segments are pinned host memory (cudaHostAlloc / cudaFreeHost) that shares
  // this backend's streams and events: a caching_allocator over it (backend_kind::cuda_malloc)
  // is a stream-ordered pinned host allocator (case K18). Owned by this backend; nullptr when
  // there is none. It supports no expandable segments and no host_backend of its own.
  virtual device_backend* host_backend() noexcept { return nullptr; }
  // ---- interprocess sharing (IPC, core/ipc.hpp) -------------------------------------------
  // Memory of this device described for another process: opaque bytes (cudaIpcMemHandle_t and
  // the offset for cudaMalloc segments; the mapped ranges for expandable segments) and file
  // descriptors of shareable physical memory (POSIX_FILE_DESCRIPTOR handles), owned by the
  // caller once returned (the core closes them when the export ends).
  struct ipc_memory {
    std::vector<std::uint8_t> bytes;
    std::vector<int> fds;
  };
  // The defaults throw backend_error (unsupported), so that a backend without IPC still builds.
  // Producer: [addr, addr+size_bytes), a live block, lies in the segment [segment_base,
  // segment_base+segment_bytes) (allocate_segment's, or a reserved range mapped there).
  virtual ipc_memory export_memory(std::uintptr_t segment_base, std::size_t segment_bytes,
                                   std::uintptr_t addr, std::size_t size_bytes) {
    (void)segment_base, (void)segment_bytes, (void)addr, (void)size_bytes;
    throw_unsupported(*this, "export_memory");
  }
  // Consumer: maps memory exported by another process on this device; `memory.fds` are this
  // process's descriptors (closed by the backend, whether or not the call succeeds). Returns the
  // address of the exported range's first byte.
  virtual std::uintptr_t import_memory(const ipc_memory& memory) {
    (void)memory;
    throw_unsupported(*this, "import_memory");
  }
  // Unmaps what import_memory mapped at `addr`. Does not wait for pending work (the allocator
  // closes behind the consumer's event).
  virtual void close_imported_memory(std::uintptr_t addr) {
    (void)addr;
    throw_unsupported(*this, "close_imported_memory");
  }
  // An interprocess event (cudaEventInterprocess | cudaEventDisableTiming), its handle's bytes
  // (cudaIpcGetEventHandle), the event another process's bytes name (cudaIpcOpenEventHandle;
  // record, query and synchronize it as any event) and its closing (cudaEventDestroy).
  virtual event_handle create_ipc_event() { throw_unsupported(*this, "create_ipc_event"); }
  virtual std::vector<std::uint8_t> export_event(event_handle event) {
    (void)event;
    throw_unsupported(*this, "export_event");
  }
  virtual event_handle open_ipc_event(const std::vector<std::uint8_t>& bytes) {
    (void)bytes;
    throw_unsupported(*this, "open_ipc_event");
  }
  virtual void close_ipc_event(event_handle event) noexcept { destroy_event(event); }
};

}  // namespace streamsafe
