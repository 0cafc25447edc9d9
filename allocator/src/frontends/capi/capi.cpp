// streamsafe: the C API (include/streamsafe/streamsafe.h) over cuda::allocator.
//
// One process allocator per copy of this library: created on first use from the configuration
// (STREAMSAFE_ALLOC_CONF, or streamsafe_configure) over real CUDA devices, or over simulated
// ones after streamsafe_use_simulated_devices. Every exception becomes a status code and the
// calling thread's last-error message; nothing escapes into C.
//
// Lock: state::mutex guards the configuration, the platform choice and the creation or
// replacement of the allocator; the allocator itself is published through an atomic pointer
// and used without this lock. Replaced allocators (and simulated platforms) are retired, never
// destroyed, so that a thread still holding one cannot see it freed.
#include "core/common/logging.hpp"
#include "core/ipc/ipc_wire.hpp"

#include <streamsafe/streamsafe.h>
#include <streamsafe/core/errors.hpp>
#include <streamsafe/frontends/allocator.hpp>
#include <streamsafe/sim/simulated_platform.hpp>

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using streamsafe::cuda::allocator;
using streamsafe::cuda::simulated_platform;

struct state {
  std::mutex mutex;
  streamsafe::options opts;
  bool configured = false;  // opts set by streamsafe_configure (else read from the environment)
  simulated_platform* sim = nullptr;
  std::atomic<allocator*> current{nullptr};
  std::vector<std::unique_ptr<allocator>> allocators;          // current and retired
  std::vector<std::unique_ptr<simulated_platform>> platforms;  // current and retired
};

state& global() {
  static state* const s = new state;  // never destroyed: see the header's "process-wide state"
  return *s;
}

thread_local std::string last_error;

streamsafe_status fail(streamsafe_status status, const char* message) noexcept {
  try {
    last_error = message;
  } catch (...) {
    last_error.clear();
  }
  return status;
}

// A failure that the C API reports with its own status (not one of the library's exceptions).
struct status_error {
  streamsafe_status status;
  std::string message;
};

// Runs f, turning every exception into a status and the thread's last-error message.
template <class F>
streamsafe_status guarded(F&& f) noexcept {
  try {
    f();
    return STREAMSAFE_SUCCESS;
  } catch (const status_error& e) {
    return fail(e.status, e.message.c_str());
  } catch (const streamsafe::out_of_memory& e) {
    return fail(STREAMSAFE_ERROR_OUT_OF_MEMORY, e.what());
  } catch (const streamsafe::invalid_pointer& e) {
    return fail(STREAMSAFE_ERROR_INVALID_POINTER, e.what());
  } catch (const streamsafe::invalid_size& e) {
    return fail(STREAMSAFE_ERROR_INVALID_SIZE, e.what());
  } catch (const streamsafe::config_error& e) {
    return fail(STREAMSAFE_ERROR_CONFIG, e.what());
  } catch (const streamsafe::backend_error& e) {
    return fail(STREAMSAFE_ERROR_BACKEND, e.what());
  } catch (const streamsafe::tag_paused& e) {
    return fail(STREAMSAFE_ERROR_TAG_PAUSED, e.what());
  } catch (const streamsafe::ipc_error& e) {
    return fail(STREAMSAFE_ERROR_IPC, e.what());
  } catch (const std::out_of_range& e) {
    return fail(STREAMSAFE_ERROR_INVALID_ARGUMENT, e.what());
  } catch (const std::invalid_argument& e) {  // after invalid_size and config_error
    return fail(STREAMSAFE_ERROR_INVALID_ARGUMENT, e.what());
  } catch (const std::bad_alloc&) {
    return fail(STREAMSAFE_ERROR_OUT_OF_MEMORY, "streamsafe: host memory exhausted");
  } catch (const std::exception& e) {
    return fail(STREAMSAFE_ERROR_UNKNOWN, e.what());
  } catch (...) {
    return fail(STREAMSAFE_ERROR_UNKNOWN, "streamsafe: unknown exception");
  }
}

