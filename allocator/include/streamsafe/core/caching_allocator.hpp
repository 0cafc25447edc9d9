// streamsafe: the caching allocator of one device.
//
// A block-caching allocator over a device_backend. Blocks are carved from segments; each
// segment belongs to one stream's pool (small: requests up to 1 MiB, large: above). Free
// blocks are kept in best-fit order and merged with free neighbours.
//
// Stream-ordering contract:
//  * allocate(size, s): the block may be used on stream s at once (stream order). If the block
//    last served other streams, s has been made to wait on them (cudaStreamWaitEvent); the host
//    never blocks for that.
//  * Using a block on another stream t requires record_stream(p, t) before the free, unless
//    the caller orders t before any later use on s itself (as FSDP2 does); the default release
//    fence (all_streams) also covers such unrecorded uses on streams the allocator has seen.
//  * deallocate(p): the last use is on the allocation stream or on recorded streams.
//    deallocate(p, t): the last use is on stream t (stream-ordered free).
//  * Memory goes back to the driver (empty_cache, out-of-memory retry, destruction) only after
//    a fence, one event per covered stream recorded at release time, has completed.
//  * CUDA graph capture (case K11): while a stream of the device captures, the allocator makes
//    no releasing, synchronising or event-query call and no stream wait; see
//    notify_capture_begin below and docs/reliability.md.
//
// Alignment: every block is aligned to 512 bytes. Sizes are rounded up to a multiple of 512.
// Thread safety: every public member may be called from any thread; one mutex guards the
// allocator's state, one lock per stream its pools (a spin lock), and
// none is ever held across a host-blocking driver call (synchronize_event, synchronize_device,
// a free_segment that synchronises).
// Errors: see core/errors.hpp. Every throw leaves state and statistics unchanged.
// cudaStreamPerThread (a handle the backend marks with stream_is_per_thread), passed to any call
// below, names the calling thread's own per-thread stream: a stream of its own to the allocator,
// fenced from other threads through the legacy default stream (docs/design.md, Stream handles).
#pragma once

#include <streamsafe/backends/device_backend.hpp>
#include <streamsafe/core/errors.hpp>
#include <streamsafe/core/ipc.hpp>
#include <streamsafe/core/options.hpp>
#include <streamsafe/core/pool_checkpoint.hpp>
#include <streamsafe/core/sleep.hpp>
#include <streamsafe/core/snapshot.hpp>
#include <streamsafe/core/statistics.hpp>
#include <streamsafe/core/trace.hpp>

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

namespace streamsafe {

// Marks the calling thread, while it lives, as running a stream callback: a host function that
// CUDA runs on its own thread (cudaLaunchHostFunc) and that may make no CUDA call. Inside it
// no allocator call makes a backend call: a free is host bookkeeping only (as from any thread
// on the slow path), empty_cache returns 0 and leaves the release to the next ordinary call,
// and an allocation is served from cached free blocks only or throws std::logic_error at once.
// Nests; thread-local; costs one thread-local read on the paths it changes.
class callback_scope {
 public:
  callback_scope() noexcept;
  ~callback_scope();
  callback_scope(const callback_scope&) = delete;
  callback_scope& operator=(const callback_scope&) = delete;
  static bool active() noexcept;  // the calling thread is inside a callback_scope
};

class caching_allocator {
 public:
  // The backend must outlive the allocator. opts.backend selects how the core grows its pools:
  // cuda_malloc (one backend allocation per segment) or expandable (chunks mapped into one
  // reserved range per pool; throws config_error when the backend does not support it).
  caching_allocator(device_backend& backend, options opts);
  ~caching_allocator();  // releases every segment (waits on fences); live blocks are leaked
  caching_allocator(const caching_allocator&) = delete;
  caching_allocator& operator=(const caching_allocator&) = delete;

