// streamsafe: cuda::allocator, the multi-device C++ front end.
//
// One caching_allocator per device, created on first use, over the backend that
// options::backend names (cuda_malloc_backend or expandable_backend). The process-wide
// instance() reads STREAMSAFE_ALLOC_CONF once. Every other front end (C API, PyTorch pluggable
// allocator, LD_PRELOAD interposer, CUB-style and cuda::mr adapters) sits on this class.
//
// Stream-ordering contract (the caching_allocator's, see core/caching_allocator.hpp):
//  * allocate(bytes, stream): the block may be used on `stream` at once.
//  * deallocate(p): host free; the last use is on the allocation stream or on streams given to
//    record_stream. deallocate(p, stream): the last use is on `stream` (stream-ordered free).
//  * Memory goes back to the driver only behind a release fence (empty_cache, out of memory).
// Both deallocate calls and record_stream find the owning device themselves: they may be
// called whatever device is current (their CUDA calls run with the owner device current).
// Several GPUs: each device's allocator fences, waits on and defers behind its own device's
// streams (a device-1 block freed and released while device 0 is current waits on device 1's
// streams only); empty_cache() walks the devices one by one and holds no lock across devices.
//
// Special stream handles (cudaStreamLegacy and cudaStreamPerThread are the same small integers
// in every thread, so they are not identities):
//  * 0 and cudaStreamLegacy name the legacy default stream; both are keyed as 0.
//  * cudaStreamPerThread is a different stream in every thread. An allocation on it is served
//    from the legacy default stream's pool (the per-thread default stream is a blocking stream:
//    it is ordered after legacy-stream work, including the event waits the allocator issues
//    there) and the block is recorded as used on the allocating thread's per-thread stream
//    (the core gives each thread's per-thread stream an identity of its own), so that its host
//    free, on any thread, fences that stream (from another thread through the legacy stream).
//  * Passed to record_stream or deallocate(p, stream), cudaStreamPerThread means the calling
//    thread's per-thread stream, as everywhere in CUDA.
//
// Errors: allocate throws out_of_memory (a std::bad_alloc) or invalid_size (0 bytes);
// deallocate / record_stream throw invalid_pointer for a pointer no device's allocator handed
// out (the message names the devices searched); calls that name a device throw
// std::out_of_range for an index outside [0, device_count()); backend_error for a failed CUDA
// call (also: no GPU). Every error leaves the allocators' state and statistics unchanged.
//
// Thread safety: every member may be called from any thread. Per-device allocators are created
// once under a mutex and then reached without a lock; each serialises its own state.
#pragma once

#include <streamsafe/backends/device_backend.hpp>
#include <streamsafe/core/caching_allocator.hpp>
#include <streamsafe/core/options.hpp>
#include <streamsafe/core/statistics.hpp>

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string_view>

namespace streamsafe::cuda {

// How the front end reaches devices. platform::cuda() is the real one; tests and the C API's
// simulated mode substitute simulated devices (see simulated_platform.hpp).
struct platform {
  // Number of devices (read once, when the allocator is constructed).
  std::function<int()> device_count;
  // The calling thread's current device.
  std::function<int()> current_device;
  // The device a (non-special) stream belongs to.
  std::function<int(stream_handle)> stream_device;
  // The backend of one device; called once per device, under the allocator's creation mutex.
  std::function<std::unique_ptr<device_backend>(int device, const options& opts)> make_backend;
  // True for real GPUs (platform::cuda()): options::release_worker auto then means on in
  // empty_cache defer mode. Simulated platforms leave it false (auto means off).
  bool real_device = false;

  // CUDA: cudaGetDeviceCount (0 without a GPU), cudaGetDevice, cudaStreamGetDevice, and
  // cuda_malloc_backend or expandable_backend as opts.backend says.
  static platform cuda();
};

class allocator {
 public:
  // Devices beyond this many are not used.
  static constexpr int max_devices = 64;

  explicit allocator(options opts = {}, platform p = platform::cuda());
  // Destroys every device's caching_allocator (each waits on its release fences and gives its
  // cached memory back); live blocks are leaked. instance() is never destroyed.
  ~allocator();
  allocator(const allocator&) = delete;
  allocator& operator=(const allocator&) = delete;

  // The process-wide allocator: options from STREAMSAFE_ALLOC_CONF, parsed on the first call
  // (warnings logged once); never destroyed (memory goes back to the driver at process exit).
  // Throws config_error on every call while STREAMSAFE_ALLOC_CONF is invalid.
  static allocator& instance();

  // A block of at least `bytes` (aligned to 512 bytes) on the calling thread's current device,
  // usable on `stream` at once; `stream` must belong to that device (or be 0, cudaStreamLegacy
  // or cudaStreamPerThread).
  void* allocate(std::size_t bytes, cudaStream_t stream = nullptr);
  // The same on `device`; `stream` must belong to `device`.
  void* allocate(std::size_t bytes, int device, cudaStream_t stream);

  // Host free / stream-ordered free, routed to the owning device.
  void deallocate(void* ptr);
  void deallocate(void* ptr, cudaStream_t stream);
  // Records a use of the block on `stream` (Tensor.record_stream), routed to the owning device.
  void record_stream(void* ptr, cudaStream_t stream);

  // Over every device that has an allocator: release cached memory behind fences (mode from
  // options::empty_cache) / finish deferred releases without blocking. Return bytes released.
  std::size_t empty_cache();
  std::size_t reclaim();
  // Per device: caching_allocator::empty_cache(tag) and trim(bytes_to_keep) (docs/sleep.md).
  std::size_t empty_cache(std::string_view tag);
  std::size_t trim(std::size_t bytes_to_keep);

