// streamsafe: the simulated device, a deterministic CPU model of one GPU.
//
// Streams are FIFO queues of timed work items that read or write address ranges; events are
// markers in those queues; stream_wait_event makes a queue wait on a marker; a clock that the
// caller advances runs the queues. Nothing is computed: the device tracks which work is
// pending, the happens-before order between streams (vector clocks carried by events), the
// bytes written (so a test can read back which write landed last), and which address ranges
// are backed by memory. It records these faults:
//   release_under_pending_work  free_segment / unmap of memory that pending work touches
//                               (on a GPU: the illegal memory access of the unmap race);
//   cross_stream_race           a new use of memory on one stream while a use on another
//                               stream is pending and not ordered before it (one of them a
//                               write);
//   access_unmapped             work launched on memory that is not backed;
//   capture_violation           a call CUDA forbids while a stream of the device captures a
//                               graph (global capture mode): free_segment, unmap,
//                               release_address_range, query_event, synchronize_event,
//                               synchronize_device from any thread; a capturing stream waiting
//                               on an event recorded outside its capture; a stream outside the
//                               capture waiting on a captured event; a query or synchronisation
//                               of an event last recorded in a capture. As on a GPU the call
//                               fails (backend_error) and the capture is invalidated.
//   access_mismatch             map() of a chunk whose access set (the device and its peers,
//                               device_config::peers) differs from the other mapped chunks of
//                               its reserved range (K13; access_devices() answers per chunk).
// Graph capture: begin_capture(s) .. end_capture(s) record the kernels launched on s into a
// graph instead of running them (event records on s become captured events); a stream that
// waits on a captured event of a capture underway joins it (its launches go into the graph too,
// until end_capture(s), which only s may call); launch_graph
// enqueues the recorded kernels on a stream, checked like launches. allocate_segment and map
// stay legal during a capture (a CUDA backend makes them in relaxed capture mode).
// It implements device_backend, so the real caching allocator runs on it unchanged, and it can
// fail any backend call on demand (fault injection). Thread safety: every public call takes
// one internal mutex. Time is in microseconds of simulated time.
#pragma once

#include <streamsafe/backends/device_backend.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace streamsafe::sim {

enum class access { read, write };

struct range {
  std::uintptr_t begin = 0;
  std::size_t size_bytes = 0;
  access mode = access::read;
  std::optional<std::uint8_t> value;  // for writes: the byte value written when it completes
};

enum class fault_kind {
  release_under_pending_work,
  cross_stream_race,
  access_unmapped,
  capture_violation,
  // K13: map() gave a chunk an access set (the devices that may read and write it) other than
  // the one of the chunks already mapped in the same reserved range.
  access_mismatch
};

struct fault {
  fault_kind kind;
  std::string message;  // names the range, the streams and the work items
  std::uint64_t time_us = 0;
};

const char* to_string(fault_kind kind) noexcept;

// Backend calls that fault injection can make fail.
enum class call {
  allocate_segment,
  free_segment,
  reserve_address_range,
  release_address_range,
  map,
  unmap,
  create_event,
  record_event,
  query_event,
  synchronize_event,
  stream_wait_event,
  synchronize_device,
};

struct counters {
  std::uint64_t segment_allocs = 0, segment_frees = 0, maps = 0, unmaps = 0;
  std::uint64_t bytes_mapped = 0, bytes_unmapped = 0;
  std::uint64_t aliases = 0, bytes_aliased = 0;  // map_alias: memory mapped at a second address
  std::uint64_t events_created = 0, events_destroyed = 0, events_recorded = 0;
  std::uint64_t event_queries = 0, event_syncs = 0, stream_waits = 0, device_syncs = 0;
  std::uint64_t bounded_event_syncs = 0;  // synchronize_event_for calls (bounded host waits)
  std::uint64_t launches = 0;
  std::uint64_t capture_queries = 0, graph_launches = 0;
  std::uint64_t segment_allocs_during_capture = 0, maps_during_capture = 0;
  std::uint64_t ipc_exports = 0, ipc_imports = 0, ipc_closes = 0;
};