  // Returns a block of at least size_bytes, aligned to 512 bytes, usable on `stream` at once.
  // Throws invalid_size for 0, out_of_memory (PyTorch's wording first) when cached, queued and
  // in-flight memory of every stream and pool cannot serve it under the limit.
  // Blocking: allocate never blocks the host outside its out-of-memory path: memory queued for
  // release or pending other streams' work is reused behind a device-side wait, and a growth
  // past the peak gives idle memory back without waiting. The out-of-memory path waits, without
  // holding any lock: with options::empty_cache == wait on exactly the fenced streams; with
  // defer at most 1 s on the queued fences (case K8: a fenced stream may run a collective that
  // waits for work this thread has yet to enqueue: the wait ends, out_of_memory follows, naming
  // the bytes waiting behind fences and the streams still busy). In a callback_scope it makes
  // no backend call: it is served from cached free blocks or throws std::logic_error at once.
  void* allocate(std::size_t size_bytes, stream_handle stream);
  // Only what the allocator already holds for `stream`: a cached free block of the stream's
  // pool that fits (blocks whose uses on other streams have completed come back first), split
  // as allocate would. Never new memory, never a release of cached memory, never a host wait;
  // nullptr when nothing cached fits (or a capture is underway). An allocation that found no
  // memory elsewhere tries a pool this way (PyTorch: MemPool(use_on_oom=True)), so that the
  // pool keeps its cache when it cannot serve the request either.
  void* allocate_cached(std::size_t size_bytes, stream_handle stream);

  // Host free: the last use is on the allocation stream or on streams given to record_stream.
  // Throws invalid_pointer for a pointer this allocator did not hand out, a double free or an
  // interior pointer. Never blocks the host. Safe from a stream callback (case K16): a free
  // from a thread other than the one that last allocated on the block's stream, or inside a
  // callback_scope, makes no backend call (except, outside a callback_scope, to record a use on
  // the freeing thread's own per-thread stream, which only it can name); a block with uses on other
  // streams waits, unusable, until the next ordinary call that reaches the driver anyway (an
  // allocation that misses the cache, empty_cache, reclaim) records its events.
  void deallocate(void* ptr);
  // Stream-ordered free: the last use of the block is on `stream`.
  void deallocate(void* ptr, stream_handle stream);

  // Records that the block is used on `stream` (PyTorch's Tensor.record_stream). Throws
  // invalid_pointer when ptr is not an allocated block of this allocator.
  void record_stream(void* ptr, stream_handle stream);

  // Releases every cached block that is free to the driver, behind the release fence. In wait
  // mode the host waits on exactly the fence events (no lock held); in defer mode it never
  // blocks: each block whose own fence streams are idle now goes back, the rest is queued.
  // Blocks freed while other streams still use them (record_stream, a free on another stream)
  // are covered too: wait mode first waits on their use events (no lock held) and releases them
  // with the rest; defer mode leaves them pending and a later reclaim() releases their memory
  // once those events completed. Returns the bytes released by this call. Inside a callback_scope
  // it makes no backend call and returns 0: the release runs (never waiting) at the next ordinary
  // allocator call that reaches the driver (an allocation that misses the cache, reclaim,
  // empty_cache).
  std::size_t empty_cache();
  std::size_t empty_cache(empty_cache_mode mode);
  // Finishes queued (deferred) releases whose fences have completed, on the calling thread, and
  // retires completed cross-stream uses; while blocks that an empty_cache(defer) found pending
  // other streams' work remain, it also releases the cached free memory then, as
  // empty_cache(defer) (so what those blocks held goes back once they retired); never waits on a
  // fence (with the release worker on it waits for the worker's driver calls in flight, on memory
  // whose fence has completed). Returns the bytes released by this call.
  std::size_t reclaim();
  // Finishes every release empty_cache queued (defer mode, or the out-of-memory path): the
  // host waits, with no lock held, on their fences, gives them back and waits for the release
  // worker's driver calls in flight; cached memory that no call asked to release stays cached,
  // and blocks an empty_cache(defer) found pending other streams' work go back once those
  // events completed (as reclaim). For callers that must see the release done before they go
  // on (the PyTorch extension's snapshot while the memory history is recorded). Inside a
  // callback_scope or while a graph is captured it returns 0 and waits for nothing. Returns
  // the bytes released by this call.
  std::size_t finish_releases();
  // Bytes waiting in the deferred-release queue, plus those the release worker is giving back
  // to the driver right now (statistics: release_queued_bytes, release_worker_bytes).
  std::size_t pending_release_bytes() const;

