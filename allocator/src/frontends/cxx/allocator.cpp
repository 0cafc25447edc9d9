// streamsafe: cuda::allocator, the multi-device front end (see cuda/allocator.hpp).
//
// Per-device caching_allocators live in states_ (owned) and are published through devices_
// (atomic pointers, null until created): creation takes create_mutex_, every later call only
// an acquire load. Frees and record_stream find the owner without a global table: with one
// device in use it is that device's allocator; with several, the first whose find_block()
// knows the pointer (current device first). A pointer no allocator knows is diagnosed by the
// allocators themselves (double free, interior pointer, foreign pointer).
#include "core/common/format.hpp"
#include "core/common/logging.hpp"

#include <streamsafe/backends/cuda_check.hpp>
#include <streamsafe/backends/cuda_malloc_backend.hpp>
#include <streamsafe/backends/expandable_backend.hpp>
#include <streamsafe/backends/gpu.hpp>
#include <streamsafe/core/errors.hpp>
#include <streamsafe/frontends/allocator.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

namespace streamsafe::cuda {
namespace {

constexpr stream_handle legacy_stream = 1;      // cudaStreamLegacy
constexpr stream_handle per_thread_stream = 2;  // cudaStreamPerThread

std::string hex(const void* p) {
  return streamsafe::detail::hex(reinterpret_cast<std::uintptr_t>(p));
}

}  // namespace

stream_handle to_stream_handle(cudaStream_t stream) noexcept {
  const auto s = reinterpret_cast<stream_handle>(stream);
  return s == legacy_stream ? 0 : s;
}

bool is_special_stream(cudaStream_t stream) noexcept {
  const auto s = reinterpret_cast<stream_handle>(stream);
  return s == 0 || s == legacy_stream || s == per_thread_stream;
}

void log_error(const char* message) noexcept {
  try {
    streamsafe::detail::log().error("{}", message);
  } catch (...) {
  }
}

void log_debug(const char* message) noexcept {
  try {
    streamsafe::detail::log().debug("{}", message);
  } catch (...) {
  }
}

platform platform::cuda() {
  platform p;
  p.device_count = [] { return cuda::device_count(); };
  p.current_device = [] { return cuda::current_device(); };
  p.stream_device = [](stream_handle stream) {
    int device = -1;
    STREAMSAFE_CUDA_CHECK(cudaStreamGetDevice(reinterpret_cast<cudaStream_t>(stream), &device));
    return device;
  };
  p.make_backend = [](int device, const options& opts) -> std::unique_ptr<device_backend> {
    if (opts.backend == backend_kind::expandable)
      return std::make_unique<expandable_backend>(device);
    return std::make_unique<cuda_malloc_backend>(device);
  };
  p.real_device = true;
  return p;
}

allocator::allocator(options opts, platform p) : options_(opts), platform_(std::move(p)) {
  device_count_ = platform_.device_count ? platform_.device_count() : 0;
  device_count_ = std::clamp(device_count_, 0, max_devices);
  const auto n = static_cast<std::size_t>(device_count_);
  devices_ = std::make_unique<std::atomic<caching_allocator*>[]>(n);
  for (std::size_t i = 0; i < n; ++i) devices_[i].store(nullptr, std::memory_order_relaxed);
  states_ = std::make_unique<device_state[]>(n);
}

allocator::~allocator() {
  for (int d = 0; d < device_count_; ++d) {
    device_state& s = states_[static_cast<std::size_t>(d)];
    devices_[static_cast<std::size_t>(d)].store(nullptr, std::memory_order_release);
    s.alloc.reset();
    s.backend.reset();
  }
}

allocator& allocator::instance() {
  static allocator* const the_instance = [] {
    std::vector<std::string> warnings;
    const options opts = options::from_environment(&warnings);
    for (const auto& w : warnings) streamsafe::detail::log().warn("{}", w);
    streamsafe::detail::log().debug("process allocator: {}", opts.to_string());
    return new allocator(opts);  // never destroyed: see instance()'s contract
  }();
  return *the_instance;
}

void allocator::check_device(int device) const {
  if (device_count_ == 0) {
    throw backend_error("streamsafe: no CUDA device is present (device count 0)");
  }
  if (device < 0 || device >= device_count_) {
    throw std::out_of_range("streamsafe: device " + std::to_string(device) + " does not exist (" +
                            std::to_string(device_count_) + " device(s) present)");
  }
}

caching_allocator& allocator::get_or_create(int device) {
  check_device(device);
  if (caching_allocator* a = existing(device)) return *a;
  std::lock_guard<std::mutex> lk(create_mutex_);
  if (caching_allocator* a = existing(device)) return *a;
  device_state& s = states_[static_cast<std::size_t>(device)];
  std::unique_ptr<device_backend> backend = platform_.make_backend(device, options_);
  // release_worker:auto: a worker thread gives memory back in defer mode on a real GPU (an
  // empty_cache never runs the driver's unmaps on the caller's thread); off on simulated devices,
  // whose tests expect the calling thread to release. config() keeps what was asked for; the
  // device's caching_allocator::config() says what was resolved.
  options resolved = options_;
  if (resolved.release_worker == release_worker_mode::automatic) {
    resolved.release_worker = platform_.real_device &&
                                      resolved.empty_cache == empty_cache_mode::defer
                                  ? release_worker_mode::on
                                  : release_worker_mode::off;
  }
  auto alloc = std::make_unique<caching_allocator>(*backend, resolved);
  s.backend = std::move(backend);
  s.alloc = std::move(alloc);
  devices_[static_cast<std::size_t>(device)].store(s.alloc.get(), std::memory_order_release);
  created_.fetch_add(1, std::memory_order_acq_rel);
  streamsafe::detail::log().debug("device {}: caching allocator created ({} backend)", device,
                                  s.backend->name());
  return *s.alloc;
}

caching_allocator& allocator::device_allocator(int device) { return get_or_create(device); }

options allocator::config() const {
  std::lock_guard<std::mutex> lk(create_mutex_);
  return options_;
}

void allocator::set_runtime_options(const runtime_options& r) {
  r.validate();                                   // config_error: nothing changed
  std::lock_guard<std::mutex> lk(create_mutex_);  // no device allocator is made meanwhile
  r.apply_to(options_);
  for (int d = 0; d < device_count_; ++d) {
    if (caching_allocator* a = existing(d)) a->set_runtime_options(r);
  }
}

int allocator::devices_in_use() const noexcept { return created_.load(std::memory_order_acquire); }

void* allocator::allocate_on(caching_allocator& a, std::size_t bytes, cudaStream_t stream) {
  const stream_handle s = to_stream_handle(stream);
  if (s != per_thread_stream) return a.allocate(bytes, s);
  // cudaStreamPerThread: the legacy stream's pool, with a recorded use on the per-thread
  // stream so that the host free records an event there (see the header).
  void* p = a.allocate(bytes, 0);
  try {
    a.record_stream(p, per_thread_stream);
  } catch (...) {
    a.deallocate(p);
    throw;
  }
  return p;
}

void* allocator::allocate(std::size_t bytes, cudaStream_t stream) {
  return allocate_on(get_or_create(platform_.current_device()), bytes, stream);
}

void* allocator::allocate(std::size_t bytes, int device, cudaStream_t stream) {
  return allocate_on(get_or_create(device), bytes, stream);
}

template <class Op>
void allocator::route(void* ptr, const char* what, Op&& op) {
  caching_allocator* in_use[max_devices];
  std::size_t n = 0;
  for (int d = 0; d < device_count_; ++d) {
    if (caching_allocator* a = existing(d)) in_use[n++] = a;
  }
  auto where = [&] {
    std::string devices;
    for (std::size_t i = 0; i < n; ++i)
      devices += (i ? ", " : "") + std::to_string(in_use[i]->device());
    return "; devices searched: " + (devices.empty() ? std::string("none") : devices) + " (" +
           std::to_string(n) + " of " + std::to_string(device_count_) +
           " device(s) have a streamsafe allocator)";
  };
  caching_allocator* owner = nullptr;
  if (n == 1) {
    owner = in_use[0];  // the common case: no lookup, the allocator diagnoses a bad pointer
  } else if (n > 1) {
    int current = -1;
    try {
      current = platform_.current_device();
    } catch (const std::exception&) {
    }
    if (current >= 0 && current < device_count_) {
      if (caching_allocator* a = existing(current); a && a->find_block(ptr).address != 0) owner = a;
    }
    for (std::size_t i = 0; !owner && i < n; ++i) {
      if (in_use[i]->device() != current && in_use[i]->find_block(ptr).address != 0)
        owner = in_use[i];
    }
  }
  if (owner) {
    try {
      op(*owner);
      return;
    } catch (const invalid_pointer& e) {
      throw invalid_pointer(e.what() + where());
    }
  }
  // Live nowhere: let each allocator diagnose it, preferring a specific diagnosis (double free,
  // interior pointer) over "unknown pointer". (One that succeeds had the block become live
  // meanwhile, through an allocation racing with this call.)
  std::string message;
  for (std::size_t i = 0; i < n; ++i) {
    try {
      op(*in_use[i]);
      return;
    } catch (const invalid_pointer& e) {
      const std::string m = e.what();
      if (message.empty() || m.find("unknown pointer") == std::string::npos) message = m;
    }
  }
  if (message.empty()) {
    message = std::string("streamsafe: ") + what + "(" + hex(ptr) +
              "): unknown pointer: nothing has been allocated yet";
  }
  throw invalid_pointer(message + where());
}

void allocator::deallocate(void* ptr) {
  route(ptr, "deallocate", [&](caching_allocator& a) { a.deallocate(ptr); });
}

void allocator::deallocate(void* ptr, cudaStream_t stream) {
  const stream_handle s = to_stream_handle(stream);
  route(ptr, "deallocate(stream)", [&](caching_allocator& a) { a.deallocate(ptr, s); });
}

void allocator::record_stream(void* ptr, cudaStream_t stream) {
  const stream_handle s = to_stream_handle(stream);
  route(ptr, "record_stream", [&](caching_allocator& a) { a.record_stream(ptr, s); });
}

ipc_handle allocator::export_block(void* ptr) {
  ipc_handle h;
  route(ptr, "export_block", [&](caching_allocator& a) { h = a.export_block(ptr); });
  return h;
}

std::size_t allocator::revoke_exports(void* ptr) {
  std::size_t n = 0;
  route(ptr, "revoke_exports", [&](caching_allocator& a) { n = a.revoke_exports(ptr); });
  return n;
}

void allocator::notify_import_released(const ipc_release& release) {
  const int device = ipc_release_device(release);
  check_device(device);
  caching_allocator* a = existing(device);
  if (!a) {
    throw ipc_error("streamsafe: notify_import_released: device " + std::to_string(device) +
                    " has no allocator here, so it exported nothing (unknown handle)");
  }
  a->notify_import_released(release);
}

imported_block allocator::import_block(const ipc_handle& handle) {
  return import_block(handle, platform_.current_device());
}

imported_block allocator::import_block(const ipc_handle& handle, int device) {
  check_device(device);
  return get_or_create(device).import_block(handle);
}

ipc_release allocator::release_import(void* ptr, cudaStream_t stream) {
  const stream_handle s = to_stream_handle(stream);
  for (int d = 0; d < device_count_; ++d) {
    if (caching_allocator* a = existing(d); a && a->is_import(ptr))
      return a->release_import(ptr, s);
  }
  throw ipc_error("streamsafe: release_import(" + hex(ptr) +
                  "): not an import of any device's allocator (unknown pointer)");
}

int allocator::owner_device(const void* ptr) const noexcept {
  for (int d = 0; d < device_count_; ++d) {
    if (caching_allocator* a = existing(d); a && a->find_block(ptr).address != 0) return d;
  }
  return -1;
}

std::size_t allocator::empty_cache() {
  std::size_t released = 0;
  std::exception_ptr first_error;
  for (int d = 0; d < device_count_; ++d) {
    if (caching_allocator* a = existing(d)) {
      try {
        released += a->empty_cache();
      } catch (...) {
        if (!first_error) first_error = std::current_exception();
      }
    }
  }
  if (first_error) std::rethrow_exception(first_error);
  return released;
}

// Sums f(a) over the devices' allocators made so far; the first error is rethrown after all ran.
template <class F>
std::size_t allocator::sum_over_devices(F&& f) {
  std::size_t total = 0;
  std::exception_ptr first_error;
  for (int d = 0; d < device_count_; ++d) {
    if (caching_allocator* a = existing(d)) {
      try {
        total += f(*a);
      } catch (...) {
        if (!first_error) first_error = std::current_exception();
      }
    }
  }
  if (first_error) std::rethrow_exception(first_error);
  return total;
}

std::size_t allocator::empty_cache(std::string_view tag) {
  return sum_over_devices([&](caching_allocator& a) { return a.empty_cache(tag); });
}

std::size_t allocator::trim(std::size_t bytes_to_keep) {
  return sum_over_devices([&](caching_allocator& a) { return a.trim(bytes_to_keep); });
}

std::size_t allocator::reclaim() {
  std::size_t released = 0;
  std::exception_ptr first_error;
  for (int d = 0; d < device_count_; ++d) {
    if (caching_allocator* a = existing(d)) {
      try {
        released += a->reclaim();
      } catch (...) {
        if (!first_error) first_error = std::current_exception();
      }
    }
  }
  if (first_error) std::rethrow_exception(first_error);
  return released;
}

statistics allocator::stats(int device) const {
  check_device(device);
  if (caching_allocator* a = existing(device)) return a->stats();
  return {};
}

void allocator::notify_stream_destroyed(cudaStream_t stream) {
  if (is_special_stream(stream) || device_count_ == 0 || devices_in_use() == 0) return;
  notify_stream_destroyed(stream, platform_.stream_device(to_stream_handle(stream)));
}

void allocator::notify_stream_destroyed(cudaStream_t stream, int device) {
  if (is_special_stream(stream)) return;
  check_device(device);
  if (caching_allocator* a = existing(device)) a->notify_stream_destroyed(to_stream_handle(stream));
}

std::uint64_t allocator::notify_capture_begin(cudaStream_t stream) {
  return notify_capture_begin(stream, 0);
}

std::uint64_t allocator::notify_capture_begin(cudaStream_t stream,
                                              std::uint64_t share_pool_of_graph) {
  const stream_handle h = to_stream_handle(stream);
  if (h == 0)
    return device_allocator(current_device())
        .notify_capture_begin(h, share_pool_of_graph);  // throws: stream 0
  return device_allocator(platform_.stream_device(h)).notify_capture_begin(h, share_pool_of_graph);
}

std::uint64_t allocator::notify_capture_end(cudaStream_t stream) {
  const stream_handle h = to_stream_handle(stream);
  const int device = h == 0 ? current_device() : platform_.stream_device(h);
  return device_allocator(device).notify_capture_end(h);
}

void allocator::notify_graph_released(std::uint64_t graph, int device) {
  check_device(device);
  device_allocator(device).notify_graph_released(graph);
}

}  // namespace streamsafe::cuda
