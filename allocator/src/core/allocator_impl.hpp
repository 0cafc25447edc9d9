// streamsafe core: caching_allocator::impl (internal), one device's allocator: its state is
// detail::allocator_state (allocator_state.hpp, with the lock order), its lower concerns a chain
// of layers over that state (blocks/block_layer.hpp names them); here the rest of its functions,
// grouped by the .cpp file that defines them, where their contracts are stated. Functions that
// take a pool or a block need the lock of its owner stream (state_of(pool).mu), which clang cannot
// match to the caller's stream state: that rule stays a convention.
#pragma once

#include "core/stats/diagnostics_layer.hpp"

#include <streamsafe/core/caching_allocator.hpp>
#include <streamsafe/core/sleep.hpp>

#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace streamsafe {

struct caching_allocator::impl : detail::diagnostics_layer {
  using stream_state = detail::stream_state;
  using release_batch = detail::release_batch;
  using queued_run = detail::queued_run;
  using tag_state = detail::tag_state;
  using paused_segment = detail::paused_segment;
  using resume_work = detail::resume_work;

  impl(device_backend& backend, options opts);  // caching_allocator.cpp
  ~impl();
  // ---- growth/growth_hook.hpp: what differs between the backend kinds in the growth policy,
  // one implementation per kind (cuda_malloc_growth.cpp, expandable_growth.cpp)
  struct growth_hook;
  struct cuda_malloc_growth;
  struct expandable_growth;
  std::unique_ptr<growth_hook> growth_hook_;  // chosen by the constructor: read without a lock
  // ---- streams.cpp (the rest: streams/stream_layer.hpp) ------------------------------------
  void retire_dead_streams_locked() STREAMSAFE_REQUIRES(mu_);
  // ---- growth.cpp (the rest: growth/growth_layer.hpp) ---------------------------------------
  block* adopt_dead_segment_locked(pool& p, std::size_t rounded) STREAMSAFE_REQUIRES(mu_);
  block* expand_pool_locked(device_lock& dlk, detail::unique_lock<stream_lock>& slk,
                            stream_state& st, pool& p, std::size_t rounded)
      STREAMSAFE_REQUIRES(mu_, st.mu);
  // The steps of expand_pool_locked (growth_policy.cpp numbers them), in its order:
  // queued memory first; *stop: a capture began while it waited
  block* reclaim_queued_first_locked(device_lock& dlk, detail::unique_lock<stream_lock>& slk,
                                     stream_state& st, pool& p, std::size_t rounded, bool* stop)
      STREAMSAFE_REQUIRES(mu_, st.mu);
  // headroom under the peak, a pending block, completed releases
  block* grow_within_peak_or_pending_locked(device_lock& dlk, detail::unique_lock<stream_lock>& slk,
                                            stream_state& st, pool& p, std::size_t rounded)
      STREAMSAFE_REQUIRES(mu_, st.mu);
  // a growth, idle memory making room past the peak (the growth hook's way)
  block* grow_making_room_locked(device_lock& dlk, detail::unique_lock<stream_lock>& slk,
                                 stream_state& st, pool& p, std::size_t rounded)
      STREAMSAFE_REQUIRES(mu_, st.mu);
  // at the limit; the out-of-memory path
  block* take_from_other_pools_locked(detail::unique_lock<stream_lock>& slk, stream_state& st,
                                      pool& p, std::size_t rounded) STREAMSAFE_REQUIRES(mu_, st.mu);
  block* out_of_memory_path_locked(device_lock& dlk, detail::unique_lock<stream_lock>& slk,
                                   stream_state& st, pool& p, std::size_t rounded)
      STREAMSAFE_REQUIRES(mu_, st.mu);
  // serve_path.cpp: walks without a host wait, the waits between them, room for resume/graphs
  block* serve_without_waiting_locked(device_lock& dlk, detail::unique_lock<stream_lock>& slk,
                                      stream_state& st, pool& p, std::size_t rounded)
      STREAMSAFE_REQUIRES(mu_, st.mu);
  std::size_t retire_pending_behind_waits_locked(const stream_state* held) STREAMSAFE_REQUIRES(mu_);
  bool make_room_locked(device_lock& dlk, std::size_t bytes) STREAMSAFE_REQUIRES(mu_);
  bool serve_wait_locked(device_lock& dlk, detail::serve_waits& w) STREAMSAFE_REQUIRES(mu_);
  bool wait_device_work_locked(device_lock& dlk, std::uint64_t bound_us) STREAMSAFE_REQUIRES(mu_);
  void wait_fencing_elsewhere_locked(device_lock& dlk) STREAMSAFE_REQUIRES(mu_);
  bool wait_dead_pending_locked(device_lock& dlk) STREAMSAFE_REQUIRES(mu_);
  bool wait_events_bounded_locked(device_lock& dlk, const std::vector<event_handle>& events,
                                  std::uint64_t bound_us) STREAMSAFE_REQUIRES(mu_);
  block* grow_locked(pool& p, std::size_t rounded) STREAMSAFE_REQUIRES(mu_);  // a growth
  bool growth_within_peak_locked(const pool& p, std::size_t rounded) const STREAMSAFE_REQUIRES(mu_);
  void note_headroom_locked() STREAMSAFE_REQUIRES(mu_);  // headroom_hint_ after reserved changed
  bool wants_collection_locked(std::size_t rounded) const STREAMSAFE_REQUIRES(mu_);
  std::size_t release_refused_segments(device_lock& lk, stream_state& st, std::size_t rounded)
      STREAMSAFE_REQUIRES(mu_);
  std::size_t queue_idle_chunks_locked(const block* keep, bool large_only, std::size_t bytes)
      STREAMSAFE_REQUIRES(mu_);
  bool wait_queued_fences_locked(device_lock& dlk) STREAMSAFE_REQUIRES(mu_);
  void wait_on_fence_locked(stream_handle stream, const release_batch& batch)
      STREAMSAFE_REQUIRES(mu_);
  void take_from_batch_locked(const std::deque<release_batch>::iterator& batch, block* b)
      STREAMSAFE_REQUIRES(mu_);
  block* reclaim_in_place_locked(pool& p, std::size_t rounded, bool whole_rule = true)
      STREAMSAFE_REQUIRES(mu_);
  block* reclaim_segment_locked(pool& p, std::size_t rounded, bool whole_rule)
      STREAMSAFE_REQUIRES(mu_);
  block* reclaim_by_alias_locked(pool& p, std::size_t rounded, bool within_peak = false,
                                 bool* in_flight = nullptr) STREAMSAFE_REQUIRES(mu_);
  block* alias_target_locked(pool& p, std::size_t rounded, std::size_t* need)
      STREAMSAFE_REQUIRES(mu_);
  std::size_t choose_queued_runs_locked(const pool& p, std::size_t need,
                                        std::vector<queued_run>* chosen) STREAMSAFE_REQUIRES(mu_);
  block* refit_alias_target_locked(pool& p, std::size_t rounded, std::size_t taken,
                                   std::size_t* need) STREAMSAFE_REQUIRES(mu_);
  bool map_queued_chunks_locked(pool& p, block* target, const std::vector<queued_run>& chosen,
                                std::size_t fresh) STREAMSAFE_REQUIRES(mu_);
  void commit_alias_locked(pool& p, block* target, const std::vector<queued_run>& chosen,
                           std::size_t aliased, std::size_t fresh) STREAMSAFE_REQUIRES(mu_);
  std::size_t unghost_locked(std::uintptr_t addr, std::size_t bytes, bool small)
      STREAMSAFE_REQUIRES(mu_);
  std::size_t drop_ghost_locked(block* b) STREAMSAFE_REQUIRES(mu_);
  // ---- allocate.cpp: the allocation order ----------------------------------------------------
  block* find_block_locked(stream_state& st, pool& p, std::size_t rounded, bool grow = true)
      STREAMSAFE_REQUIRES(mu_, st.mu);
  void* finish_allocation(stream_state& st, block* b, std::size_t rounded, std::size_t size)
      STREAMSAFE_REQUIRES(st.mu);
  void count_allocation_locked(stream_state& st, const block* b) STREAMSAFE_REQUIRES(st.mu);
  void* allocate_slow(stream_state& st, std::size_t size, std::size_t rounded, bool small,
                      tag_id tag) STREAMSAFE_EXCLUDES(mu_, st.mu);
  // ---- free.cpp: deallocate and record_stream ------------------------------------------------
  void free_found_locked(stream_state& st, block* b, const stream_handle* stream)
      STREAMSAFE_REQUIRES(mu_, st.mu);
  bool free_without_events_locked(stream_state& st, block* b, const stream_handle* stream)
      STREAMSAFE_REQUIRES(st.mu);
  bool free_with_events_locked(stream_state& st, block* b, const stream_handle* stream,
                               bool device_locked) STREAMSAFE_REQUIRES(st.mu);
  bool record_use_events_locked(block* b, const stream_handle* stream, bool device_locked);
  void commit_free_locked(stream_state& st, block* b, const stream_handle* stream)
      STREAMSAFE_REQUIRES(st.mu);
  void defer_fence_locked(stream_state& st, block* b, const stream_handle* stream)
      STREAMSAFE_REQUIRES(mu_, st.mu);
  void fence_unfenced_locked() STREAMSAFE_REQUIRES(mu_);
  void count_free_locked(stream_state& st, const block* b) STREAMSAFE_REQUIRES(st.mu);
  void free_same_stream_locked(stream_state& st, block* b) STREAMSAFE_REQUIRES(st.mu);
  void free_unfenced_locked(stream_state& st, block* b) STREAMSAFE_REQUIRES(st.mu);
  void fence_host_frees_locked(stream_state& st) STREAMSAFE_REQUIRES(mu_, st.mu);
  void fence_dead_stream_frees_locked(stream_state& st) STREAMSAFE_REQUIRES(mu_, st.mu);
  bool thread_allocated_here() const noexcept;  // this thread's last allocation was here
  void deallocate_impl(void* ptr, const stream_handle* stream);
  // ---- capture.cpp ---------------------------------------------------------------------------
  stream_state* graph_state_locked(std::uint64_t graph) STREAMSAFE_REQUIRES(mu_);
  std::uint64_t begin_capture_locked(stream_handle stream, bool detected,
                                     std::uint64_t share_pool_of = 0) STREAMSAFE_REQUIRES(mu_);
  void release_released_pools_locked(device_lock& lk, stream_handle stream)
      STREAMSAFE_REQUIRES(mu_);
  std::uint64_t end_capture_locked(device_lock& lk, stream_handle stream) STREAMSAFE_REQUIRES(mu_);
  const detail::capture_record* join_capture_locked(stream_handle stream) STREAMSAFE_REQUIRES(mu_);
  void note_capture_positions_locked(detail::held_free& h, const detail::capture_record& c)
      STREAMSAFE_REQUIRES(mu_);
  void reclaim_joined_frees_locked(const detail::capture_record& c) STREAMSAFE_REQUIRES(mu_);
  void detect_captures_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);
  void after_captures_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);
  void release_graph_locked(std::uint64_t graph) STREAMSAFE_REQUIRES(mu_);
  std::exception_ptr complete_held_frees_locked(std::uint64_t graph,
                                                const std::vector<stream_handle>& uses)
      STREAMSAFE_REQUIRES(mu_);
  bool free_during_capture_locked(stream_state& owner, block* b, const stream_handle* stream)
      STREAMSAFE_REQUIRES(mu_, owner.mu);
  void* allocate_during_capture_locked(device_lock& dlk, std::size_t size, std::size_t rounded,
                                       bool small, stream_handle stream, tag_id tag)
      STREAMSAFE_REQUIRES(mu_);
  std::string capture_note_locked() const STREAMSAFE_REQUIRES(mu_);
  std::vector<stream_handle> every_stream_locked() STREAMSAFE_REQUIRES(mu_);
  void retire_pool_locked(stream_state& g, const std::vector<stream_handle>& every)
      STREAMSAFE_REQUIRES(mu_, g.mu);
  // ---- graph_pool_route.cpp ------------------------------------------------------------------
  // nullptr: no route takes the allocation (and no capture serves it): the ordinary path.
  void* allocate_routed(std::size_t size, std::size_t rounded, bool small, stream_handle stream,
                        tag_id tag);
  const detail::pool_route* route_of_locked(stream_handle stream) const STREAMSAFE_REQUIRES(mu_);
  void* allocate_in_route_locked(device_lock& dlk, std::size_t size, std::size_t rounded,
                                 bool small, stream_handle key, std::uint64_t pool_graph)
      STREAMSAFE_REQUIRES(mu_);
  // ---- pool_checkpoint.cpp -------------------------------------------------------------------
  stream_state& checkpoint_pool_locked(std::uint64_t graph, const char* what)
      STREAMSAFE_REQUIRES(mu_);
  void check_restorable_locked(const stream_state& st, const pool_checkpoint& c,
                               const pool_checkpoint_segment& cs) const STREAMSAFE_REQUIRES(mu_);
  void* restore_block_locked(stream_state& st, segment* seg, const pool_checkpoint_block& cb)
      STREAMSAFE_REQUIRES(mu_, st.mu);
  // ---- fork.cpp ------------------------------------------------------------------------------
  bool inherited() const noexcept;  // a child forked after this allocator was made
  static std::uint64_t current_fork_generation();
  [[noreturn]] void throw_inherited(const char* what) const;
  // ---- ipc.cpp (interprocess export and import, core/ipc.hpp) --------------------------------
  void hold_exported_free_locked(stream_state& owner, block* b, const stream_handle* stream)
      STREAMSAFE_REQUIRES(mu_, owner.mu);
  void poll_ipc_locked() STREAMSAFE_REQUIRES(mu_);
  void wait_ipc_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);
  void end_export_locked(std::map<std::uint64_t, detail::ipc_export_record>::iterator it,
                         bool owner_locked = false) STREAMSAFE_REQUIRES(mu_);
  std::size_t retire_ipc_held_behind_waits_locked(const stream_state* held)
      STREAMSAFE_REQUIRES(mu_);
  void destroy_ipc_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);
  void retire_exports_in_locked(std::uintptr_t addr, std::size_t bytes) STREAMSAFE_REQUIRES(mu_);
  // ---- release.cpp, empty_cache.cpp: giving memory back behind fences (mu_, and a segment's
  // owner lock; what is collected: release/release_collect.hpp)
  void record_fence_locked(release_batch& batch) STREAMSAFE_REQUIRES(mu_);
  bool fence_done_locked(const release_batch& batch) STREAMSAFE_REQUIRES(mu_);
  release_batch take_safe_locked(release_batch& batch) STREAMSAFE_REQUIRES(mu_);
  bool free_segment_would_block_locked() STREAMSAFE_REQUIRES(mu_);
  void wait_fence_unlocked(release_batch& batch);
  void restore_batch_locked(release_batch& batch) STREAMSAFE_REQUIRES(mu_);
  void requeue_aliased_locked(block* b) STREAMSAFE_REQUIRES(mu_);  // a ghost back in the queue
  std::size_t release_batch_memory(device_lock& lk, release_batch& batch) STREAMSAFE_REQUIRES(mu_);
  std::size_t finish_deferred(device_lock& lk, bool wait, bool device_waited = false)
      STREAMSAFE_REQUIRES(mu_);
  std::size_t release_completed_locked(device_lock& lk, bool skip_ghosted = false)
      STREAMSAFE_REQUIRES(mu_);
  release_batch take_completed_locked(bool skip_ghosted = false) STREAMSAFE_REQUIRES(mu_);
  bool ghosted_locked(const block* b) const STREAMSAFE_REQUIRES(mu_);  // b's memory has a ghost
  std::size_t release_cached(device_lock& lk, empty_cache_mode mode) STREAMSAFE_REQUIRES(mu_);
  std::size_t trim_cached(device_lock& lk) STREAMSAFE_REQUIRES(mu_);
  void prepare_release_locked() STREAMSAFE_REQUIRES(mu_);
  void wait_pending_uses_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);
  void mark_pending_uses_locked() STREAMSAFE_REQUIRES(mu_);
  std::size_t release_after_pending_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);
  std::size_t release_safe_now(device_lock& lk, release_batch& batch) STREAMSAFE_REQUIRES(mu_);
  void queue_batch_locked(release_batch& batch)
      STREAMSAFE_REQUIRES(mu_);  // to the deferred queue (fence recorded)
  void wait_collected_fence_locked(device_lock& lk, release_batch& batch) STREAMSAFE_REQUIRES(mu_);
  std::size_t release_collected(device_lock& lk, release_batch& batch, empty_cache_mode mode)
      STREAMSAFE_REQUIRES(mu_);
  void prove_idle_segments_locked(stream_state& st, pool& p) STREAMSAFE_REQUIRES(mu_, st.mu);
  void drop_idle_fence_locked(stream_state& st)
      STREAMSAFE_REQUIRES(mu_);  // its events back to the pool
  std::size_t account_release_locked(block* b, bool released) STREAMSAFE_REQUIRES(mu_);
  // ---- destruction.cpp -----------------------------------------------------------------------
  void retire_all_pending_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);
  void destroy_events_locked() STREAMSAFE_REQUIRES(mu_);
  void delete_host_bookkeeping() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS;  // no other thread
  void destroy_all() STREAMSAFE_EXCLUDES(mu_);
  // ---- tags.cpp, sleep.cpp, wake.cpp ---------------------------------------------------------
  tag_state& tag_state_locked(tag_id tag) STREAMSAFE_REQUIRES(mu_);  // created on first use
  pool& pool_for_locked(stream_state& st, bool small, tag_id tag, std::size_t size)
      STREAMSAFE_REQUIRES(mu_, st.mu);
  stream_handle copy_stream_locked() STREAMSAFE_REQUIRES(mu_);
  caching_allocator& host_allocator_locked() STREAMSAFE_REQUIRES(mu_);
  void call_hooks_unlocked(const std::vector<sleep_hook_event>& events, const sleep_hook& hook);
  void wait_tag_idle_locked(device_lock& lk, const tag_state& t) STREAMSAFE_REQUIRES(mu_);
  void enqueue_offload_locked(device_lock& lk, tag_state& t) STREAMSAFE_REQUIRES(mu_);
  bool pause_ready_locked(const paused_segment& ps) STREAMSAFE_REQUIRES(mu_);  // polls only
  std::vector<paused_segment*> wait_pause_locked(device_lock& lk, tag_state& t)
      STREAMSAFE_REQUIRES(mu_);
  std::size_t unmap_paused_locked(device_lock& lk, tag_state& t,
                                  const std::vector<paused_segment*>& ready)
      STREAMSAFE_REQUIRES(mu_);
  void release_pause_events_locked(paused_segment& ps) STREAMSAFE_REQUIRES(mu_);
  std::size_t advance_pause_locked(device_lock& lk, tag_state& t, bool wait)
      STREAMSAFE_REQUIRES(mu_);
  std::size_t advance_pauses_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);  // every tag
  bool wait_pausing_tags_locked(device_lock& lk, std::uint64_t bound_us) STREAMSAFE_REQUIRES(mu_);
  pause_status tag_status_locked(const tag_state& t) STREAMSAFE_REQUIRES(mu_);
  void destroy_sleep_state_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);  // destruction
  std::vector<paused_segment> collect_pause_locked(tag_id tag, pause_mode mode,
                                                   const std::string& where)
      STREAMSAFE_REQUIRES(mu_);
  void record_pause_fences_locked(std::vector<paused_segment>& segs) STREAMSAFE_REQUIRES(mu_);
  bool resume_segment_locked(tag_state& t, paused_segment& ps, resume_work& w)
      STREAMSAFE_REQUIRES(mu_);
  bool map_resumed_run_locked(segment* seg, std::uintptr_t addr, std::size_t bytes,
                              std::size_t chunk) STREAMSAFE_REQUIRES(mu_);
  void trim_host_locked(device_lock& lk, tag_state* t) STREAMSAFE_REQUIRES(mu_);
  void order_after_restore_locked(resume_work& w, const stream_handle* also)
      STREAMSAFE_REQUIRES(mu_);
  void set_phase_after_resume_locked(tag_state& t, std::vector<paused_segment> kept)
      STREAMSAFE_REQUIRES(mu_);
  void resume_tag_locked(device_lock& lk, tag_state& t, const stream_handle* also,
                         const std::string& where) STREAMSAFE_REQUIRES(mu_);
  std::size_t advance_resumes_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);  // the worker
  // ---- release_worker.cpp --------------------------------------------------------------------
  static std::int64_t current_pid() noexcept;
  bool worker_usable_locked() const STREAMSAFE_REQUIRES(mu_);
  bool worker_releases_locked(empty_cache_mode mode) const STREAMSAFE_REQUIRES(mu_);
  bool worker_release_in_flight_locked() const STREAMSAFE_REQUIRES(mu_);
  bool ensure_worker_locked() STREAMSAFE_REQUIRES(mu_);
  void hand_to_worker_locked(release_batch& batch) STREAMSAFE_REQUIRES(mu_);
  std::size_t worker_pass_locked(device_lock& lk) STREAMSAFE_REQUIRES(mu_);
  void worker_main() STREAMSAFE_EXCLUDES(mu_);
  bool wait_for_worker_locked(device_lock& lk,
                              const std::chrono::steady_clock::time_point* deadline)
      STREAMSAFE_REQUIRES(mu_);
  void stop_worker() STREAMSAFE_EXCLUDES(mu_);
  struct process_hooks;  // pthread_atfork and atexit handlers
};

}  // namespace streamsafe