  // Statistics of one device (all zero before its first allocation).
  statistics stats(int device) const;
  // The device's caching_allocator, created now if needed.
  caching_allocator& device_allocator(int device);
  // The device's caching_allocator if it has been created, else nullptr (also for an index out
  // of range). Never throws, never creates.
  caching_allocator* find_device_allocator(int device) const noexcept {
    return device >= 0 && device < device_count_ ? existing(device) : nullptr;
  }
  // The device whose allocator handed out `ptr` (a live block's start address), or -1.
  int owner_device(const void* ptr) const noexcept;

  // Tells the stream's device's allocator that `stream` is about to be destroyed (call it
  // before cudaStreamDestroy: an event is recorded on the stream). Ignored for 0,
  // cudaStreamLegacy and cudaStreamPerThread, and on devices without an allocator yet.
  void notify_stream_destroyed(cudaStream_t stream);
  void notify_stream_destroyed(cudaStream_t stream, int device);

  // CUDA graph capture (case K11; caching_allocator::notify_capture_begin has the contract).
  // notify_capture_begin(s): call just before cudaStreamBeginCapture(s); the allocator of s's
  // device (created now if needed) makes no releasing, synchronising or event-query call until
  // the matching notify_capture_end(s), and serves s from the graph's private pool. Returns the
  // graph's id on that device. notify_capture_end(s): after cudaStreamEndCapture(s); returns
  // the id. notify_graph_released(graph, device): the graph will not be launched again; its
  // memory becomes releasable. Throw std::invalid_argument for 0 / cudaStreamLegacy, a stream
  // already (or not) capturing, or an unknown graph id; backend_error for a bad device.
  // Note: CUDA's global capture mode forbids unsafe calls on every device of the process; only
  // the capturing stream's device is told here.
  std::uint64_t notify_capture_begin(cudaStream_t stream);
  // The capture allocates into the private pool of graph share_pool_of_graph (same device; 0: a
  // new pool), as torch.cuda.graph(pool=...) shares a pool (caching_allocator's contract).
  std::uint64_t notify_capture_begin(cudaStream_t stream, std::uint64_t share_pool_of_graph);
  std::uint64_t notify_capture_end(cudaStream_t stream);
  void notify_graph_released(std::uint64_t graph, int device);

  // Interprocess sharing (caching_allocator's contract; core/ipc.hpp has the protocol).
  // export_block / revoke_exports route to the device owning ptr; notify_import_released to the
  // device named in the message (the producer's). import_block maps the block on `device` (the
  // calling thread's current device by default: the consumer's numbering of devices may differ
  // from the producer's, as with CUDA_VISIBLE_DEVICES); release_import finds the device holding
  // the import. Errors as caching_allocator's, ipc_error for an import no device holds.
  ipc_handle export_block(void* ptr);
  void notify_import_released(const ipc_release& release);
  std::size_t revoke_exports(void* ptr);
  imported_block import_block(const ipc_handle& handle);
  imported_block import_block(const ipc_handle& handle, int device);
  ipc_release release_import(void* ptr, cudaStream_t stream);

  int device_count() const noexcept { return device_count_; }
  int current_device() const { return platform_.current_device(); }
  // Devices whose allocator has been created.
  int devices_in_use() const noexcept;
  // The options asked for (release_worker as given, before auto is resolved), with the runtime
  // options as last set.
  options config() const;
  // caching_allocator::set_runtime_options on every device's allocator, and on those created
  // later. A bad value throws config_error and changes nothing.
  void set_runtime_options(const runtime_options& r);

 private:
  struct device_state {
    std::unique_ptr<device_backend> backend;  // declared first: outlives the allocator
    std::unique_ptr<caching_allocator> alloc;
  };

  void check_device(int device) const;
  caching_allocator* existing(int device) const noexcept {
    return devices_[static_cast<std::size_t>(device)].load(std::memory_order_acquire);
  }
  caching_allocator& get_or_create(int device);
  template <class F>
  std::size_t sum_over_devices(F&& f);
  // Runs op(a) on the allocator `a` that holds `ptr` as a live block. When none does, throws
  // invalid_pointer: the allocators' own diagnosis (double free, interior or unknown pointer)
  // and the devices searched. Defined in allocator.cpp, the only user.
  template <class Op>
  void route(void* ptr, const char* what, Op&& op);
  void* allocate_on(caching_allocator& a, std::size_t bytes, cudaStream_t stream);

  options options_;
  platform platform_;
  int device_count_ = 0;
  std::unique_ptr<std::atomic<caching_allocator*>[]> devices_;  // by index; null until created
  std::atomic<int> created_{0};
  mutable std::mutex create_mutex_;         // guards options_, states_ and creation
  std::unique_ptr<device_state[]> states_;  // by index; owned here
};

// The stream handle the caching allocators use for a CUDA stream: cudaStreamLegacy becomes 0;
// every other value (cudaStreamPerThread included) is kept.
stream_handle to_stream_handle(cudaStream_t stream) noexcept;
// True for 0, cudaStreamLegacy and cudaStreamPerThread.
bool is_special_stream(cudaStream_t stream) noexcept;
// Logs one line through the "streamsafe" logger (STREAMSAFE_LOG_LEVEL, STREAMSAFE_LOG_FILE) at
// error / debug level: for the noexcept paths of the header-only adapters. Never throws.
void log_error(const char* message) noexcept;
void log_debug(const char* message) noexcept;

}  // namespace streamsafe::cuda