  // ---- release worker (options::release_worker) -------------------------------------------
  // With the worker on, empty_cache in defer mode (also the releases of allocate's slow path)
  // fences and queues the whole batch and returns 0 at once: no unmap or free_segment runs on
  // the calling thread. A thread of this allocator (started by the first such release, joined
  // by the destructor) polls the fences, never waiting on one and making no call while a graph
  // capture is underway, and gives back each part whose fence streams are idle; a failed driver
  // call puts that memory back in its pool (logged) and the worker goes on. An allocation that
  // cannot be served otherwise waits, no lock held, for the worker's pass and release in flight
  // before out_of_memory; empty_cache(wait) and reclaim() wait for the release in flight too.
  // reclaim() stays synchronous and never blocks on a fence. A forked child has no worker
  // (synchronous there). True when no bytes are queued and nothing is in flight (also when the
  // worker is off); addresses of reclaimed memory may still wait for their unmap.
  bool release_worker_idle() const;
  // Wakes the worker and waits until it has finished a pass over the queue begun after this
  // call (everything whose fence had completed is back with the driver) with nothing in flight;
  // memory behind fences still pending stays queued. False on timeout; true at once when there
  // is no worker. For tests and benchmarks.
  bool wait_for_release_worker_idle(std::chrono::nanoseconds timeout);

  // Tells the allocator a stream is gone: it is dropped from fences; cached blocks of its
  // pool stay cached and are reused by other streams only behind an event wait.
  // Call it before the stream is destroyed (cudaStreamDestroy), and always before its handle
  // value may name a new stream: blocks waiting for a stream are retired in batches, where one
  // completed event on a handle proves every older event recorded on that handle; a handle
  // reused without this call would let the new stream's events vouch for the old stream's
  // pending work.
  void notify_stream_destroyed(stream_handle stream);

