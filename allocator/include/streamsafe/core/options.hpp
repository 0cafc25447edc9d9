// streamsafe: the allocator's options, in one place.
//
// Filled from code or from a configuration string of the shape PyTorch users know,
// "key:value,key:value" (environment variable STREAMSAFE_ALLOC_CONF). options::parse() throws
// config_error naming the bad key or value and what is accepted; when a key appears twice the
// last one wins and a warning says so.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace streamsafe {

// Which streams a release fence covers before memory goes back to the driver.
enum class fence_scope {
  used_streams,       // allocation stream + streams recorded with record_stream / stream frees
  all_streams,        // every stream the allocator has seen on the device (default, safe)
  device,             // a device-wide synchronisation
  allocation_stream,  // only the segment's own stream: PyTorch expandable segments; UNSAFE
};

// What empty_cache (and the out-of-memory and garbage-collection releases of allocate) do with
// memory whose fence has not completed.
enum class empty_cache_mode {
  wait,   // wait (host, no lock held) on exactly the fence events, then release
  defer,  // never block the host: release what is safe now, queue the rest (still memory:
          // reused first, behind device-side waits); later calls / reclaim() / the worker
          // finish it; allocate's out-of-memory path waits at most 1 s on it (case K8)
};

enum class backend_kind { cuda_malloc, expandable };

// Who gives memory back to the driver in defer mode (release_worker.cpp).
enum class release_worker_mode {
  off,        // the calling thread: empty_cache releases what is safe now, later calls the rest
  on,         // a worker thread per allocator: empty_cache(defer) queues, the worker unmaps
  automatic,  // "auto": on when empty_cache is defer and the device is a real GPU, else off.
              // The core cannot tell a real device: caching_allocator treats auto as off;
              // cuda::allocator over a real CUDA platform (platform::cuda(), the PyTorch
              // integration) resolves it to on in defer mode; simulated platforms to off.
};

// Which streams a host free (deallocate without a stream) is fenced against before its block is
// reused. Uses the allocator was told about (record_stream, stream-ordered frees) are fenced in
// both cases; the choice is about uses nobody recorded.
enum class reuse_fence_scope {
  allocation_stream,  // the block's own stream only: reused at once on it (PyTorch; default)
  all_streams,        // every stream the allocator knows on the device, one event per stream per
                      // batch of host frees, recorded when the allocation stream reuses the batch
};

// PyTorch's roundup_power2_divisions: how many equal steps a size between two powers of two
// rounds up to, per size interval. Interval 0 holds every size below 2 MiB, interval i (1 to 14)
// the sizes from 2^i MiB to below 2^(i+1) MiB, interval 15 every size from 32 GiB. 0 or 1 in an
// interval: no rounding there beyond 512 B (as PyTorch). Written "4" (every interval) or as
// PyTorch's list "[256:1,512:2,1024:4,>:8]": boundary in MiB (a power of two) then divisions
// for its interval; the first entry also covers the intervals below it, ">" those after the
// last one named, and intervals named by neither stay 0.
struct power2_divisions {
  static constexpr std::size_t k_intervals = 16;
  std::array<std::size_t, k_intervals> by_interval{};

  power2_divisions() = default;
  // Every interval the same (0 = off). Implicit, so `o.roundup_power2_divisions = 4` reads as
  // it did when the option was one number.
  power2_divisions(std::size_t every_size) noexcept {  // NOLINT(google-explicit-constructor)
    by_interval.fill(every_size);
  }
  static std::size_t interval_of(std::size_t size_bytes) noexcept;
  std::size_t for_size(std::size_t size_bytes) const noexcept {
    return by_interval[interval_of(size_bytes)];
  }
  bool any() const noexcept;  // some interval rounds (divisions above 1)
  bool operator==(const power2_divisions& o) const noexcept { return by_interval == o.by_interval; }
  bool operator!=(const power2_divisions& o) const noexcept { return !(*this == o); }
};