allocator& target() {
  state& s = global();
  if (allocator* a = s.current.load(std::memory_order_acquire)) return *a;
  std::lock_guard<std::mutex> lk(s.mutex);
  if (allocator* a = s.current.load(std::memory_order_acquire)) return *a;
  if (!s.configured) {
    std::vector<std::string> warnings;
    s.opts = streamsafe::options::from_environment(&warnings);
    for (const auto& w : warnings) streamsafe::detail::log().warn("{}", w);
    s.configured = true;
  }
  auto a = std::make_unique<allocator>(
      s.opts, s.sim ? s.sim->make_platform() : streamsafe::cuda::platform::cuda());
  s.allocators.push_back(std::move(a));
  s.current.store(s.allocators.back().get(), std::memory_order_release);
  return *s.allocators.back();
}

// REQUIRES: s.mutex held. Retires the current allocator (a new one is made on next use);
// throws status_error once an allocation has been made.
void retire_allocator(state& s, const char* call) {
  allocator* a = s.current.load(std::memory_order_acquire);
  if (a && a->devices_in_use() > 0) {
    throw status_error{STREAMSAFE_ERROR_STATE,
                       std::string("streamsafe: ") + call +
                           " after the first allocation; call it before any other streamsafe call"};
  }
  s.current.store(nullptr, std::memory_order_release);
}

cudaStream_t to_stream(void* stream) noexcept { return static_cast<cudaStream_t>(stream); }

streamsafe_status invalid_argument(const char* message) noexcept {
  return fail(STREAMSAFE_ERROR_INVALID_ARGUMENT, message);
}

void copy_stat(const streamsafe::stat& in, streamsafe_stat& out) noexcept {
  out.current = in.current;
  out.peak = in.peak;
  out.allocated = in.allocated;
  out.freed = in.freed;
}

simulated_platform* simulated() noexcept {
  state& s = global();
  std::lock_guard<std::mutex> lk(s.mutex);
  return s.sim;
}

}  // namespace

