// streamsafe core: construction and destruction of the caching allocator.
//
// The map of the core's files, one row each, is allocator/README.md; allocator_state.hpp holds
// the state, one member per concern, and the lock order. The constructor reads the device's memory
// and chooses the growth hook of the backend kind (growth/growth_hook.hpp), takes no lock (nothing
// is shared yet); the destructor runs destroy_all (destruction.cpp), which takes the device lock.
#include "core/allocator_impl.hpp"
#include "core/blocks/size_classes.hpp"
#include "core/common/logging.hpp"
#include "core/growth/growth_hook.hpp"

#include <algorithm>
#include <atomic>

namespace streamsafe {

namespace {

std::atomic<std::uint64_t> next_allocator_id{
    1};  // distinguishes allocators in the threads' stream caches

}  // namespace

caching_allocator::impl::impl(device_backend& backend, options opts)
    : diagnostics_layer(
          backend, opts,
          {next_allocator_id.fetch_add(1), current_fork_generation(), current_pid()}) {
  std::size_t free_bytes = 0;
  backend_.memory_info(free_bytes, limits_.device_total_bytes);
  limits_.limit_bytes = limits_.device_total_bytes;
  if (opts_.memory_limit_bytes != 0)
    limits_.limit_bytes = std::min(limits_.limit_bytes, opts_.memory_limit_bytes);
  if (opts_.memory_fraction > 0) {
    limits_.limit_bytes = std::min(
        limits_.limit_bytes,
        static_cast<std::size_t>(opts_.memory_fraction *
                                 static_cast<double>(limits_.device_total_bytes)));
  }
  if (opts_.backend == backend_kind::expandable) {
    if (!backend_.supports_expandable()) {
      throw config_error(
          std::string(
              "streamsafe: backend:expandable needs virtual memory management, which the '") +
          backend_.name() + "' device backend does not offer");
    }
    limits_.small_chunk_bytes = backend_.map_granularity_bytes();
    limits_.large_chunk_bytes = detail::round_up(
        std::max(opts_.expandable_chunk_bytes, limits_.small_chunk_bytes),
        limits_.small_chunk_bytes);
    limits_.peak_chunk_bytes = std::min(
        limits_.large_chunk_bytes,
        detail::round_up(std::max(opts_.expandable_peak_chunk_bytes, limits_.small_chunk_bytes),
                         limits_.small_chunk_bytes));
    limits_.chunks_per_peak = opts_.expandable_chunks_per_peak;
    growth_hook_ = growth_hook::for_expandable();
    // 0 (off: expandable_tag_handle_mb at or below the chunk): resume maps in the chunks growth
    // used.
    limits_.tag_handle_bytes = opts_.expandable_tag_handle_bytes > limits_.large_chunk_bytes
                                   ? detail::round_up(opts_.expandable_tag_handle_bytes,
                                                      limits_.small_chunk_bytes)
                                   : 0;
    if (opts_.expandable_peak_chunk_bytes > limits_.large_chunk_bytes) {
      detail::log().warn(
          "expandable_peak_chunk_mb:{} is above expandable_chunk_mb:{}; growths past the "
          "high-water mark of reserved bytes use {} MiB chunks",
          opts_.expandable_peak_chunk_bytes >> 20, limits_.large_chunk_bytes >> 20,
          limits_.large_chunk_bytes >> 20);
    }
  } else {
    growth_hook_ = growth_hook::for_cuda_malloc();
  }
  if (opts_.release_fence == fence_scope::allocation_stream) {
    detail::log().warn(
        "release_fence:allocation_stream is UNSAFE: memory used on other streams without "
        "record_stream may be "
        "released while that work still runs (PyTorch expandable-segment behaviour, kept to "
        "reproduce the race)");
  }
  detail::log().debug("device {}: {} backend, {}, limit {} bytes", backend_.device(),
                      backend_.name(), opts_.to_string(), limits_.limit_bytes);
  trace_log_ = detail::log().should_log(spdlog::level::trace);
  if (opts_.trace_capacity != 0) {
    own_trace_ = std::make_unique<trace_recorder>(opts_.trace_capacity);
    trace_.store(own_trace_.get());
  }
}

caching_allocator::impl::~impl() = default;  // here, where growth_hook is complete

caching_allocator::caching_allocator(device_backend& backend, options opts)
    : impl_(std::make_unique<impl>(backend, opts)) {}

caching_allocator::~caching_allocator() {
  if (impl_->inherited()) {
    (void)impl_.release();  // a forked child: nothing of the parent's is touched (fork.cpp)
    return;
  }
  impl_->destroy_all();
}

}  // namespace streamsafe