struct device_config {
  int device = 0;
  std::size_t total_bytes = std::size_t{80} << 30;
  std::size_t granularity_bytes = std::size_t{2} << 20;
  bool supports_expandable = true;
  // Model cudaFree: free_segment first waits until the device is idle (advancing the clock) and
  // throws backend_error, freeing nothing, when an unopened hold blocks that (the host would
  // deadlock).
  bool free_segment_synchronizes = false;
  // Model cudaMalloc handing out the address range of a freed segment again: allocate_segment
  // takes the lowest freed range that fits (first fit, the rest stays free) before fresh
  // addresses. Off: addresses are never handed out twice.
  bool reuse_freed_addresses = false;
  // Peer access (K13): the other devices of the machine. map() grants read/write access to this
  // device and to every peer with can_access (as the CUDA expandable backend does for each peer
  // cudaDeviceCanAccessPeer allows); a peer without it is left out and the map still succeeds.
  struct peer_device {
    int device = 0;
    bool can_access = true;
  };
  std::vector<peer_device> peers;
};

class simulated_device final : public device_backend {
 public:
  explicit simulated_device(device_config config = {});
  ~simulated_device() override;
  simulated_device(const simulated_device&) = delete;
  simulated_device& operator=(const simulated_device&) = delete;

  // ---- streams and work -----------------------------------------------------------------
  // Stream 0 (the legacy default stream) always exists. New handles are never reused unless
  // reuse_handles is set, which models a driver recycling handle values.
  stream_handle create_stream() override;
  void destroy_stream(stream_handle stream) override;  // pending work still runs; later use throws
  void set_reuse_stream_handles(bool reuse);
  // Enqueues a kernel that runs duration_us once it reaches the head of the stream; returns
  // its id. Checks cross_stream_race and access_unmapped at enqueue time. On a capturing
  // stream the kernel is recorded into the graph instead and 0 is returned.
  std::uint64_t launch(stream_handle stream, std::uint64_t duration_us, std::vector<range> ranges,
                       std::string label = {});
  // Enqueues a work item that never completes until open(id) is called (a "hold").
  std::uint64_t hold(stream_handle stream, std::string label = "hold");
  void open(std::uint64_t hold_id);
  bool completed(std::uint64_t work_id) const;
  bool stream_idle(stream_handle stream) const;

  // ---- CUDA graph capture -------------------------------------------------------------------
  // Starts capturing on `stream` (not 0, not already capturing): launches on it are recorded
  // into a graph; hold() on it throws std::logic_error.
  void begin_capture(stream_handle stream);
  // Ends the capture and returns the graph's id; throws backend_error (and returns no graph)
  // when a capture_violation invalidated the capture, as cudaStreamEndCapture does.
  std::uint64_t end_capture(stream_handle stream);
  bool capturing(stream_handle stream) const;
  // Enqueues the graph's kernels on `stream` in capture order (one replay); checked for
  // cross_stream_race and access_unmapped like launch(). Returns the id of the last item.
  std::uint64_t launch_graph(std::uint64_t graph, stream_handle stream);
  std::size_t graph_kernel_count(std::uint64_t graph) const;

  // ---- clock ------------------------------------------------------------------------------
  std::uint64_t now_us() const;
  void advance(std::uint64_t duration_us);
  // Advances until every queue is empty; throws std::logic_error if an unopened hold blocks.
  void run_until_idle();

  // ---- peer access (K13) --------------------------------------------------------------------
  // The devices that may access the mapped chunk holding addr, ascending (empty when unmapped).
  std::vector<int> access_devices(std::uintptr_t addr) const;
  // Fault model of a backend that sets access on some mappings only: the next `maps` map calls
  // leave `device` out of the access set. A chunk whose access set differs from the other mapped
  // chunks of its reserved range is reported at map() as fault_kind::access_mismatch.
  void omit_peer_on_next_maps(int device, int maps = 1);

  // ---- memory contents --------------------------------------------------------------------
  // The value of the last completed write covering addr (nullopt when none).
  std::optional<std::uint8_t> value_at(std::uintptr_t addr) const;
  bool is_mapped(std::uintptr_t addr, std::size_t size_bytes) const;
  std::size_t bytes_in_use() const;  // segments + mapped chunks
  // ---- pinned host memory ------------------------------------------------------------------
  // Host memory the device can copy to and from, in its own address window (not counted in
  // bytes_in_use or memory_info): host_backend() serves it as segments. free_host of memory
  // that pending work touches is a release_under_pending_work fault (case K18).
  void* allocate_host(std::size_t size_bytes);
  void free_host(void* base, std::size_t size_bytes);
  std::size_t host_bytes_in_use() const;

