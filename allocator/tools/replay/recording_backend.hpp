// streamsafe-replay: recording_backend, a device_backend that forwards every call to another
// backend and notes the memory calls: segment_alloc / segment_free (allocate_segment /
// free_segment), segment_map / segment_unmap (map / unmap), and the address ranges reserved for
// expandable segments. It gives the replay tool what the allocator does not yet report itself:
// the segment operations for the trace, reserved bytes after every step (for the plot), and
// the segments and mapped ranges for a memory_snapshot at the peak. It is a stand-in: once the
// core records into a trace_recorder and offers caching_allocator::snapshot(), the tool takes
// both from the core and this class goes away.
//
// Attribution: the backend does not know which stream or request caused a call, so the tool
// sets a context (time, trace stream, small or large request) before each allocator call; the
// calls made during it are stamped with that context.
// Invariant: reserved_bytes() == sum of live segments + mapped bytes of expandable ranges,
// which equals the allocator's reserved_bytes.current between calls.
// Thread safety: mu_ guards everything recorded; forwarded calls run without it.
#pragma once

#include <streamsafe/backends/forwarding_backend.hpp>
#include <streamsafe/core/trace.hpp>

#include <cstdint>
#include <map>
#include <mutex>

namespace streamsafe::replay {

class recording_backend final : public forwarding_backend {
 public:
  struct segment_view {
    std::uintptr_t base = 0;
    std::size_t size_bytes = 0;
    bool expandable = false;                       // a reserved range: only `mapped` is backed
    stream_handle stream = 0;                      // trace stream of the request that created it
    bool small = false;                            // created for a request of at most 1 MiB
    std::map<std::uintptr_t, std::size_t> mapped;  // expandable: address -> bytes, one per map()
  };
  struct counts {
    std::uint64_t segment_allocs = 0, segment_frees = 0, maps = 0, unmaps = 0;
  };

  explicit recording_backend(device_backend& inner) : forwarding_backend(inner) {}

  // The allocator call about to run: its trace time, trace stream and size class.
  void set_context(std::uint64_t time_us, stream_handle trace_stream, bool small_request) noexcept;
  // Where segment operations are recorded (nullptr: nowhere). The recorder must outlive its use.
  void set_recorder(trace_recorder* recorder) noexcept;

  std::int64_t reserved_bytes() const;
  counts operation_counts() const;
  std::map<std::uintptr_t, segment_view> segments() const;  // a copy, by base address

  // ---- device_backend: the segment calls are recorded, the rest forwarded -----------------
  void* allocate_segment(std::size_t size_bytes) override;
  void free_segment(void* base, std::size_t size_bytes) override;
  void* reserve_address_range(std::size_t size_bytes) override;
  void release_address_range(void* base, std::size_t size_bytes) override;
  bool map(void* addr, std::size_t size_bytes) override;
  void unmap(void* addr, std::size_t size_bytes) override;

 private:
  void note_locked(trace_action action, std::uintptr_t address, std::size_t size);
  segment_view* range_containing_locked(std::uintptr_t address);

  mutable std::mutex mu_;
  std::map<std::uintptr_t, segment_view> segments_;  // guarded by mu_
  std::int64_t reserved_ = 0;                        // guarded by mu_
  counts counts_;                                    // guarded by mu_
  trace_recorder* recorder_ = nullptr;               // guarded by mu_
  std::uint64_t time_us_ = 0;                        // guarded by mu_
  stream_handle stream_ = 0;                         // guarded by mu_
  bool small_ = false;                               // guarded by mu_
};

}  // namespace streamsafe::replay