extern "C" {

streamsafe_status streamsafe_malloc(void** ptr, size_t bytes, void* stream) {
  if (!ptr) return invalid_argument("streamsafe_malloc: ptr is NULL");
  *ptr = nullptr;
  return guarded([&] { *ptr = target().allocate(bytes, to_stream(stream)); });
}

streamsafe_status streamsafe_malloc_on_device(void** ptr, size_t bytes, int device, void* stream) {
  if (!ptr) return invalid_argument("streamsafe_malloc_on_device: ptr is NULL");
  *ptr = nullptr;
  return guarded([&] { *ptr = target().allocate(bytes, device, to_stream(stream)); });
}

streamsafe_status streamsafe_free(void* ptr) {
  if (!ptr) return STREAMSAFE_SUCCESS;
  return guarded([&] { target().deallocate(ptr); });
}

streamsafe_status streamsafe_free_on_stream(void* ptr, void* stream) {
  if (!ptr) return STREAMSAFE_SUCCESS;
  return guarded([&] { target().deallocate(ptr, to_stream(stream)); });
}

streamsafe_status streamsafe_record_stream(void* ptr, void* stream) {
  return guarded([&] { target().record_stream(ptr, to_stream(stream)); });
}

// ---- IPC ----------------------------------------------------------------------------------------

namespace {

static_assert(sizeof(streamsafe::detail::ipc_release_header) == STREAMSAFE_IPC_RELEASE_BYTES,
              "the C API's release buffer size is the release message's");

// A malloc'ed copy of `bytes` (released with streamsafe_ipc_free).
void* c_copy(const std::vector<std::uint8_t>& bytes) {
  void* out = std::malloc(bytes.empty() ? 1 : bytes.size());
  if (!out) throw std::bad_alloc();
  if (!bytes.empty()) std::memcpy(out, bytes.data(), bytes.size());
  return out;
}

void require(bool ok, const char* what) {
  if (!ok)
    throw status_error{STREAMSAFE_ERROR_INVALID_ARGUMENT, std::string("streamsafe: ") + what};
}

}  // namespace

streamsafe_status streamsafe_export_block(void* ptr, void** handle, size_t* handle_bytes) {
  return guarded([&] {
    require(handle && handle_bytes, "streamsafe_export_block: NULL output pointer");
    *handle = nullptr;
    *handle_bytes = 0;
    const streamsafe::ipc_handle h = target().export_block(ptr);
    void* out = nullptr;
    try {
      out = c_copy(h.bytes);
    } catch (...) {
      target().revoke_exports(ptr);  // host memory exhausted: nobody can use this export
      throw;
    }
    *handle = out;
    *handle_bytes = h.bytes.size();
  });
}

void streamsafe_ipc_free(void* buffer) { std::free(buffer); }

streamsafe_status streamsafe_notify_import_released(const void* release, size_t release_bytes) {
  return guarded([&] {
    require(release != nullptr, "streamsafe_notify_import_released: NULL release");
    const auto* p = static_cast<const std::uint8_t*>(release);
    target().notify_import_released(streamsafe::ipc_release{{p, p + release_bytes}});
  });
}

streamsafe_status streamsafe_revoke_exports(void* ptr, size_t* revoked) {
  return guarded([&] {
    const std::size_t n = target().revoke_exports(ptr);
    if (revoked) *revoked = n;
  });
}

streamsafe_status streamsafe_import_block(const void* handle, size_t handle_bytes, int device,
                                          void** ptr, size_t* size_bytes) {
  return guarded([&] {
    require(handle && ptr, "streamsafe_import_block: NULL handle or output pointer");
    *ptr = nullptr;
    const auto* p = static_cast<const std::uint8_t*>(handle);
    const streamsafe::ipc_handle h{{p, p + handle_bytes}};
    const streamsafe::imported_block b = device < 0 ? target().import_block(h)
                                                    : target().import_block(h, device);
    *ptr = b.ptr;
    if (size_bytes) *size_bytes = b.size_bytes;
  });
}

streamsafe_status streamsafe_release_import(void* ptr, void* stream, void* release) {
  return guarded([&] {
    require(release != nullptr, "streamsafe_release_import: NULL release buffer");
    const streamsafe::ipc_release r = target().release_import(ptr, to_stream(stream));
    if (r.bytes.size() != STREAMSAFE_IPC_RELEASE_BYTES) {
      throw std::logic_error("streamsafe_release_import: release message of unexpected size");
    }
    std::memcpy(release, r.bytes.data(), r.bytes.size());
  });
}

streamsafe_status streamsafe_send_ipc_handle(int socket_fd, const void* handle,
                                             size_t handle_bytes) {
  return guarded([&] {
    require(handle != nullptr, "streamsafe_send_ipc_handle: NULL handle");
    const auto* p = static_cast<const std::uint8_t*>(handle);
    streamsafe::send_ipc_handle(socket_fd, streamsafe::ipc_handle{{p, p + handle_bytes}});
  });
}

streamsafe_status streamsafe_receive_ipc_handle(int socket_fd, void** handle,
                                                size_t* handle_bytes) {
  return guarded([&] {
    require(handle && handle_bytes, "streamsafe_receive_ipc_handle: NULL output pointer");
    *handle = nullptr;
    *handle_bytes = 0;
    const streamsafe::ipc_handle h = streamsafe::receive_ipc_handle(socket_fd);
    *handle = c_copy(h.bytes);
    *handle_bytes = h.bytes.size();
  });
}

streamsafe_status streamsafe_notify_stream_destroyed(void* stream) {
  return guarded([&] { target().notify_stream_destroyed(to_stream(stream)); });
}

streamsafe_status streamsafe_notify_capture_begin(void* stream, uint64_t* graph) {
  if (graph) *graph = 0;
  return guarded([&] {
    const std::uint64_t id = target().notify_capture_begin(to_stream(stream));
    if (graph) *graph = id;
  });
}

streamsafe_status streamsafe_notify_capture_end(void* stream, uint64_t* graph) {
  if (graph) *graph = 0;
  return guarded([&] {
    const std::uint64_t id = target().notify_capture_end(to_stream(stream));
    if (graph) *graph = id;
  });
}

streamsafe_status streamsafe_notify_graph_released(uint64_t graph, int device) {
  return guarded([&] { target().notify_graph_released(graph, device); });
}

streamsafe_status streamsafe_empty_cache(size_t* released_bytes) {
  if (released_bytes) *released_bytes = 0;
  return guarded([&] {
    const std::size_t n = target().empty_cache();
    if (released_bytes) *released_bytes = n;
  });
}

streamsafe_status streamsafe_reclaim(size_t* released_bytes) {
  if (released_bytes) *released_bytes = 0;
  return guarded([&] {
    const std::size_t n = target().reclaim();
    if (released_bytes) *released_bytes = n;
  });
}

streamsafe_status streamsafe_get_stats(int device, streamsafe_stats* out) {
  if (!out) return invalid_argument("streamsafe_get_stats: stats is NULL");
  return guarded([&] {
    allocator& a = target();
    const streamsafe::statistics s = a.stats(device);  // throws for a bad device index
    streamsafe_stats r{};
    copy_stat(s.allocated_bytes, r.allocated_bytes);
    copy_stat(s.reserved_bytes, r.reserved_bytes);
    copy_stat(s.active_bytes, r.active_bytes);
    copy_stat(s.inactive_split_bytes, r.inactive_split_bytes);
    copy_stat(s.requested_bytes, r.requested_bytes);
    copy_stat(s.allocation, r.allocation);
    copy_stat(s.segment, r.segment);
    copy_stat(s.active, r.active);
    r.num_alloc_retries = s.num_alloc_retries;
    r.num_ooms = s.num_ooms;
    r.num_device_alloc = s.num_device_alloc;
    r.num_device_free = s.num_device_free;
    r.num_sync_all_streams = s.num_sync_all_streams;
    r.events_recorded = s.events_recorded;
    r.stream_waits = s.stream_waits;
    r.fence_waits = s.fence_waits;
    r.fence_wait_ns = s.fence_wait_ns;
    r.releases_deferred = s.releases_deferred;
    r.bytes_released = s.bytes_released;
    r.segments_moved = s.segments_moved;
    if (const streamsafe::caching_allocator* d = a.find_device_allocator(device)) {
      r.pending_release_bytes = d->pending_release_bytes();
    }
    *out = r;
  });
}

streamsafe_status streamsafe_reset_peak_stats(int device) {
  return guarded([&] {
    allocator& a = target();
    (void)a.stats(device);  // validates the index
    if (streamsafe::caching_allocator* d = a.find_device_allocator(device)) d->reset_peak_stats();
  });
}

streamsafe_status streamsafe_owner_device(const void* ptr, int* device) {
  if (!device) return invalid_argument("streamsafe_owner_device: device is NULL");
  *device = -1;
  return guarded([&] { *device = target().owner_device(ptr); });
}

streamsafe_status streamsafe_configure(const char* conf) {
  if (!conf) return invalid_argument("streamsafe_configure: conf is NULL");
  return guarded([&] {
    std::vector<std::string> warnings;
    const streamsafe::options opts = streamsafe::options::parse(conf, &warnings);
    for (const auto& w : warnings) streamsafe::detail::log().warn("{}", w);
    state& s = global();
    std::lock_guard<std::mutex> lk(s.mutex);
    retire_allocator(s, "streamsafe_configure");
    s.opts = opts;
    s.configured = true;
  });
}

const char* streamsafe_last_error(void) { return last_error.c_str(); }

namespace {

thread_local std::vector<std::unique_ptr<streamsafe::tag_scope>> t_tag_stack;

void fill(streamsafe_pause_status* out, const streamsafe::pause_status& s) {
  if (!out) return;
  out->phase = static_cast<int>(s.phase);
  out->released_bytes = s.released_bytes;
  out->pending_bytes = s.pending_bytes;
  out->offloaded_host_bytes = s.offloaded_host_bytes;
  out->allocated_bytes = s.allocated_bytes;
  out->reserved_bytes = s.reserved_bytes;
}

const char* tag_or_throw(const char* tag) {
  if (!tag) throw std::invalid_argument("streamsafe: the tag is NULL");
  return tag;
}

}  // namespace

streamsafe_status streamsafe_tag_push(const char* tag) {
  return guarded(
      [&] { t_tag_stack.push_back(std::make_unique<streamsafe::tag_scope>(tag_or_throw(tag))); });
}

streamsafe_status streamsafe_tag_pop(void) {
  return guarded([&] {
    if (t_tag_stack.empty())
      throw status_error{STREAMSAFE_ERROR_STATE,
                         "streamsafe_tag_pop: no tag pushed on this thread"};
    t_tag_stack.pop_back();
  });
}

streamsafe_status streamsafe_pause(const char* tag, int device, streamsafe_pause_mode mode,
                                   int wait, streamsafe_pause_status* status) {
  return guarded([&] {
    if (mode != STREAMSAFE_PAUSE_DISCARD && mode != STREAMSAFE_PAUSE_OFFLOAD)
      throw std::invalid_argument("streamsafe_pause: mode must be DISCARD or OFFLOAD");
    fill(status,
         target().device_allocator(device).pause(
             tag_or_throw(tag),
             mode == STREAMSAFE_PAUSE_OFFLOAD ? streamsafe::pause_mode::offload
                                              : streamsafe::pause_mode::discard,
             wait ? streamsafe::empty_cache_mode::wait : streamsafe::empty_cache_mode::defer));
  });
}

streamsafe_status streamsafe_resume(const char* tag, int device, void* stream,
                                    streamsafe_pause_status* status) {
  return guarded([&] {
    auto& a = target().device_allocator(device);
    fill(status, stream ? a.resume(tag_or_throw(tag), reinterpret_cast<std::uintptr_t>(stream))
                        : a.resume(tag_or_throw(tag)));
  });
}

streamsafe_status streamsafe_tag_status(const char* tag, int device,
                                        streamsafe_pause_status* status) {
  return guarded(
      [&] { fill(status, target().device_allocator(device).tag_status(tag_or_throw(tag))); });
}

streamsafe_status streamsafe_list_tags(const char** names, size_t capacity, size_t* count) {
  if (count) *count = 0;
  return guarded([&] {
    if (!count) throw std::invalid_argument("streamsafe_list_tags: count is NULL");
    if (capacity != 0 && !names) {
      throw std::invalid_argument("streamsafe_list_tags: names is NULL with a capacity of " +
                                  std::to_string(capacity));
    }
    thread_local std::vector<std::string> held;  // the names handed out, until the next call
    held.clear();
    for (streamsafe::tag_info& t : streamsafe::list_tags()) held.push_back(std::move(t.name));
    for (std::size_t i = 0; i < held.size() && i < capacity; ++i) names[i] = held[i].c_str();
    *count = held.size();
  });
}

streamsafe_status streamsafe_empty_cache_tag(const char* tag, size_t* released_bytes) {
  if (released_bytes) *released_bytes = 0;
  return guarded([&] {
    const std::size_t n = target().empty_cache(tag_or_throw(tag));
    if (released_bytes) *released_bytes = n;
  });
}

streamsafe_status streamsafe_trim(size_t bytes_to_keep, size_t* released_bytes) {
  if (released_bytes) *released_bytes = 0;
  return guarded([&] {
    const std::size_t n = target().trim(bytes_to_keep);
    if (released_bytes) *released_bytes = n;
  });
}

const char* streamsafe_status_string(streamsafe_status status) {
  switch (status) {
    case STREAMSAFE_SUCCESS: return "STREAMSAFE_SUCCESS";
    case STREAMSAFE_ERROR_OUT_OF_MEMORY: return "STREAMSAFE_ERROR_OUT_OF_MEMORY";
    case STREAMSAFE_ERROR_INVALID_POINTER: return "STREAMSAFE_ERROR_INVALID_POINTER";
    case STREAMSAFE_ERROR_INVALID_SIZE: return "STREAMSAFE_ERROR_INVALID_SIZE";
    case STREAMSAFE_ERROR_INVALID_ARGUMENT: return "STREAMSAFE_ERROR_INVALID_ARGUMENT";
    case STREAMSAFE_ERROR_CONFIG: return "STREAMSAFE_ERROR_CONFIG";
    case STREAMSAFE_ERROR_BACKEND: return "STREAMSAFE_ERROR_BACKEND";
    case STREAMSAFE_ERROR_STATE: return "STREAMSAFE_ERROR_STATE";
    case STREAMSAFE_ERROR_UNKNOWN: return "STREAMSAFE_ERROR_UNKNOWN";
    case STREAMSAFE_ERROR_TAG_PAUSED: return "STREAMSAFE_ERROR_TAG_PAUSED";
    case STREAMSAFE_ERROR_IPC: return "STREAMSAFE_ERROR_IPC";
  }
  return "STREAMSAFE_ERROR_UNKNOWN";
}

streamsafe_status streamsafe_use_simulated_devices(int device_count, size_t bytes_per_device) {
  if (device_count <= 0 || device_count > 64) {
    return invalid_argument("streamsafe_use_simulated_devices: device_count must be in [1, 64]");
  }
  if (bytes_per_device == 0)
    return invalid_argument("streamsafe_use_simulated_devices: bytes_per_device is 0");
  return guarded([&] {
    state& s = global();
    std::lock_guard<std::mutex> lk(s.mutex);
    retire_allocator(s, "streamsafe_use_simulated_devices");
    streamsafe::sim::device_config config;
    config.total_bytes = bytes_per_device;
    s.platforms.push_back(std::make_unique<simulated_platform>(device_count, config));
    s.sim = s.platforms.back().get();
  });
}

streamsafe_status streamsafe_sim_set_device(int device) {
  simulated_platform* sim = simulated();
  if (!sim) return fail(STREAMSAFE_ERROR_STATE, "streamsafe_sim_set_device: not in simulated mode");
  if (device < 0 || device >= sim->device_count()) {
    return invalid_argument("streamsafe_sim_set_device: no such simulated device");
  }
  simulated_platform::set_current_device(device);
  return STREAMSAFE_SUCCESS;
}

streamsafe_status streamsafe_sim_create_stream(int device, void** stream) {
  if (!stream) return invalid_argument("streamsafe_sim_create_stream: stream is NULL");
  *stream = nullptr;
  simulated_platform* sim = simulated();
  if (!sim)
    return fail(STREAMSAFE_ERROR_STATE, "streamsafe_sim_create_stream: not in simulated mode");
  if (device < 0 || device >= sim->device_count()) {
    return invalid_argument("streamsafe_sim_create_stream: no such simulated device");
  }
  return guarded([&] { *stream = reinterpret_cast<void*>(sim->device(device).create_stream()); });
}

streamsafe_status streamsafe_sim_synchronize(void) {
  simulated_platform* sim = simulated();
  if (!sim)
    return fail(STREAMSAFE_ERROR_STATE, "streamsafe_sim_synchronize: not in simulated mode");
  return guarded([&] {
    for (int d = 0; d < sim->device_count(); ++d) sim->device(d).run_until_idle();
  });
}

int streamsafe_is_simulated(void) { return simulated() ? 1 : 0; }

}  // extern "C"