  // ---- faults, counters, injection --------------------------------------------------------
  std::vector<fault> faults() const;
  std::size_t fault_count() const;
  void clear_faults();
  sim::counters counters() const;
  // The next `count` calls of kind c fail: allocate_segment returns nullptr and map returns
  // false (out of memory); every other call throws backend_error.
  void fail_next(call c, int count = 1);

  // ---- device_backend -------------------------------------------------------------------
  int device() const noexcept override;
  const char* name() const noexcept override;
  void* allocate_segment(std::size_t size_bytes) override;
  void free_segment(void* base, std::size_t size_bytes) override;
  bool free_segment_synchronizes() const noexcept override;
  bool supports_expandable() const noexcept override;
  std::size_t map_granularity_bytes() const noexcept override;
  void* reserve_address_range(std::size_t size_bytes) override;
  void release_address_range(void* base, std::size_t size_bytes) override;
  bool map(void* addr, std::size_t size_bytes) override;
  void unmap(void* addr, std::size_t size_bytes) override;
  // Maps the memory of [from, from+size) at addr too (no new memory; bytes_in_use unchanged);
  // work on either range is checked against pending work on both (one memory).
  bool map_alias(void* addr, const void* from, std::size_t size_bytes) override;
  event_handle create_event() override;
  void destroy_event(event_handle event) noexcept override;
  void record_event(event_handle event, stream_handle stream) override;
  bool query_event(event_handle event) override;
  // Advances the clock until the event completes; throws backend_error if an unopened hold
  // blocks it (the host would wait forever).
  void synchronize_event(event_handle event) override;
  // Advances the clock until the event completes, at most timeout_us; false (no error) when it
  // has not completed by then or an unopened hold blocks it.
  bool synchronize_event_for(event_handle event, std::uint64_t timeout_us) override;
  void stream_wait_event(stream_handle stream, event_handle event) override;
  bool query_stream(stream_handle stream) override;  // stream_idle(); never blocks
  void synchronize_device() override;  // advances until idle (throws like run_until_idle)
  void memory_info(std::size_t& free_bytes, std::size_t& total_bytes) override;
  bool stream_is_capturing(stream_handle stream) noexcept override;
  std::uint64_t capture_id(stream_handle stream) noexcept override;  // the graph's id
  // {stream uid, its captured launches so far}; follows: the stream's captured events carried
  // at least that many of that stream's launches to it.
  std::vector<std::uintptr_t> capture_position(stream_handle stream) override;
  bool capture_follows(stream_handle stream, const std::vector<std::uintptr_t>& position) override;
  // A kernel that reads [src, src+bytes) and writes [dst, dst+bytes), checked like launch();
  // when it completes, dst holds what src held. Runs 1 us plus 1 us per MiB.
  void copy_async(void* dst, const void* src, std::size_t bytes, stream_handle stream) override;
  // Pinned host memory of this device (allocate_host), sharing its streams and events.
  device_backend* host_backend() noexcept override;
  // IPC, modelled in one process (both ends on this device): export_memory describes a mapped
  // range; import_memory returns a view at the same address (work launched on it by a consumer
  // stream is checked like any work; close_imported_memory under pending work that touches the
  // range is a release_under_pending_work fault); an opened IPC event is an alias of the
  // exported event (records through either are one event's).
  ipc_memory export_memory(std::uintptr_t segment_base, std::size_t segment_bytes,
                           std::uintptr_t addr, std::size_t size_bytes) override;
  std::uintptr_t import_memory(const ipc_memory& memory) override;
  void close_imported_memory(std::uintptr_t addr) override;
  event_handle create_ipc_event() override;
  std::vector<std::uint8_t> export_event(event_handle event) override;
  event_handle open_ipc_event(const std::vector<std::uint8_t>& bytes) override;
  void close_ipc_event(event_handle event) noexcept override;
  std::size_t open_import_count() const;  // views not closed

 private:
  class host_view;
  std::unique_ptr<host_view> host_;
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace streamsafe::sim