  // ---- CUDA graph capture (K11) -----------------------------------------------------------
  // notify_capture_begin(s): s is about to capture a graph (call it just before
  // cudaStreamBeginCapture; just after also works). Returns the graph's id (> 0). Until the
  // matching notify_capture_end, and while any other capture of the device is underway:
  //  * no releasing (free_segment, unmap), synchronising or event-query backend call is made,
  //    from any thread, and no stream waits on an event: empty_cache and reclaim return 0 (an
  //    empty_cache asked for runs in defer mode when the last capture ends), the out-of-memory
  //    path neither releases nor moves segments, and the deferred queue waits;
  //  * allocate(n, s) is served from the graph's private pool: blocks freed earlier in this
  //    capture (stream order inside the graph puts their old uses first) or new device memory
  //    (the only backend call allowed; the CUDA backends make it capture-safe). Cached memory
  //    from before the capture is not used: its old uses do not provably precede the graph's
  //    replays. A side stream that joined the capture (it waited on an event recorded in it;
  //    the backend's capture_id tells) is the capture's too: served from the graph's private
  //    pool, new memory first, else a cached block behind a wait on the capturing stream inside
  //    the capture; the block records it as a use. Other streams are served from their own free
  //    blocks or new memory. Otherwise
  //    out_of_memory, the normal error, and the capture stays valid;
  //  * a free whose block's stream, recorded uses or free stream is capturing, of a block that
  //    is not in this capture's own pool (the stream's ordinary pool, or another graph's private
  //    pool), completes when the graph is released (the graph may replay over it); otherwise a
  //    free that needs events (recorded uses, or a stream-ordered free on another stream)
  //    completes when no capture is underway, or, for a block of the capture's own pool whose
  //    other uses are side streams of the capture, as soon as the capturing stream follows their
  //    work inside the capture (they joined back: backend capture_follows), when it serves that
  //    stream again. Either counts as allocated until then
  //    (held_free_count()). One rule for every pool.
  // Blocks allocated during the capture belong to the graph's private pool for good: freed, also
  // after the capture, they return to it and serve no one else, so replays never race with other
  // users. Memory used by a graph but allocated before its capture must stay allocated while the
  // graph may replay (the allocator cannot see which blocks a graph reads).
  // Before the capture counts (no capture underway on the device, s not capturing yet), the free
  // memory of released graphs' pools goes back to the driver behind its fence on every known
  // stream, in the empty_cache mode configured (wait: the host waits on exactly those events,
  // with no lock held), so that the capture, which cannot release, can grow into it.
  // Throws std::invalid_argument for stream 0 or a stream already capturing. Waits (without the
  // lock) for a fence wait or release that another thread has in flight. Thread-safe.
  // Without the call, the allocator detects a capture on its slow paths (allocation growth,
  // empty_cache, reclaim) by asking the backend about each stream it knows; the fast path makes
  // no driver call, so a capture that the allocator has not seen yet may be served from cache.
  std::uint64_t notify_capture_begin(stream_handle stream);
  // As above, the capture allocating into the private pool of graph share_pool_of_graph (0: a
  // new pool of its own), as PyTorch's torch.cuda.graph(pool=...) shares one pool between
  // captures: blocks the earlier graphs freed serve this one. The caller promises what PyTorch
  // asks of a shared pool: the graphs replay one after another, never concurrently. The pool
  // goes back once every graph sharing it is released. Throws std::invalid_argument for an
  // unknown or released graph.
  std::uint64_t notify_capture_begin(stream_handle stream, std::uint64_t share_pool_of_graph);
  // The capture on s has ended (call it after cudaStreamEndCapture, whether or not that
  // succeeded). Returns the graph's id. When no capture remains on the device, held frees
  // complete and an empty_cache asked for during the capture runs (defer mode). Throws
  // std::invalid_argument when no capture is underway on s.
  std::uint64_t notify_capture_end(stream_handle stream);
  // The graph (and every executable graph instantiated from it) will not be launched again.
  // Its private pool's free segments become releasable by empty_cache and the out-of-memory
  // path, fenced on every stream the allocator knows (replays still running there are waited
  // for; a graph launched on a stream the allocator never saw needs the `device` fence scope or
  // a synchronisation first); frees held for it complete behind events on every known stream.
  // A pool shared between graphs is released with the last of them. Releasing a graph whose
  // released pool still holds live blocks logs a warning naming the graph and the bytes: those
  // blocks stay allocated and return to the released pool when freed.
  // During another capture it takes effect when that capture ends. Throws std::invalid_argument
  // for an unknown or already released id, or a graph still being captured.
  void notify_graph_released(std::uint64_t graph);
  // ---- allocation into a graph's private pool outside a capture ----------------------------
  // begin_allocate_to_graph_pool(graph, filter) opens a route, as PyTorch's beginAllocateToPool
  // outside a capture (torch.compile's cudagraph trees run eager code between captures into the
  // graph's pool). Until end_allocate_to_graph_pool(route), allocate(n, s) on any thread is served
  // from the private pool of `graph` (the pool its capture allocated into, shared pools too) when
  // filter(s) is true (the innermost open route whose filter takes s wins; a capture on s is
  // served by its own graph's pool first). `s` is the handle the caller passed (a thread filter
  // may ignore it and test the calling thread instead). The filter runs under the allocator's
  // lock: it must be cheap and must not call the allocator. A routed block belongs to the pool
  // like a block allocated in the capture: it is in the pool's checkpoint, its statistics and
  // snapshot segments (graph_pool), is freed back into the pool, and restore_graph_pool frees it.
  // Stream order: a cached block of the pool serves s only behind a device-side wait of s on
  // the pool's stream (the capturing stream: one event); s becomes a use of the block, so its
  // free waits for s's work. While a capture is underway a routed allocation is served from new
  // memory only (no event may be recorded then). The caller promises what a shared pool asks: the
  // routed work and the graph's replays do not run concurrently (cudagraph trees order them).
  // An open route counts as a user of the pool: the pool is released (notify_graph_released)
  // only once its graphs are released and its routes ended. Returns the route's id (> 0).
  // Throws std::invalid_argument for an unknown graph or one whose pool is released, or an empty
  // filter. Thread-safe.
  using stream_filter = std::function<bool(stream_handle)>;
  std::uint64_t begin_allocate_to_graph_pool(std::uint64_t graph, stream_filter filter);
  // Ends the route; blocks allocated through it stay the pool's. Throws std::invalid_argument for
  // an unknown or already ended route.
  void end_allocate_to_graph_pool(std::uint64_t route);
  // True while a capture is underway on the device (announced or detected). Lock-free.
  bool capture_underway() const noexcept;
  // Frees made during a capture that have not completed yet.
  std::size_t held_free_count() const;
  // checkpoint_graph_pool(graph): the layout of the private pool that graph allocates into
  // (core/pool_checkpoint.hpp; a shared pool is the pool of each of its graphs). Throws
  // std::invalid_argument for an unknown graph or one whose pool is released.
  pool_checkpoint checkpoint_graph_pool(std::uint64_t graph) const;
  // restore_graph_pool(c): the pool's blocks become c's layout again, at the same addresses:
  // every block of the pool allocated now is freed, as deallocate would (a block with uses on
  // other streams keeps them: it waits for their events before its memory serves anyone), and
  // each block allocated in c is allocated again (its memory still pending other streams' work:
  // the pool's stream waits on those events, on the device, and the streams stay uses of the
  // block, fenced at its next free); the rest of c's segments is free. Statistics count the
  // frees and allocations. The caller owns the blocks allocated (freed with deallocate) and
  // must stop using those freed. Throws std::logic_error, with nothing changed, during a graph
  // capture, when a segment of c is gone or no longer the pool's, or when a block of the pool
  // cannot be freed or taken now (a free held by a capture or an IPC export, memory paused or
  // being released, unmapped since, or pending frees whose events are not recorded yet);
  // std::invalid_argument for an unknown or released graph. Thread-safe.
  pool_restore restore_graph_pool(const pool_checkpoint& checkpoint);