struct options;

// The options PyTorch lets a program change while the allocator runs
// (torch.cuda.memory._set_allocator_settings): caching_allocator::set_runtime_options applies
// them to later allocations; blocks already cached stay as they are. The other options are
// fixed when the allocator is created.
struct runtime_options {
  std::size_t max_split_size_bytes = 0;     // 0 or at least 20 MiB
  double garbage_collection_threshold = 0;  // 0 (off) or a fraction in (0, 1)
  power2_divisions roundup_power2_divisions;
  bool graph_capture_record_stream_reuse = true;

  static runtime_options of(const options& o) noexcept;
  void apply_to(options& o) const noexcept;
  // Throws config_error naming the first bad value and what is accepted.
  void validate() const;
};

struct options {
  backend_kind backend = backend_kind::cuda_malloc;
  fence_scope release_fence = fence_scope::all_streams;
  empty_cache_mode empty_cache = empty_cache_mode::wait;
  // With `on`, empty_cache in defer mode returns at once (0 bytes): the whole batch is fenced
  // and queued, and a worker thread of the allocator unmaps / frees each part once its fence
  // has completed (polled, never waited on). Allocations that cannot be served otherwise wait
  // for the worker's release in flight before out_of_memory. reclaim() stays synchronous.
  release_worker_mode release_worker = release_worker_mode::automatic;
  // reuse_fence:all_streams protects a block read on a side stream without record_stream (a
  // device-to-host copy, a collective on a third stream) and then freed from the host.
  reuse_fence_scope reuse_fence = reuse_fence_scope::allocation_stream;
  // Blocks larger than this are never split (0 = no limit). PyTorch: max_split_size_mb.
  // Changeable at runtime (runtime_options), as the two below marked so.
  std::size_t max_split_size_bytes = 0;
  // cuda_malloc backend: a wholly free cached segment more than this many times a large request
  // (and more than 20 MiB bigger) is not split for it; the request takes the free remainder of
  // a split segment or a new segment of its own, so the big segment stays whole for a request of
  // its size. Before a growth that would raise peak reserved (and stay within the limit), the
  // whole free segments so refused, and those too small for the request, go back to the driver
  // behind their fence (empty_cache mode: wait, or defer) when together they are at least a
  // quarter of the new segment. 0 = off (PyTorch's placement); otherwise 1 to 1024. At the
  // memory limit the rule gives way. On the GPT-2 trace: peak reserved / peak allocated 1.035
  // instead of 1.079.
  std::size_t whole_segment_split_ratio = 8;
  // Cap on reserved bytes per device (0 = the device's total memory).
  std::size_t memory_limit_bytes = 0;
  // Fraction of device total memory as a cap (0 = unused); the smaller cap wins.
  double memory_fraction = 0.0;
  // Physical chunk mapped (and later unmapped) at a time in the large pools of expandable
  // segments, rounded up to the driver's granularity; small pools use the granularity (2 MiB).
  // A growth maps what the request lacks rounded up to the granularity: chunks of this size,
  // the last one the rest. PyTorch's expandable segments use 20 MiB pages for large pools.
  std::size_t expandable_chunk_bytes = std::size_t{20} << 20;
  // The chunk of a large-pool growth that raises reserved bytes above their high-water mark
  // (the most ever reserved at once), rounded up to the granularity, at most
  // expandable_chunk_bytes: the memory that sets the peak can later be unmapped this finely,
  // and memory mapped again below the mark (after empty_cache) still takes
  // expandable_chunk_bytes. 2 MiB trades driver calls for a lower peak (docs/observability.md,
  // "Finer chunks"); the default, 20 MiB, is one size for every growth.
  std::size_t expandable_peak_chunk_bytes = std::size_t{20} << 20;
  // A large-pool chunk is also at most 1/expandable_chunks_per_peak of the reserved bytes'
  // high-water mark (the allocator's, all pools together), or of what the growth raises reserved
  // to if more (rounded down to the granularity, at least one granule): an allocator whose peak
  // is small against 20 MiB chunks maps chunks small against it, one whose peak is 5 GiB or more
  // (with 256) keeps expandable_chunk_bytes. 0 (the default): off; 256 was chosen on the tuning
  // half of the trace corpus but raises the GPT-2 trace's ratio above PyTorch's
  // (docs/corpus.md, "The chunk against the peak").
  std::size_t expandable_chunks_per_peak = 0;
  // The largest physical handle in which resume maps a paused tag's memory again (rounded up to
  // the granularity, at least expandable_chunk_bytes): each stretch of a given-back run that
  // holds live blocks, and each free stretch of at least a chunk, is mapped in handles of up to
  // this size, so a pause and a resume of N bytes make about N / this many driver mappings each
  // way instead of N / expandable_chunk_bytes. A handle goes back to the driver only whole:
  // free memory inside a stretch that holds live blocks stays mapped until the whole handle is
  // free (docs/sleep.md, "Handles sized to the tag").
  // Default 1 GiB: on an H100 the GPU test (tests/backends/sleep_gpu_test.cpp, discard and
  // offload) passed whole, and the colocated example's switches halved (docs/sleep.md). 2 MiB
  // (never above the chunk) turns it off: resume maps the chunks growth mapped.
  std::size_t expandable_tag_handle_bytes = std::size_t{1024} << 20;
  // Offload keeps its pinned host backup between switches (true): a later pause copies into
  // host memory already pinned, and resume leaves it cached for that. False: once a resume's
  // restore copies have completed, the pinned host memory no longer holding a paused tag goes
  // back to the system (on the release worker, or on the caller's thread, which then waits for
  // the restore), and the next offload pins again. release_host_cache() does it by hand.
  bool offload_keep_host = true;
  // Round requests above 512 B up to one of this many steps per power of two (0 = off), as
  // PyTorch's roundup_power2_divisions: fewer distinct sizes, better reuse, more rounding. One
  // number for every size, or one per size interval (power2_divisions). Changeable at runtime.
  power2_divisions roundup_power2_divisions;
  // When taking memory from the driver would bring reserved bytes above this fraction of the
  // limit, first release the free cached segments behind a fence (0 = off). PyTorch's
  // garbage_collection_threshold, applied whenever the allocator grows. Changeable at runtime.
  double garbage_collection_threshold = 0.0;
  // A block freed during a CUDA graph capture whose other uses are side streams of the same
  // capture (record_stream) serves the capturing stream again, inside the capture, once that
  // stream follows those uses (the side streams joined back by an event wait); false: the free
  // is held until the capture ends. PyTorch's graph_capture_record_stream_reuse (whose default
  // is False). Changeable at runtime.
  bool graph_capture_record_stream_reuse = true;
  // When the allocator grows while more than this many cached (reserved, unallocated) bytes
  // sit in its pools, it first releases the free segments behind a fence (0 = no cap).
  std::size_t max_cached_bytes = 0;
  // Events kept in the allocator's own trace ring (0 = no trace).
  std::size_t trace_capacity = 0;

  // Parses "key:value,key:value". Unknown keys and bad values throw config_error.
  static options parse(std::string_view conf, std::vector<std::string>* warnings = nullptr);
  // Reads STREAMSAFE_ALLOC_CONF (defaults when unset).
  static options from_environment(std::vector<std::string>* warnings = nullptr);
  std::string to_string() const;
};

const char* to_string(fence_scope scope) noexcept;
const char* to_string(empty_cache_mode mode) noexcept;
const char* to_string(backend_kind kind) noexcept;
const char* to_string(release_worker_mode mode) noexcept;
const char* to_string(reuse_fence_scope scope) noexcept;

}  // namespace streamsafe