  // ---- tags and sleep/wake (core/sleep.hpp, docs/sleep.md) --------------------------------
  // pause(tag, mode): every mapped chunk of the tag's segments (its live blocks and its cached
  // free blocks) goes back to the driver behind the release fence of the streams that may touch
  // it (options::release_fence, as for empty_cache; `device` fences every known stream), and
  // the virtual address ranges stay reserved: live pointers stay valid, and a kernel touching
  // them while paused faults (an illegal address, never another tag's memory). Offload: each
  // live block is first copied to pinned host memory on the allocator's copy stream, which
  // waits on the device for the fence; a chunk is unmapped once its copy has completed. From the
  // call until resume returns, allocating under the tag throws tag_paused; frees of its blocks
  // work throughout. `how`: wait returns once everything is back (the host waits on exactly the
  // fence events and copies, no lock held); defer never blocks: with the release worker on
  // everything is left to it, otherwise what is ready now goes back and later calls (reclaim,
  // tag_status, pause again) finish it. Pausing a tag that is pausing or paused is a no-op that
  // returns its status; a tag this allocator holds no memory of is paused at once (0 bytes).
  // Throws config_error (a bad name; a backend other than expandable; offload with no host
  // backend), std::logic_error (in a stream callback; during a graph capture), backend_error.
  pause_status pause(std::string_view tag, pause_mode mode);  // how = options::empty_cache
  pause_status pause(std::string_view tag, pause_mode mode, empty_cache_mode how);
  // resume(tag): new memory is mapped at the addresses of every chunk the pause gave back (the
  // hook runs after), offloaded contents are copied back on the copy stream, and every stream
  // owning a segment of the tag, and `also_order` if given, waits on the device for that copy:
  // work enqueued on them after the call sees the contents; other streams must be ordered after
  // one of them by the caller. Chunks a deferred pause had not given back yet are kept as they
  // are. Returns at once for a tag that is active or unknown (a no-op). Out of memory: the
  // segments that could not be mapped stay paused and out_of_memory names the bytes; resume
  // again once memory is free. Host time: the map calls (one per chunk); nothing waits for the
  // device.
  pause_status resume(std::string_view tag);
  pause_status resume(std::string_view tag, stream_handle also_order);
  // As resume, off the caller's thread: with the release worker running, the call hands the
  // mapping and the restore to it and returns at once (phase resuming; allocation under the
  // tag still throws tag_paused). wait_resumed(tag) returns once it is done (or at the
  // timeout); only then are the streams ordered after the restore, so enqueue work on the
  // tag's memory after wait_resumed. Out of memory on the worker leaves the tag paused and
  // names the bytes in tag_status().error. Without a worker it is resume().
  pause_status resume_async(std::string_view tag);
  pause_status resume_async(std::string_view tag, stream_handle also_order);
  pause_status wait_resumed(std::string_view tag, std::chrono::nanoseconds timeout);
  // The tag's phase and bytes; moves a deferred pause along when no worker does (never waits).
  pause_status tag_status(std::string_view tag);
  // Called before each unmap and after each map of pause and resume (core/sleep.hpp).
  void set_sleep_hook(sleep_hook hook);
  // The tag's cached free memory back to the driver, as empty_cache() (options::empty_cache
  // mode); a paused tag's memory is left alone. Returns the bytes released by this call.
  std::size_t empty_cache(std::string_view tag);
  // The cached free memory of untagged allocations only (every tag's memory is left alone), as
  // empty_cache(tag) does for one tag. Returns the bytes released by this call.
  std::size_t empty_cache_untagged();
  // Gives cached free memory back, largest first, until at most bytes_to_keep bytes of reserved
  // memory are free (reserved - allocated), as empty_cache() otherwise. Returns the bytes
  // released by this call (queued bytes in defer mode are not counted).
  std::size_t trim(std::size_t bytes_to_keep);
  // Empties the pinned host cache that offload keeps for the next pause (waits on its fences).
  std::size_t release_host_cache();
  // ---- interprocess sharing (IPC; core/ipc.hpp has the protocol, docs/reliability.md) -------
  // Producer. export_block(p): a handle another process opens with import_block; p must be a
  // live block's start (invalid_pointer otherwise: freed, interior, unknown). Each call is one
  // export (one consumer) and raises p's export count; the block's memory is shared, not copied.
  // While p has an export not yet ended, deallocate(p) is held: p stays allocated, is neither
  // reused nor released (empty_cache, the out-of-memory path), and the free completes once every
  // export has ended. An export ends when notify_import_released has delivered its consumer's
  // release and the consumer's event (recorded on the consumer's stream) has been seen complete:
  // polled, never waited on, by notify_import_released, reclaim, empty_cache and the allocation
  // slow path's releases; empty_cache in wait mode waits (no lock held) on the consumer events of
  // released exports of freed blocks. allocate and deallocate never wait on them (but for the
  // out-of-memory retry with empty_cache == wait, as for every fence). Throws ipc_error
  // during a CUDA graph capture, backend_error when the backend cannot export (the simulated
  // device and both CUDA backends can). Makes backend calls: not from a stream callback.
  ipc_handle export_block(void* ptr);
  // The consumer's release message of one of this allocator's exports. Throws ipc_error for a
  // message of another allocator or process, an unknown export, or one already released/ended.
  void notify_import_released(const ipc_release& release);
  // Ends every export of p at once, released or not (a consumer that died without releasing; the
  // caller asserts no consumer still touches p). Returns how many ended; a held free of p then
  // completes. Throws invalid_pointer when p is not a live (or held) block.
  std::size_t revoke_exports(void* ptr);
  // Consumer. import_block(h): maps the exported block in this process (on this allocator's
  // device); the descriptors a received handle names are closed by it. Throws ipc_error for a
  // malformed handle or one imported here already, during a capture; backend_error when the
  // driver refuses (e.g. the handle's process is gone).
  imported_block import_block(const ipc_handle& handle);
  // Records the export's interprocess event on `stream` (call after enqueueing the last use of
  // the import there) and returns the message for the producer's notify_import_released. The
  // mapping is closed by this allocator once that event has completed (polled by reclaim,
  // empty_cache, import_block, and waited for by the destructor). Throws ipc_error for a pointer
  // that is not an open import (unknown, or released already), during a capture.
  ipc_release release_import(void* ptr, stream_handle stream);
  struct ipc_counts {
    std::size_t exports = 0;     // producer: exports not yet ended
    std::size_t held_frees = 0;  // producer: frees of exported blocks waiting for their exports
    std::size_t imports = 0;     // consumer: imports open (not released)
    std::size_t closing = 0;     // consumer: released imports whose event has not completed
  };
  ipc_counts ipc_status() const;
  // True when ptr is an import of this allocator, open or released and not yet closed.
  bool is_import(const void* ptr) const;

  statistics stats() const;
  void reset_peak_stats();

  // Every segment and block with address, size, stream and state (active, pending free with
  // the streams it waits for, inactive, unmapped, releasing), and the statistics, taken
  // atomically (all locks held). See core/snapshot.hpp for the JSON form.
  memory_snapshot snapshot() const;

  // The trace: alloc, free_requested, free_completed, segment_alloc / free / map / unmap,
  // release_deferred and oom events go to `recorder` (a bounded ring, core/trace.hpp), which
  // must outlive the allocator or be detached with nullptr. The allocator owns one when
  // options::trace_capacity is set; trace() returns the one in use (nullptr when off).
  // Tracing off costs one pointer test per call.
  void set_trace_recorder(trace_recorder* recorder) noexcept;
  const trace_recorder* trace() const noexcept;
  std::size_t largest_free_block_bytes() const;
  int device() const noexcept;
  // The options in use: those given at creation, with the runtime options as last set.
  options config() const;
  // Changes max_split_size_bytes, garbage_collection_threshold and roundup_power2_divisions
  // for the allocations that follow (PyTorch's _set_allocator_settings); blocks already cached
  // stay as they are, split or whole. A bad value throws config_error and changes nothing. Any
  // thread, any time; an allocation running at the same moment sees the old or the new value
  // of each option.
  void set_runtime_options(const runtime_options& r);

  // Checks every internal invariant (bytes conserved, block lists consistent, pools hold
  // exactly the free blocks, no block in two places); throws std::logic_error naming the
  // first violation. For tests.
  void check_invariants() const;

  // Where ptr lies: the block's address and size, or {0,0} if not allocated here.
  struct block_info {
    std::uintptr_t address = 0;
    std::size_t size_bytes = 0;
    stream_handle stream = 0;
  };
  block_info find_block(const void* ptr) const;  // ptr: the block's start
  // The allocated block holding ptr, which may point inside it ({0,0} when none does).
  block_info find_block_containing(const void* ptr) const;

 private:
  pause_status resume_impl(std::string_view tag, const stream_handle* also_order);
  std::size_t empty_cache_of_tag(tag_id id);  // trim.cpp; 0: untagged memory
  pause_status resume_async_impl(std::string_view tag, const stream_handle* also_order);

  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace streamsafe
