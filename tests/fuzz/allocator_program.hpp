// streamsafe tests: random allocator programs on the simulated device, decoded from bytes.
//
// One interpreter serves two drivers: the libFuzzer harness (tests/fuzz/allocator_fuzzer.cpp,
// the bytes are the fuzzer's input) and the seeded million-operation run
// (tests/million_ops_test.cpp, the bytes come from a seeded generator). A program is a
// configuration (two bytes: backend, fence scope, empty_cache mode, memory limit, chunk and split
// sizes, stream-handle reuse, unrecorded uses, the release worker in defer mode) followed by
// operations, one opcode byte plus its arguments each: allocate (every size class, 0 and sizes near
// SIZE_MAX included), host free, host free from a stream callback (a callback_scope: no backend
// call), stream-ordered free, uses on other streams recorded with record_stream or left unrecorded
// and ordered by the program as FSDP2 does, holds and their opening, clock advances, empty_cache in
// both modes, reclaim, stream destruction announced with notify_stream_destroyed (handles may be
// recycled; one at a time or in bursts of short-lived streams), bad pointers, backend failures
// injected into the next allocator call, and IPC (a live block exported to a consumer allocator on
// the same device, read there, freed by the producer before or after the release: op_ipc).
//
// Checked after every step (or every `check_every` steps), any breach throws `violation`:
//  * check_invariants() passes; allocated / requested bytes and the allocation count equal what
//    the program holds; reserved bytes equal the simulated device's bytes in use and stay
//    under the limit (bytes conserved);
//  * a new block is 512-byte aligned, at least the size asked for, on the asking stream, and
//    overlaps no live block (no block handed out twice);
//  * under a safe fence scope the simulated device records no fault (no release or reuse while
//    unordered work may touch the memory, no access to unmapped memory);
//  * errors are the documented ones: invalid_size for 0 bytes, out_of_memory for sizes beyond
//    the limit, invalid_pointer (statistics unchanged) for every pointer that is not a live
//    block, backend_error only from an injected failure or, in a synchronous wait, from a hold
//    the host would wait on forever (the simulated device's stand-in for a hang);
//  * with empty_cache:defer an allocation never waits on the host outside its out-of-memory
//    path, and there only bounded (case K8);
//  * reserved bytes and their peak never pass the limit after an allocation, and no
//    out_of_memory is thrown while the cache could serve the request (could_serve: queued
//    memory and headroom, a whole free segment), nor, where every fence completes within the
//    allocator's bounded wait, while the reference oracle says it could
//    (tests/support/could_serve.hpp: memory pending a recorded stream, free blocks in partly
//    used segments; a growth must fit both the snapshot's view and the device's, whole chunks,
//    as in the schedule checker; counted in reference_ooms, fatal with
//    STREAMSAFE_CHECKER_STRICT=1);
//  * after a call fails, the state is intact (the block stays live, allocated bytes unchanged)
//    and the same call without the injected failure succeeds.
// At the end every block is freed, every hold opened, and the cache must drain to zero reserved
// bytes; destroying the allocator must give back every event it created.
#pragma once

#include "support/could_serve.hpp"

#include <streamsafe/core/caching_allocator.hpp>
#include <streamsafe/core/errors.hpp>
#include <streamsafe/core/snapshot.hpp>
#include <streamsafe/sim/simulated_device.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace streamsafe::fuzz {

inline constexpr std::size_t KiB = std::size_t{1} << 10;
inline constexpr std::size_t MiB = std::size_t{1} << 20;
inline constexpr std::size_t GiB = std::size_t{1} << 30;

// A breach of a checked property. Deliberately not derived from any streamsafe error, so that
// no handler inside the interpreter swallows it.
class violation : public std::exception {
 public:
  explicit violation(std::string message) : message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

// STREAMSAFE_CHECKER_STRICT=1: an out_of_memory while the reference oracle says the request
// could be served is a violation (counted in reference_ooms otherwise).
inline bool strict_reference() {
  const char* s = std::getenv("STREAMSAFE_CHECKER_STRICT");
  return s != nullptr && std::string(s) == "1";
}

// Bytes from a buffer (the fuzzer's input); zeros once exhausted.
class span_source {
 public:
  span_source(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  std::uint8_t byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  bool exhausted() const { return pos_ >= size_; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

// Bytes from a seeded generator (never exhausted).
class random_source {
 public:
  explicit random_source(std::uint64_t seed) : rng_(seed) {}
  std::uint8_t byte() {
    if (left_ == 0) {
      bits_ = rng_();
      left_ = 8;
    }
    --left_;
    const auto b = static_cast<std::uint8_t>(bits_ & 0xFF);
    bits_ >>= 8;
    return b;
  }
  bool exhausted() const { return false; }

 private:
  std::mt19937_64 rng_;
  std::uint64_t bits_ = 0;
  int left_ = 0;
};

struct program_config {
  backend_kind backend = backend_kind::cuda_malloc;
  fence_scope scope = fence_scope::all_streams;
  empty_cache_mode mode = empty_cache_mode::wait;
  bool unrecorded_uses = false;  // FSDP2-style uses; only where the scope covers them
  std::size_t memory_limit_bytes = 256 * MiB;
  std::size_t device_bytes = 2 * GiB;
  std::size_t expandable_chunk_bytes = 20 * MiB;
  std::size_t expandable_peak_chunk_bytes = 20 * MiB;  // the default (one size); 2 MiB too
  std::size_t max_split_size_bytes = 0;
  std::size_t whole_segment_split_ratio = 8;  // the default; 0 (off) and 1 (most refusals) too
  bool reuse_stream_handles = false;
  // options::release_worker on (defer mode only): releases run on the allocator's worker thread;
  // checks that compare reserved bytes with the device first wait for it to settle.
  bool release_worker = false;
  reuse_fence_scope reuse_fence =
      reuse_fence_scope::allocation_stream;  // all_streams: op_side_read_free
  bool holds = true;            // holds (kernels that wait for the host) may be enqueued
  bool inject_failures = true;  // backend failures may be injected
  bool destroy_streams = true;  // streams may be destroyed (notify_stream_destroyed)

  bool safe() const { return scope != fence_scope::allocation_stream; }

  static program_config decode(std::uint8_t b0, std::uint8_t b1) {
    program_config c;
    c.backend = (b0 & 1) ? backend_kind::expandable : backend_kind::cuda_malloc;
    c.mode = (b0 & 2) ? empty_cache_mode::defer : empty_cache_mode::wait;
    static constexpr fence_scope scopes[] = {
        fence_scope::all_streams, fence_scope::used_streams,     fence_scope::device,
        fence_scope::all_streams, fence_scope::used_streams,     fence_scope::all_streams,
        fence_scope::device,      fence_scope::allocation_stream};
    c.scope = scopes[(b0 >> 2) & 7];
    c.unrecorded_uses = ((b0 >> 5) & 1) != 0 &&
                        (c.scope == fence_scope::all_streams || c.scope == fence_scope::device ||
                         c.scope == fence_scope::allocation_stream);
    static constexpr std::size_t limits[] = {64 * MiB, 128 * MiB, 256 * MiB, 1 * GiB};
    c.memory_limit_bytes = limits[(b0 >> 6) & 3];
    c.expandable_chunk_bytes = (b1 & 1) ? 2 * MiB : 20 * MiB;
    static constexpr std::size_t splits[] = {0, 0, 16 * MiB, 40 * MiB};
    c.max_split_size_bytes = splits[(b1 >> 1) & 3];
    c.reuse_stream_handles = ((b1 >> 3) & 1) != 0;
    // Growths past the high-water mark in the chunk size itself (the default) or in 2 MiB chunks.
    c.expandable_peak_chunk_bytes = c.reuse_stream_handles ? 2 * MiB : c.expandable_chunk_bytes;
    static constexpr std::size_t ratios[] = {8, 8, 0, 1};
    c.whole_segment_split_ratio = ratios[(b1 >> 4) & 3];
    c.release_worker = ((b1 >> 6) & 1) != 0 && c.mode == empty_cache_mode::defer;
    c.reuse_fence = ((b1 >> 7) & 1) != 0 ? reuse_fence_scope::all_streams
                                         : reuse_fence_scope::allocation_stream;
    return c;
  }

  std::string to_string() const {
    std::ostringstream os;
    os << "backend:" << streamsafe::to_string(backend) << " scope:" << streamsafe::to_string(scope)
       << " mode:" << streamsafe::to_string(mode) << " unrecorded:" << unrecorded_uses
       << " limit:" << memory_limit_bytes << " chunk:" << expandable_chunk_bytes
       << " peak_chunk:" << expandable_peak_chunk_bytes << " max_split:" << max_split_size_bytes
       << " whole_ratio:" << whole_segment_split_ratio << " reuse_handles:" << reuse_stream_handles
       << " release_worker:" << release_worker
       << " reuse_fence:" << streamsafe::to_string(reuse_fence);
    return os.str();
  }
};

struct program_stats {
  std::uint64_t operations = 0;
  std::uint64_t allocations = 0;
  std::uint64_t frees = 0;
  std::uint64_t out_of_memory = 0;
  std::uint64_t injections = 0;       // backend calls armed to fail
  std::uint64_t injected_errors = 0;  // allocator calls that failed because of them
  std::uint64_t hold_deadlocks = 0;   // synchronous waits refused because of a hold
  std::uint64_t bad_pointer_checks = 0;
  std::uint64_t streams_destroyed = 0;
  std::uint64_t invariant_checks = 0;
  std::uint64_t pauses = 0, resumes = 0;  // of the tag op_sleep pauses (completed calls)
  // out_of_memory while the reference oracle (tests/support/could_serve.hpp) said it could serve
  std::uint64_t reference_ooms = 0;

  program_stats& operator+=(const program_stats& o) {
    operations += o.operations;
    allocations += o.allocations;
    frees += o.frees;
    out_of_memory += o.out_of_memory;
    injections += o.injections;
    injected_errors += o.injected_errors;
    hold_deadlocks += o.hold_deadlocks;
    bad_pointer_checks += o.bad_pointer_checks;
    streams_destroyed += o.streams_destroyed;
    invariant_checks += o.invariant_checks;
    pauses += o.pauses;
    resumes += o.resumes;
    reference_ooms += o.reference_ooms;
    return *this;
  }
};

class program {
 public:
  explicit program(program_config config) : config_(config), dev_(device_config(config)) {
    options o;
    o.backend = config_.backend;
    o.release_fence = config_.scope;
    o.empty_cache = config_.mode;
    o.memory_limit_bytes = config_.memory_limit_bytes;
    o.expandable_chunk_bytes = config_.expandable_chunk_bytes;
    o.expandable_peak_chunk_bytes = config_.expandable_peak_chunk_bytes;
    o.max_split_size_bytes = config_.max_split_size_bytes;
    o.whole_segment_split_ratio = config_.whole_segment_split_ratio;
    o.release_worker = config_.release_worker ? release_worker_mode::on : release_worker_mode::off;
    o.reuse_fence = config_.reuse_fence;
    alloc_.emplace(rec_, o);
    dev_.set_reuse_stream_handles(config_.reuse_stream_handles);
    streams_.push_back({next_uid_++, 0, false});
    for (int i = 0; i < 3; ++i) streams_.push_back({next_uid_++, dev_.create_stream(), false});
    for (std::size_t i = 0; i < streams_.size(); ++i) introduce(i);
  }

  ~program() {
    // On an escaping violation the allocator may hold segments under unopened holds: open them
    // so that its destructor can release, and keep quiet.
    for (std::uint64_t h : holds_) dev_.open(h);
    ipc_consumer_.reset();
    alloc_.reset();
  }

  program(const program&) = delete;
  program& operator=(const program&) = delete;

  // Runs up to max_ops operations (fewer if the source runs dry), checking every check_every.
  template <class Source>
  void run(Source& src, std::uint64_t max_ops, std::uint64_t check_every = 1) {
    for (std::uint64_t i = 0; i < max_ops && !src.exhausted(); ++i) {
      step(src);
      if (++since_check_ >= check_every) {
        since_check_ = 0;
        check();
      }
    }
    check();
  }

  // Frees everything, drains the device and the cache, destroys the allocator and checks that
  // nothing leaked.
  void finish() {
    for (std::uint64_t h : holds_) dev_.open(h);
    holds_.clear();
    while (!live_.empty()) {
      expect_ok("final deallocate", [&] { alloc_->deallocate(live_.back().ptr); });
      live_.pop_back();
    }
    while (!paused_.empty()) {  // frees of a paused tag's blocks work while it is paused
      expect_ok("final deallocate (paused)", [&] { alloc_->deallocate(paused_.back().ptr); });
      paused_.pop_back();
    }
    if (config_.backend == backend_kind::expandable) {
      dev_.run_until_idle();  // then the cache goes, so that the resume fits under the limit
      expect_ok("empty_cache before the final resume",
                [&] { alloc_->empty_cache(empty_cache_mode::wait); });
      settle_worker();
      expect_ok("final resume", [&] { alloc_->resume(k_tag); });
      tag_paused_ = false;
    }
    dev_.run_until_idle();
    expect_ok("final empty_cache", [&] { alloc_->empty_cache(empty_cache_mode::wait); });
    expect_ok("final reclaim", [&] { alloc_->reclaim(); });
    settle_worker();
    check();
    const statistics s = alloc_->stats();
    require(s.reserved_bytes.current == 0,
            "reserved bytes " + std::to_string(s.reserved_bytes.current) +
                " left after freeing everything and empty_cache(wait)");
    require(s.active_bytes.current == 0, "active bytes left after draining");
    require(alloc_->pending_release_bytes() == 0, "deferred releases left after empty_cache(wait)");
    require(dev_.bytes_in_use() == 0, "device memory still in use after draining");
    ipc_consumer_.reset();
    alloc_.reset();
    for (auto& [uid, e] : final_events_) dev_.destroy_event(e);
    final_events_.clear();
    for (auto& [uid, list] : owed_) {
      for (event_handle e : list) dev_.destroy_event(e);
    }
    owed_.clear();
    const sim::counters c = dev_.counters();
    require(c.events_created == c.events_destroyed,
            "events leaked: created " + std::to_string(c.events_created) + ", destroyed " +
                std::to_string(c.events_destroyed));
    if (config_.safe()) require(dev_.fault_count() == 0, "fault at the end: " + first_fault());
  }

  const program_stats& stats() const { return stats_; }
  const program_config& config() const { return config_; }
  sim::simulated_device& device() { return dev_; }
  caching_allocator& allocator() { return *alloc_; }  // until finish()
  std::size_t fault_count() const { return dev_.fault_count(); }
  // The operations run so far, one line each (for a reproducer).
  const std::vector<std::string>& trace() const { return trace_; }
  void keep_trace(bool on) { keep_trace_ = on; }

 private:
  struct stream_slot {
    std::uint64_t uid;
    stream_handle handle;
    bool seen;  // the allocator has seen it (the all_streams fence covers it)
  };

  struct live_block {
    void* ptr;
    std::size_t size;        // requested
    std::size_t block_size;  // as find_block reports
    std::uint64_t stream_uid;
    std::vector<std::uint64_t> users;  // uids of streams that used it (recorded or not)
    bool tagged = false;               // allocated under the tag k_tag (expandable only)
  };

  struct armed_failure {
    sim::call call;
    int count;
  };

  static constexpr const char* k_tag = "fuzz";
  bool tag_paused_ = false;         // k_tag is pausing or paused
  std::vector<live_block> paused_;  // its live blocks meanwhile

  static sim::device_config device_config(const program_config& c) {
    sim::device_config d;
    d.total_bytes = c.device_bytes;
    return d;
  }

  // ---- helpers -----------------------------------------------------------------------------

  void require(bool ok, const std::string& what) const {
    if (!ok)
      throw violation(what + " [" + config_.to_string() + ", op " +
                      std::to_string(stats_.operations) + "]");
  }

  std::string first_fault() const {
    auto faults = dev_.faults();
    return faults.empty() ? std::string("none") : faults.front().message;
  }

  void note(const std::string& line) {
    if (keep_trace_) trace_.push_back(line);
  }

  template <class Source>
  static std::size_t pick(Source& src, std::size_t n) {
    if (n <= 1) return 0;
    if (n <= 256) return src.byte() % n;
    const std::size_t v = (static_cast<std::size_t>(src.byte()) << 8) | src.byte();
    return v % n;
  }

  template <class Source>
  static std::size_t u16(Source& src) {
    return (static_cast<std::size_t>(src.byte()) << 8) | src.byte();
  }

  std::size_t slot_of(std::uint64_t uid) const {
    for (std::size_t i = 0; i < streams_.size(); ++i) {
      if (streams_[i].uid == uid) return i;
    }
    return streams_.size();
  }
  bool alive(std::uint64_t uid) const { return slot_of(uid) < streams_.size(); }

  // Makes stream `waiter` wait for the work enqueued so far on stream uid (the program's own
  // ordering, not the allocator's).
  void order_after(stream_handle waiter, std::uint64_t uid) {
    const std::size_t i = slot_of(uid);
    if (i < streams_.size()) {
      if (streams_[i].handle == waiter) return;
      event_handle e = dev_.create_event();
      dev_.record_event(e, streams_[i].handle);
      dev_.stream_wait_event(waiter, e);
      dev_.destroy_event(e);
    } else {
      dev_.stream_wait_event(waiter, final_events_.at(uid));
    }
  }

  void order_after_block(stream_handle waiter, const live_block& b) {
    order_after(waiter, b.stream_uid);
    for (std::uint64_t u : b.users) order_after(waiter, u);
  }

  // Unrecorded uses owed to a stream: it waits for them before it next allocates.
  void settle(std::uint64_t uid) {
    auto it = owed_.find(uid);
    if (it == owed_.end()) return;
    const stream_handle h = streams_[slot_of(uid)].handle;
    for (event_handle e : it->second) {
      dev_.stream_wait_event(h, e);
      dev_.destroy_event(e);
    }
    owed_.erase(it);
  }

  // The allocator sees a stream once it allocates there (as in safety_property_test.cpp).
  void introduce(std::size_t slot) {
    stream_slot& s = streams_[slot];
    try {
      void* p = alloc_->allocate(512, s.handle);
      alloc_->deallocate(p);
      s.seen = true;
    } catch (const out_of_memory&) {
      ++stats_.out_of_memory;
    } catch (const backend_error& e) {
      if (!deadlock_error(e)) throw;
      ++stats_.hold_deadlocks;
    }
  }

  bool deadlock_error(const backend_error& e) const {
    return !holds_.empty() &&
           std::string(e.what()).find("would never complete") != std::string::npos;
  }

  // Runs an allocator call with the armed failure (if any) in force, and disarms it after.
  template <class F>
  void with_armed(F&& f) {
    if (!armed_) {
      f();
      return;
    }
    const armed_failure a = *armed_;
    armed_.reset();
    dev_.fail_next(a.call, a.count);
    try {
      f();
    } catch (...) {
      dev_.fail_next(a.call, 0);
      throw;
    }
    dev_.fail_next(a.call, 0);
  }

  // A call that must succeed (no failure injected, no hold in the way of a wait).
  template <class F>
  void expect_ok(const char* what, F&& f) {
    try {
      f();
    } catch (const violation&) {
      throw;
    } catch (const std::exception& e) {
      require(false, std::string(what) + " threw: " + e.what());
    }
  }

  // The documented error of a failing call: backend_error from an injected failure or from a
  // hold that a synchronous wait would wait on forever. Returns normally when acceptable.
  void accept_backend_error(const char* what, const backend_error& e, bool injected) {
    if (injected) {
      ++stats_.injected_errors;
      return;
    }
    if (deadlock_error(e)) {
      ++stats_.hold_deadlocks;
      return;
    }
    require(false, std::string(what) +
                       " threw backend_error with no injected failure and no hold: " + e.what());
  }

  struct snapshot {
    std::int64_t allocated, requested, allocation;
  };
  snapshot snap() const {
    const statistics s = alloc_->stats();
    return {s.allocated_bytes.current, s.requested_bytes.current, s.allocation.current};
  }
  void require_same(const snapshot& a, const char* what) const {
    const snapshot b = snap();
    bool same = a.allocated == b.allocated && a.requested == b.requested &&
                a.allocation == b.allocation;
    // An exported block the program freed is held until its export ends; a host wait inside the
    // call (the out-of-memory path's, bounded) may see the consumer's release complete, and the
    // free then completes in the call: allowed, once.
    if (!same && held_ && alloc_->ipc_status().held_frees == 0) {
      same = a.allocated - static_cast<std::int64_t>(held_->block_size) == b.allocated &&
             a.requested - static_cast<std::int64_t>(held_->size) == b.requested &&
             a.allocation - 1 == b.allocation;
    }
    require(same, std::string(what) + " failed but changed the allocated statistics");
  }

  // ---- the checks ----------------------------------------------------------------------------

  // The release worker has released everything whose fence has completed and has nothing in
  // flight; until the program acts again nothing changes (the clock moves only on its calls).
  void settle_worker() {
    if (config_.release_worker)
      require(alloc_->wait_for_release_worker_idle(std::chrono::seconds(10)),
              "the release worker did not settle");
  }

  bool tagged_next(std::uint64_t duration) const {
    return config_.backend == backend_kind::expandable && duration % 8 == 0;
  }

  // Launches work and keeps a bound of when all enqueued work ends (as if every launch ran after
  // the one before it: conservative), so that the reference oracle is asked only while every
  // fence can complete within the allocator's bounded wait.
  std::uint64_t launch_tracked(stream_handle s, std::uint64_t duration_us,
                               std::vector<sim::range> ranges, std::string label) {
    work_ends_us_ = std::max(work_ends_us_, dev_.now_us()) + duration_us;
    return dev_.launch(s, duration_us, std::move(ranges), std::move(label));
  }

  // The reference oracle (tests/support/could_serve.hpp) holds the allocator to the whole
  // promise only where each fence completes within its bounded wait: no hold pending, the
  // enqueued work done within 0.5 s of simulated time, a fence scope neither unsafe nor
  // device-wide, no graph capture, no failure injected.
  bool reference_applies() const {
    return holds_.empty() && !graph_stream_ && config_.safe() &&
           config_.scope != fence_scope::device && work_ends_us_ < dev_.now_us() + 500'000;
  }

  // The reference "could serve": memory pending a recorded stream, queued, cached or in a
  // partly used segment of the request's own pool counts; kept is only what holds a live block.
  std::optional<std::string> reference_could_serve(std::size_t size, stream_handle s,
                                                   bool tagged) const {
    if (size == 0 || size > config_.memory_limit_bytes) return std::nullopt;
    test::oracle_request r;
    r.size_bytes = size;
    r.stream = s;
    r.tag = tagged ? k_tag : "";
    r.max_split_size_bytes = config_.max_split_size_bytes;
    const test::oracle_verdict v = test::oracle_from_snapshot(alloc_->snapshot(), config_.backend,
                                                              config_.memory_limit_bytes, r);
    // The snapshot sees 2 MiB granules; with larger chunks a live byte keeps its whole chunk,
    // which only the device's view counts. A growth must fit in both views (the checker's rule).
    std::vector<std::pair<std::uintptr_t, std::size_t>> live;
    for (const std::vector<live_block>* list : {&live_, &paused_}) {
      for (const live_block& b : *list)
        live.emplace_back(reinterpret_cast<std::uintptr_t>(b.ptr), b.block_size);
    }
    const test::oracle_verdict d = rec_.verdict(live, config_.backend, config_.memory_limit_bytes,
                                                v.new_bytes);
    if (!v.could_serve || !(v.fits_free_block || d.fits_growth())) return std::nullopt;
    return v.to_string() + "; device: " + d.to_string();
  }

  // True when the cache can serve `size` bytes without new memory past the limit, so that an
  // out_of_memory would be a defect: expandable, when the memory queued for release plus the
  // headroom under the limit covers the request (rounded to the 2 MiB granularity); cuda_malloc,
  // when a wholly free segment of the request's pool kind (cached or queued) is at least the
  // request (segments are not combined) and max_split_size_mb lets it serve the request.
  // Conservative: not with a device-wide fence scope (no
  // device-side wait to reclaim behind), after a graph capture (private pools), or for sizes
  // beyond the limit.
  bool could_serve(std::size_t size, const statistics& st) const {
    if (size == 0 || size > config_.memory_limit_bytes || graph_stream_ ||
        config_.scope == fence_scope::device)
      return false;
    const auto reserved = static_cast<std::size_t>(st.reserved_bytes.current);
    const std::size_t headroom = config_.memory_limit_bytes > reserved
                                     ? config_.memory_limit_bytes - reserved
                                     : 0;
    const bool small = size <= MiB;
    if (config_.backend == backend_kind::expandable) {
      const std::size_t need = (size + 2 * MiB - 1) / (2 * MiB) * (2 * MiB);
      std::size_t queued = alloc_->pending_release_bytes();
      if (tag_paused_) {  // a paused tag's memory stays its own (sleep.cpp): not reclaimed
        for (const segment_snapshot& seg : alloc_->snapshot().segments) {
          if (seg.tag.empty()) continue;
          const std::size_t paused = seg.bytes_in(snapshot_block_state::releasing);
          queued -= std::min(queued, paused);
        }
      }
      return queued + headroom >= need;
    }
    const std::size_t rounded = (size + 511) / 512 * 512;
    for (const segment_snapshot& seg : alloc_->snapshot().segments) {
      if (seg.expandable || seg.blocks.size() != 1 || !seg.tag.empty() ||
          (seg.pool == snapshot_pool::small) != small)
        continue;
      const block_snapshot& b = seg.blocks.front();
      // max_split_size_mb: oversize blocks serve only requests close to their size (PyTorch).
      const std::size_t ms = config_.max_split_size_bytes;
      if (ms != 0 && !small &&
          ((rounded < ms && b.size_bytes >= ms) ||
           (rounded >= ms && b.size_bytes >= rounded + 20 * MiB)))
        continue;
      if ((b.state == snapshot_block_state::inactive ||
           b.state == snapshot_block_state::releasing) &&
          b.size_bytes >= rounded)
        return true;
    }
    return false;
  }

  void check() {
    ++stats_.invariant_checks;
    settle_worker();
    try {
      alloc_->check_invariants();
    } catch (const std::logic_error& e) {
      require(false, e.what());
    }
    // tag_status first: it moves a deferred pause along (unmaps), which stats() must include.
    const std::int64_t paused_bytes = tag_paused_ ? static_cast<std::int64_t>(
                                                        alloc_->tag_status(k_tag).released_bytes)
                                                  : 0;
    const statistics s = alloc_->stats();
    std::int64_t allocated = 0, requested = 0;
    for (const std::vector<live_block>* list : {&live_, &paused_}) {
      for (const live_block& b : *list) {
        allocated += static_cast<std::int64_t>(b.block_size);
        requested += static_cast<std::int64_t>(b.size);
      }
    }
    require(s.allocated_bytes.current == allocated,
            "allocated_bytes " + std::to_string(s.allocated_bytes.current) + " != live blocks " +
                std::to_string(allocated));
    require(s.requested_bytes.current == requested,
            "requested_bytes disagrees with the live blocks");
    require(s.allocation.current == static_cast<std::int64_t>(live_.size() + paused_.size()),
            "allocation count disagrees");
    require(s.active_bytes.current >= s.allocated_bytes.current, "active < allocated");
    require(s.reserved_bytes.current + paused_bytes >= s.active_bytes.current, "reserved < active");
    if (static_cast<std::size_t>(s.reserved_bytes.current) != dev_.bytes_in_use()) {
      const pause_status t = alloc_->tag_status(k_tag);
      require(false, "reserved_bytes " + std::to_string(s.reserved_bytes.current) +
                         " != device bytes in use " + std::to_string(dev_.bytes_in_use()) +
                         " (tag " + k_tag + ": " + to_string(t.phase) + ", released " +
                         std::to_string(t.released_bytes) + ", pending " +
                         std::to_string(t.pending_bytes) + ", reserved " +
                         std::to_string(t.reserved_bytes) + ")");
    }
    require(static_cast<std::size_t>(s.reserved_bytes.current) <= config_.memory_limit_bytes,
            "reserved bytes above the memory limit");
    require(alloc_->pending_release_bytes() <= static_cast<std::size_t>(s.reserved_bytes.current),
            "pending release bytes above reserved");
    if (config_.safe()) require(dev_.fault_count() == 0, "simulated fault: " + first_fault());
  }

  // ---- operations ----------------------------------------------------------------------------

  template <class Source>
  void step(Source& src) {
    ++stats_.operations;
    const std::uint8_t raw = src.byte();
    const std::uint8_t op = raw % 32;
    if (raw == 255) return op_graphs(src);
    if (raw == 253 || raw == 252) return op_sleep(src);
    if (raw == 254) return op_ipc(src);
    if (op < 8) return op_allocate(src);
    if (op < 12) return op_use(src);
    if (op < 14) return op_free(src);
    // op 14: a free from a stream callback, or (reuse_fence:all_streams, half the time) an
    // unrecorded side-stream read before a host free.
    if (op == 14 && config_.reuse_fence == reuse_fence_scope::all_streams && ((raw >> 5) & 1) != 0)
      return op_side_read_free(src);
    if (op == 14) return op_callback_free(src);
    if (op < 17) return op_stream_free(src);
    if (op == 17) return op_hold(src);
    if (op == 18) return op_open(src);
    if (op < 21) return op_advance(src);
    if (op < 24) return op_empty_cache(op - 21);
    if (op == 24) return op_reclaim();
    if (op == 25) return op_destroy_stream(src);
    if (op < 28) return op_inject(src);
    if (op == 28) return op_bad_pointer(src);
    if (op == 29) return op_queries(src);
    if (op == 30) return op_record_only(src);
    if (src.byte() % 8 == 0) return op_destroy_burst(src);
    return op_churn(src);
  }

  template <class Source>
  std::size_t pick_size(Source& src) {
    const std::uint8_t cls = src.byte() % 8;
    const std::size_t v = u16(src);
    switch (cls) {
      case 0:
      case 1:
      case 2: return 1 + v * 16;  // up to 1 MiB
      case 3:
      case 4: return MiB + v * 320;        // 1 .. 21 MiB
      case 5: return 20 * MiB + v * 1280;  // 20 .. 100 MiB
      case 6: {
        const std::size_t edges[] = {1,
                                     511,
                                     512,
                                     513,
                                     MiB - 1,
                                     MiB,
                                     MiB + 1,
                                     2 * MiB,
                                     10 * MiB - 1,
                                     10 * MiB,
                                     20 * MiB,
                                     20 * MiB + 1,
                                     config_.expandable_chunk_bytes,
                                     config_.memory_limit_bytes / 2,
                                     config_.memory_limit_bytes};
        return edges[v % (sizeof edges / sizeof edges[0])];
      }
      default: {
        const std::size_t max = std::numeric_limits<std::size_t>::max();
        const std::size_t edges[] = {0,
                                     max,
                                     max - 1,
                                     max - 511,
                                     max / 2,
                                     max / 2 + 1,
                                     config_.memory_limit_bytes + 1,
                                     config_.device_bytes,
                                     1};
        return edges[v % (sizeof edges / sizeof edges[0])];
      }
    }
  }

  // Sleep/wake of the tag k_tag (sleep.cpp): pause (discard or offload, wait or defer), or while
  // it is paused a host free of one of its blocks or a resume. While paused its blocks sit in
  // paused_, out of reach of the operations that launch work on live blocks.
  template <class Source>
  void op_sleep(Source& src) {
    const std::uint8_t flags = src.byte();
    const snapshot before = snap();
    const bool injected = armed_.has_value();
    if (config_.backend != backend_kind::expandable) {
      note("pause on the cuda_malloc backend");
      bool refused = false;
      try {
        alloc_->pause(k_tag, pause_mode::discard);
      } catch (const config_error&) {
        refused = true;
      }
      require(refused, "pause on the cuda_malloc backend was not refused");
      require_same(before, "refused pause");
      return;
    }
    if (!tag_paused_) {
      const pause_mode mode = (flags & 1) ? pause_mode::offload : pause_mode::discard;
      const empty_cache_mode how = (flags & 2) ? empty_cache_mode::wait : empty_cache_mode::defer;
      note(std::string("pause ") + (mode == pause_mode::offload ? "offload" : "discard") +
           (how == empty_cache_mode::wait ? " wait" : " defer"));
      try {
        with_armed([&] { alloc_->pause(k_tag, mode, how); });
      } catch (const backend_error& e) {
        accept_backend_error("pause", e, injected);
      } catch (const out_of_memory&) {
        ++stats_.out_of_memory;  // no pinned host memory for the copies: still pausing
      }
      tag_paused_ = alloc_->tag_status(k_tag).phase != tag_phase::active;
      if (!tag_paused_) return;
      ++stats_.pauses;
      for (std::size_t i = live_.size(); i-- > 0;) {
        if (!live_[i].tagged) continue;
        paused_.push_back(live_[i]);
        live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(i));
      }
      return;
    }
    if (!paused_.empty() && (flags % 3) == 0) {
      const std::size_t i = pick(src, paused_.size());
      note("deallocate a paused block");
      expect_ok("deallocate a paused block", [&] { alloc_->deallocate(paused_[i].ptr); });
      ++stats_.frees;
      remember_freed(paused_[i].ptr);
      paused_.erase(paused_.begin() + static_cast<std::ptrdiff_t>(i));
      return;
    }
    const stream_slot& s = streams_[pick(src, streams_.size())];
    note("resume on stream " + std::to_string(s.handle));
    try {
      if (flags & 4) {  // off the caller's thread when a worker runs, then waited for
        with_armed([&] { alloc_->resume_async(k_tag, s.handle); });
        alloc_->wait_resumed(k_tag, std::chrono::seconds(10));
      } else {
        with_armed([&] { alloc_->resume(k_tag, s.handle); });
      }
    } catch (const out_of_memory&) {
      ++stats_.out_of_memory;  // the part that could not be mapped stays paused
    } catch (const backend_error& e) {
      accept_backend_error("resume", e, injected);
    }
    if (alloc_->tag_status(k_tag).phase != tag_phase::active) return;
    tag_paused_ = false;
    ++stats_.resumes;
    // resume ordered s after the restore: later uses order after s (the contract's "other
    // streams are ordered by the caller"; a destroyed owner stream orders nothing).
    for (live_block b : paused_) {
      require(dev_.is_mapped(reinterpret_cast<std::uintptr_t>(b.ptr), b.block_size),
              "a resumed block is not mapped");
      if (!std::count(b.users.begin(), b.users.end(), s.uid)) b.users.push_back(s.uid);
      live_.push_back(b);
    }
    paused_.clear();
  }

  template <class Source>
  void op_allocate(Source& src) {
    const std::size_t slot = pick(src, streams_.size());
    const std::size_t size = pick_size(src);
    const std::uint64_t duration = src.byte();
    allocate_on(slot, size, duration);
  }

  // Returns the index of the new live block, or nothing.
  std::optional<std::size_t> allocate_on(std::size_t slot, std::size_t size,
                                         std::uint64_t duration) {
    if (live_.size() >= 64) return std::nullopt;
    stream_slot& s = streams_[slot];
    settle(s.uid);
    note("allocate " + std::to_string(size) + " on stream " + std::to_string(s.handle));
    const snapshot before = snap();
    const bool injected = armed_.has_value();
    void* p = nullptr;
    // K8: with empty_cache:defer an allocation never blocks the host without a bound: no
    // synchronize call; only its out-of-memory path (a retry counted) may wait, bounded
    // (synchronize_event_for), whatever it returns or throws.
    const sim::counters counted = dev_.counters();
    const statistics stats_before = alloc_->stats();
    auto no_host_wait = [&] {
      if (config_.mode != empty_cache_mode::defer) return;
      const sim::counters now = dev_.counters();
      require(now.event_syncs == counted.event_syncs && now.device_syncs == counted.device_syncs,
              "allocate waited on the host under empty_cache:defer (K8)");
      require(now.bounded_event_syncs == counted.bounded_event_syncs ||
                  alloc_->stats().num_alloc_retries > stats_before.num_alloc_retries,
              "allocate waited on the host under empty_cache:defer outside its out-of-memory "
              "path");
    };
    // The cap holds after every allocation, peak included.
    auto within_limit = [&] {
      const statistics st = alloc_->stats();
      require(static_cast<std::size_t>(st.reserved_bytes.current) <= config_.memory_limit_bytes &&
                  static_cast<std::size_t>(st.reserved_bytes.peak) <= config_.memory_limit_bytes,
              "reserved bytes (or their peak) above the memory limit");
    };
    // What the cache could serve (cached and queued memory plus the headroom under the limit),
    // taken before the call: an out_of_memory then is a defect (could_serve).
    const bool servable = !injected && !tagged_next(duration) && could_serve(size, stats_before);
    std::optional<std::string> reference;
    if (!injected && reference_applies() && !(tagged_next(duration) && tag_paused_))
      reference = reference_could_serve(size, s.handle, tagged_next(duration));
    // One allocation in eight is under the tag that op_sleep pauses and resumes.
    const bool tagged = tagged_next(duration);
    try {
      if (tagged) {
        tag_scope scope(k_tag);
        with_armed([&] { p = alloc_->allocate(size, s.handle); });
      } else {
        with_armed([&] { p = alloc_->allocate(size, s.handle); });
      }
      require(!(tagged && tag_paused_), "an allocation under a paused tag succeeded");
    } catch (const tag_paused&) {
      require(tagged && tag_paused_, "tag_paused for a tag that is not paused");
      require_same(before, "allocate under a paused tag");
      return std::nullopt;
    } catch (const invalid_size&) {
      require(size == 0, "invalid_size for a size of " + std::to_string(size));
      require_same(before, "allocate(0)");
      return std::nullopt;
    } catch (const out_of_memory& e) {
      require(size != 0, "allocate(0) threw out_of_memory, not invalid_size");
      require(std::string(e.what()).find("out of memory") != std::string::npos,
              "out_of_memory without a message");
      ++stats_.out_of_memory;
      require_same(before, "allocate");
      no_host_wait();
      within_limit();
      require(!servable,
              std::string("out_of_memory while the cache could serve the request: ") + e.what());
      if (reference) {
        // The core breaks the promise in these cases today: counted; fatal with
        // STREAMSAFE_CHECKER_STRICT=1 (the schedule checker's switch).
        ++stats_.reference_ooms;
        require(!strict_reference(),
                "out_of_memory while the reference oracle says it could serve: " + *reference +
                    "; " + e.what());
      }
      return std::nullopt;
    } catch (const backend_error& e) {
      require(config_.mode != empty_cache_mode::defer || !deadlock_error(e),
              std::string("allocate tried a host wait under empty_cache:defer (K8): ") + e.what());
      accept_backend_error("allocate", e, injected);
      require_same(before, "allocate");
      no_host_wait();
      return std::nullopt;
    }
    no_host_wait();
    within_limit();
    require(size != 0, "allocate(0) succeeded");
    require(size <= config_.memory_limit_bytes, "allocate beyond the memory limit succeeded");
    ++stats_.allocations;
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    require(a % 512 == 0, "block not 512-byte aligned");
    const caching_allocator::block_info info = alloc_->find_block(p);
    require(info.address == a, "find_block does not find a new block");
    require(info.size_bytes >= size && info.size_bytes % 512 == 0,
            "block smaller than the request");
    require(info.stream == s.handle, "block's stream is not the asking stream");
    for (const std::vector<live_block>* list : {&live_, &paused_}) {
      for (const live_block& b : *list) {
        const auto ba = reinterpret_cast<std::uintptr_t>(b.ptr);
        require(!(a < ba + b.block_size && ba < a + info.size_bytes),
                "block handed out twice: [" + std::to_string(a) + ", +" +
                    std::to_string(info.size_bytes) + ") overlaps a live block at " +
                    std::to_string(ba));
      }
    }
    // The new owner writes it at once, on its stream.
    launch_tracked(s.handle, duration,
                   {sim::range{a, size, sim::access::write, static_cast<std::uint8_t>(duration)}},
                   "write after allocate");
    s.seen = true;
    live_.push_back({p, size, info.size_bytes, s.uid, {}, tagged});
    return live_.size() - 1;
  }

  template <class Source>
  std::size_t pick_other_stream(Source& src, std::uint64_t not_uid) {
    const std::size_t i = pick(src, streams_.size());
    if (streams_[i].uid != not_uid) return i;
    return (i + 1) % streams_.size();
  }

  template <class Source>
  void op_use(Source& src) {
    if (live_.empty()) return;
    live_block& b = live_[pick(src, live_.size())];
    const std::size_t ti = pick_other_stream(src, b.stream_uid);
    stream_slot& t = streams_[ti];
    const std::uint8_t flags = src.byte();
    const std::uint64_t duration = static_cast<std::uint64_t>(src.byte()) * 8;
    order_after_block(t.handle, b);
    const bool write = (flags & 1) != 0;
    launch_tracked(t.handle, duration,
                   {sim::range{reinterpret_cast<std::uintptr_t>(b.ptr), b.size,
                               write ? sim::access::write : sim::access::read,
                               write ? std::optional<std::uint8_t>(flags) : std::nullopt}},
                   "use on another stream");
    // FSDP2-style unrecorded use: the program orders the allocation stream after it before it
    // next allocates there; only the release fence (all_streams / device) covers the release.
    const bool unrecorded = config_.unrecorded_uses && (flags & 2) != 0 && alive(b.stream_uid) &&
                            (t.seen || config_.scope == fence_scope::device);
    if (!std::count(b.users.begin(), b.users.end(), t.uid)) b.users.push_back(t.uid);
    if (unrecorded) {
      note("unrecorded use on stream " + std::to_string(t.handle));
      event_handle e = dev_.create_event();
      dev_.record_event(e, t.handle);
      owed_[b.stream_uid].push_back(e);
      return;
    }
    note("record_stream on stream " + std::to_string(t.handle));
    record(b, t);
  }

  void record(live_block& b, stream_slot& t) {
    const snapshot before = snap();
    const bool injected = armed_.has_value();
    try {
      with_armed([&] { alloc_->record_stream(b.ptr, t.handle); });
    } catch (const backend_error& e) {
      accept_backend_error("record_stream", e, injected);
      require_same(before, "record_stream");
      expect_ok("record_stream after a failure", [&] { alloc_->record_stream(b.ptr, t.handle); });
    }
    t.seen = true;
  }

  template <class Source>
  void op_record_only(Source& src) {
    if (live_.empty()) return;
    live_block& b = live_[pick(src, live_.size())];
    stream_slot& t = streams_[pick(src, streams_.size())];
    note("record_stream without use on stream " + std::to_string(t.handle));
    record(b, t);
  }

  void remember_freed(void* p) {
    freed_.push_back(p);
    if (freed_.size() > 16) freed_.erase(freed_.begin());
  }

  // Host free of live_[i], or stream-ordered free on stream slot `on`.
  void free_block(std::size_t i, std::optional<std::size_t> on) {
    live_block b = live_[i];
    const snapshot before = snap();
    const bool injected = armed_.has_value();
    auto call = [&] {
      if (on) alloc_->deallocate(b.ptr, streams_[*on].handle);
      else alloc_->deallocate(b.ptr);
    };
    try {
      with_armed(call);
    } catch (const backend_error& e) {
      accept_backend_error("deallocate", e, injected);
      require_same(before, "deallocate");
      require(alloc_->find_block(b.ptr).address == reinterpret_cast<std::uintptr_t>(b.ptr),
              "a failed deallocate did not leave the block live");
      expect_ok("deallocate after a failure", call);
    }
    ++stats_.frees;
    live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(i));
    remember_freed(b.ptr);
  }

  template <class Source>
  void op_free(Source& src) {
    if (live_.empty()) return;
    const std::size_t i = pick(src, live_.size());
    note("deallocate block " + std::to_string(i));
    free_block(i, std::nullopt);
  }

  // A host free from a stream callback (case K16): inside a callback_scope it makes no backend
  // call at all; the block's events come from a later ordinary call.
  template <class Source>
  void op_callback_free(Source& src) {
    if (live_.empty()) return;
    const std::size_t i = pick(src, live_.size());
    note("deallocate block " + std::to_string(i) + " in a callback_scope");
    const sim::counters c0 = dev_.counters();
    {
      callback_scope in_callback;
      free_block(i, std::nullopt);
    }
    const sim::counters c1 = dev_.counters();
    // The device's counters are global: a release worker thread (release_worker on) polls and
    // unmaps meanwhile, so the check is made only when no other thread calls the backend.
    if (config_.release_worker) return;
    require(c1.events_created == c0.events_created && c1.events_recorded == c0.events_recorded &&
                c1.event_queries == c0.event_queries && c1.stream_waits == c0.stream_waits &&
                c1.segment_frees == c0.segment_frees && c1.unmaps == c0.unmaps &&
                c1.event_syncs == c0.event_syncs,
            "a free in a callback_scope made a backend call");
  }

  // reuse_fence:all_streams: a read on another stream the allocator knows, with no
  // record_stream and no ordering by the program (a device-to-host copy, a collective), then a
  // host free. The reuse fence alone must keep the block's next owner off it.
  template <class Source>
  void op_side_read_free(Source& src) {
    if (live_.empty()) return;
    const std::size_t i = pick(src, live_.size());
    live_block& b = live_[i];
    stream_slot& t = streams_[pick_other_stream(src, b.stream_uid)];
    const std::uint64_t duration = static_cast<std::uint64_t>(src.byte()) * 8;
    if (!t.seen || t.uid == b.stream_uid || !alive(b.stream_uid)) return op_free(src);
    order_after_block(t.handle, b);
    launch_tracked(t.handle, duration,
                   {sim::range{reinterpret_cast<std::uintptr_t>(b.ptr), b.size, sim::access::read,
                               std::nullopt}},
                   "unrecorded side read before a host free");
    note("unrecorded read on stream " + std::to_string(t.handle) + ", then deallocate block " +
         std::to_string(i));
    free_block(i, std::nullopt);
  }

  template <class Source>
  void op_stream_free(Source& src) {
    if (live_.empty()) return;
    const std::size_t i = pick(src, live_.size());
    const std::size_t ti = pick(src, streams_.size());
    const std::uint64_t duration = src.byte();
    live_block& b = live_[i];
    stream_slot& t = streams_[ti];
    order_after_block(t.handle, b);
    launch_tracked(t.handle, duration,
                   {sim::range{reinterpret_cast<std::uintptr_t>(b.ptr), b.size, sim::access::read,
                               std::nullopt}},
                   "last use before a stream-ordered free");
    note("deallocate block " + std::to_string(i) + " on stream " + std::to_string(t.handle));
    free_block(i, ti);
    t.seen = true;
  }

  template <class Source>
  void op_hold(Source& src) {
    const std::size_t i = pick(src, streams_.size());
    if (!config_.holds || holds_.size() >= 2) return;
    note("hold on stream " + std::to_string(streams_[i].handle));
    holds_.push_back(dev_.hold(streams_[i].handle));
  }

  template <class Source>
  void op_open(Source& src) {
    if (holds_.empty()) return;
    const std::size_t i = pick(src, holds_.size());
    note("open hold");
    dev_.open(holds_[i]);
    holds_.erase(holds_.begin() + static_cast<std::ptrdiff_t>(i));
  }

  template <class Source>
  void op_advance(Source& src) {
    const std::uint64_t us = static_cast<std::uint64_t>(src.byte()) * 16;
    note("advance " + std::to_string(us));
    dev_.advance(us);
  }

  void op_empty_cache(int which) {
    note(which == 0 ? "empty_cache()" : which == 1 ? "empty_cache(wait)" : "empty_cache(defer)");
    const snapshot before = snap();
    const bool injected = armed_.has_value();
    auto call = [&] {
      if (which == 0) alloc_->empty_cache();
      else alloc_->empty_cache(which == 1 ? empty_cache_mode::wait : empty_cache_mode::defer);
    };
    try {
      with_armed(call);
    } catch (const backend_error& e) {
      accept_backend_error("empty_cache", e, injected);
      require_same(before, "empty_cache");
      if (injected) {
        try {
          call();
        } catch (const backend_error& again) {
          accept_backend_error("empty_cache after a failure", again, false);
        }
      }
    }
  }

  void op_reclaim() {
    note("reclaim");
    const bool injected = armed_.has_value();
    try {
      with_armed([&] { alloc_->reclaim(); });
    } catch (const backend_error& e) {
      require(injected, std::string("reclaim threw without an injected failure: ") + e.what());
      ++stats_.injected_errors;
      expect_ok("reclaim after a failure", [&] { alloc_->reclaim(); });
    }
  }

  template <class Source>
  void op_destroy_stream(Source& src) {
    if (!config_.destroy_streams || streams_.size() < 2) return;
    const std::size_t i = 1 + pick(src, streams_.size() - 1);  // never the legacy default stream
    destroy_slot(i, true);
  }

  // Stream destruction at scale: a burst of short-lived streams (a stream per task), each
  // allocating, writing and freeing one block, then announced destroyed and destroyed; the
  // next ones reuse the dead streams' memory behind their tombstone.
  template <class Source>
  void op_destroy_burst(Source& src) {
    if (!config_.destroy_streams) return;
    const int n = 4 + src.byte() % 16;
    note("burst of " + std::to_string(n) + " short-lived streams");
    for (int k = 0; k < n; ++k) {
      streams_.push_back({next_uid_++, dev_.create_stream(), false});
      const std::size_t slot = streams_.size() - 1;
      if (auto i = allocate_on(slot, 1 + std::size_t{u16(src)} % 4096 * 64, 1))
        free_block(*i, std::nullopt);
      destroy_slot(slot, false);
    }
  }

  // Announces streams_[i] destroyed and destroys it; `replace`: a new stream takes its place.
  void destroy_slot(std::size_t i, bool replace) {
    stream_slot s = streams_[i];
    note("notify_stream_destroyed + destroy stream " + std::to_string(s.handle));
    const bool injected = armed_.has_value();
    try {
      with_armed([&] { alloc_->notify_stream_destroyed(s.handle); });
    } catch (const backend_error& e) {
      require(injected, std::string("notify_stream_destroyed threw without an injected failure: ") +
                            e.what());
      ++stats_.injected_errors;
      expect_ok("notify_stream_destroyed after a failure",
                [&] { alloc_->notify_stream_destroyed(s.handle); });
    }
    event_handle last = dev_.create_event();
    dev_.record_event(last, s.handle);
    final_events_[s.uid] = last;
    // The program's promises to a dead stream die with it: a recycled handle is a new stream,
    // which the allocator must order after the unrecorded uses of the blocks it inherits.
    if (auto it = owed_.find(s.uid); it != owed_.end()) {
      for (event_handle e : it->second) dev_.destroy_event(e);
      owed_.erase(it);
    }
    dev_.destroy_stream(s.handle);
    ++stats_.streams_destroyed;
    streams_.erase(streams_.begin() + static_cast<std::ptrdiff_t>(i));
    if (!replace) return;
    streams_.push_back({next_uid_++, dev_.create_stream(), false});
    introduce(streams_.size() - 1);
  }

  template <class Source>
  void op_inject(Source& src) {
    if (!config_.inject_failures) return;
    static constexpr sim::call calls[] = {sim::call::allocate_segment,
                                          sim::call::free_segment,
                                          sim::call::reserve_address_range,
                                          sim::call::map,
                                          sim::call::unmap,
                                          sim::call::create_event,
                                          sim::call::record_event,
                                          sim::call::query_event,
                                          sim::call::synchronize_event,
                                          sim::call::stream_wait_event,
                                          sim::call::synchronize_device};
    const std::uint8_t b = src.byte();
    sim::call c = calls[b % (sizeof calls / sizeof calls[0])];
    // The worker's own calls (query, unmap, free_segment) would take the failure meant for the
    // program's next call: those configurations arm map instead.
    if (config_.release_worker &&
        (c == sim::call::query_event || c == sim::call::unmap || c == sim::call::free_segment)) {
      c = sim::call::map;
    }
    armed_ = armed_failure{c, 1 + (b >> 6)};
    ++stats_.injections;
    note("inject failure " + std::to_string(b % (sizeof calls / sizeof calls[0])) + " x" +
         std::to_string(1 + (b >> 6)));
    // The failure applies to the allocator calls of the next operation only.
    const std::uint8_t op = src.byte() % 32;
    if (op < 8) op_allocate(src);
    else if (op < 12) op_use(src);
    else if (op < 15) op_free(src);
    else if (op < 17) op_stream_free(src);
    else if (op < 21) op_empty_cache(1);
    else if (op < 24) op_empty_cache(op - 21);
    else if (op < 26) op_reclaim();
    else if (op < 28) op_destroy_stream(src);
    else op_churn(src);
    armed_.reset();
  }

  template <class Source>
  void op_bad_pointer(Source& src) {
    ++stats_.bad_pointer_checks;
    const std::uint8_t kind = src.byte() % 4;
    void* p = nullptr;
    std::string expect;
    if (kind == 0 && !freed_.empty()) {
      p = freed_[pick(src, freed_.size())];
      for (const std::vector<live_block>* list : {&live_, &paused_}) {
        for (const live_block& b : *list) {
          if (b.ptr == p) return;  // handed out again: not stale
        }
      }
    } else if (kind == 1 && !live_.empty()) {
      const live_block& b = live_[pick(src, live_.size())];
      if (b.block_size <= 512) return;
      const std::size_t off = 512 * (1 + pick(src, b.block_size / 512 - 1));
      p = static_cast<char*>(b.ptr) + off;
      expect = "interior pointer";
    } else if (kind == 2) {
      static const std::uintptr_t foreign[] = {0x1234000, 0x7f0000000000ULL - 512, 1,
                                               0xdeadbeef000ULL};
      p = reinterpret_cast<void*>(foreign[src.byte() % 4]);
      expect = "unknown pointer";
    } else {
      p = nullptr;
    }
    note("bad pointer kind " + std::to_string(kind));
    settle_worker();
    const std::string before = alloc_->stats().to_string();
    const int which = src.byte() % 3;
    bool threw = false;
    try {
      if (which == 0) alloc_->deallocate(p);
      else if (which == 1) alloc_->deallocate(p, streams_[0].handle);
      else alloc_->record_stream(p, streams_[0].handle);
    } catch (const invalid_pointer& e) {
      threw = true;
      require(expect.empty() || std::string(e.what()).find(expect) != std::string::npos,
              "invalid_pointer message lacks '" + expect + "': " + e.what());
    }
    require(threw, "a bad pointer was accepted");
    require(alloc_->stats().to_string() == before, "a rejected pointer changed the statistics");
  }

  template <class Source>
  void op_queries(Source& src) {
    note("queries");
    if (config_.release_worker && src.byte() % 2 == 0) {
      // The release worker's new operation: wait for it, then its idle state matches the queue.
      settle_worker();
      require(alloc_->release_worker_idle() == (alloc_->pending_release_bytes() == 0),
              "release_worker_idle() disagrees with pending_release_bytes()");
      require(alloc_->stats().release_worker_bytes == 0,
              "release worker bytes in flight after it settled");
    }
    const statistics s = alloc_->stats();
    const std::size_t largest = alloc_->largest_free_block_bytes();
    require(largest <= static_cast<std::size_t>(s.reserved_bytes.current),
            "largest free block above reserved");
    if (!live_.empty()) {
      const live_block& b = live_[pick(src, live_.size())];
      require(alloc_->find_block(b.ptr).size_bytes == b.block_size,
              "find_block changed its answer");
      require(alloc_->find_block(static_cast<char*>(b.ptr) + 1).size_bytes == 0,
              "find_block of an interior address");
    }
    if (src.byte() % 4 == 0) alloc_->reset_peak_stats();
  }

  // Captures across graphs on a stream of its own: graph 1 allocates W in its private pool;
  // graph 2 (a pool of its own or, by a bit, sharing graph 1's) reads and writes W and frees it
  // during its capture; graph 1 is released, empty_cache runs, graph 2 replays over W (a fault
  // if W was released or reused under it), then graph 2 is released. Skipped while a hold is
  // unopened: the next capture's release of released pools waits on every stream's fence.
  template <class Source>
  void op_graphs(Source& src) {
    const std::uint8_t b = src.byte();
    if (!holds_.empty()) return;
    const bool share = (b & 1) != 0;
    const std::size_t size = (1 + (b >> 1) % 8) * MiB;
    if (!graph_stream_) graph_stream_ = dev_.create_stream();
    const stream_handle s = *graph_stream_;
    note(std::string("graphs across pools, ") + (share ? "shared pool, " : "") +
         std::to_string(size) + " bytes");
    expect_ok("notify_capture_begin", [&] { alloc_->notify_capture_begin(s); });
    dev_.begin_capture(s);
    void* w = nullptr;
    try {
      w = alloc_->allocate(size, s);
    } catch (const out_of_memory&) {
    }
    if (w)
      dev_.launch(
          s, 5,
          {{reinterpret_cast<std::uintptr_t>(w), size, sim::access::write, std::uint8_t{0x61}}},
          "graph 1 writes W");
    const std::uint64_t dev1 = dev_.end_capture(s);
    std::uint64_t g1 = 0;
    expect_ok("notify_capture_end", [&] { g1 = alloc_->notify_capture_end(s); });
    if (w) {
      expect_ok("notify_capture_begin", [&] { alloc_->notify_capture_begin(s, share ? g1 : 0); });
      dev_.begin_capture(s);
      dev_.launch(
          s, 5,
          {{reinterpret_cast<std::uintptr_t>(w), size, sim::access::read, std::nullopt},
           {reinterpret_cast<std::uintptr_t>(w), size, sim::access::write, std::uint8_t{0x62}}},
          "graph 2 uses W");
      expect_ok("deallocate during a capture", [&] { alloc_->deallocate(w); });
      require(share || alloc_->held_free_count() == 1,
              "a free of graph 1's block during graph 2's capture not held");
      const std::uint64_t dev2 = dev_.end_capture(s);
      std::uint64_t g2 = 0;
      expect_ok("notify_capture_end", [&] { g2 = alloc_->notify_capture_end(s); });
      dev_.launch_graph(dev1, s);  // graph 1, then graph 2 (in order, as a shared pool asks)
      expect_ok("notify_graph_released(1)", [&] { alloc_->notify_graph_released(g1); });
      expect_ok("empty_cache", [&] { alloc_->empty_cache(); });
      dev_.launch_graph(dev2, s);
      expect_ok("notify_graph_released(2)", [&] { alloc_->notify_graph_released(g2); });
    } else {
      dev_.launch_graph(dev1, s);
      expect_ok("notify_graph_released", [&] { alloc_->notify_graph_released(g1); });
    }
    require(alloc_->held_free_count() == 0, "held frees left after every graph was released");
  }

  // IPC: a live block exported to a consumer allocator on this device and read
  // on the consumer's stream; the producer frees it before or after the consumer's release, then
  // reallocates its size and calls empty_cache(defer). Once freed and released by the consumer,
  // the block is the program's no more: the allocator may hand its memory out again behind a
  // stream wait on the consumer's release event (the simulated device faults any reuse not
  // ordered after the consumer's read). Afterwards no export and no held free remain.
  template <class Source>
  void op_ipc(Source& src) {
    const std::uint8_t b = src.byte();
    if (live_.empty() || armed_ || !holds_.empty()) return;
    const std::size_t i = pick(src, live_.size());
    const live_block blk = live_[i];
    const std::uint64_t read_us = 1 + (b >> 2);
    const bool free_first = (b & 1) != 0;
    if (!ipc_consumer_) {
      ipc_consumer_.emplace(dev_, options{});
      ipc_stream_ = dev_.create_stream();
    }
    note("ipc export of block " + std::to_string(i) + (free_first ? ", free first" : ""));
    ipc_handle h;
    expect_ok("export_block", [&] { h = alloc_->export_block(blk.ptr); });
    imported_block imp;
    expect_ok("import_block", [&] { imp = ipc_consumer_->import_block(h); });
    require(imp.ptr == blk.ptr, "an import is not a view of the exported block");
    // The consumer is ordered after the producer's uses of the block (the caller's part of the
    // protocol: the handle is sent once the producer's writes are done or ordered).
    order_after(ipc_stream_, blk.stream_uid);
    for (std::uint64_t u : blk.users) order_after(ipc_stream_, u);
    const std::uint64_t read = launch_tracked(
        ipc_stream_, read_us,
        {{reinterpret_cast<std::uintptr_t>(blk.ptr), blk.size, sim::access::read, std::nullopt}},
        "ipc consumer read");
    ipc_release r;
    expect_ok("release_import", [&] { r = ipc_consumer_->release_import(imp.ptr, ipc_stream_); });
    if (!free_first)
      expect_ok("notify_import_released", [&] { alloc_->notify_import_released(r); });
    expect_ok("deallocate (exported)", [&] { alloc_->deallocate(blk.ptr); });
    require(alloc_->ipc_status().held_frees == 1, "a free of an exported block was not held");
    held_ = blk;
    if (free_first) expect_ok("notify_import_released", [&] { alloc_->notify_import_released(r); });
    // Freed by the program from here on: the serve path may hand the memory out again behind a
    // stream wait on the consumer's release event (the free is pending, not held, once the
    // import is released).
    {
      const auto at = std::find_if(live_.begin(), live_.end(),
                                   [&](const live_block& l) { return l.ptr == blk.ptr; });
      ++stats_.frees;
      live_.erase(at);
      remember_freed(blk.ptr);
    }
    // A reuse of the size (only in defer mode: a wait-mode out-of-memory retry may wait on the
    // consumer's event, completing the free inside the allocation; in defer mode only the
    // bounded wait on a destroyed stream's pending memory can, which require_same allows).
    const std::size_t slot = pick(src, streams_.size());
    bool reused = false;
    if (config_.mode == empty_cache_mode::defer) {
      if (auto j = allocate_on(slot, blk.size, 1)) {
        reused = true;
        free_block(*j, std::nullopt);
      }
    }
    expect_ok("empty_cache(defer)", [&] { alloc_->empty_cache(empty_cache_mode::defer); });
    for (int n = 0; n < 100000 && !dev_.completed(read); ++n) dev_.advance(read_us + 1);
    require(dev_.completed(read), "the consumer's read never completed");
    expect_ok("reclaim", [&] { alloc_->reclaim(); });
    const auto st = alloc_->ipc_status();
    require(st.held_frees == 0 && st.exports == 0,
            "an export or its held free outlived the consumer's completed read");
    held_.reset();
    // The simulated import is a view at the producer's own address (a real one is the
    // consumer's own mapping): before the consumer closes it, the work of a reuse of that memory
    // must be done, or closing the view reads as a release under the producer's work.
    if (reused) dev_.run_until_idle();
    expect_ok("consumer reclaim", [&] { ipc_consumer_->reclaim(); });
  }

  // Allocate, use, free at once (the hot path), with whatever failure is armed.
  template <class Source>
  void op_churn(Source& src) {
    const std::size_t slot = pick(src, streams_.size());
    const std::size_t size = 1 + u16(src) * 8;
    auto i = allocate_on(slot, size, 1);
    if (i) free_block(*i, std::nullopt);
  }

  program_config config_;
  sim::simulated_device dev_;
  // The allocator's view of dev_: records the physical memory behind each mapping, so that the
  // reference oracle also judges from what the device holds (whole chunks), as the checker does.
  test::recording_device rec_{dev_};
  std::optional<caching_allocator> alloc_;
  std::vector<stream_slot> streams_;
  std::uint64_t next_uid_ = 1;
  std::vector<live_block> live_;
  std::vector<void*> freed_;
  std::vector<std::uint64_t> holds_;
  std::map<std::uint64_t, std::vector<event_handle>>
      owed_;                                            // stream uid -> events of unrecorded uses
  std::map<std::uint64_t, event_handle> final_events_;  // dead stream uid -> its last event
  std::optional<armed_failure> armed_;
  std::optional<stream_handle> graph_stream_;  // op_graphs' capturing stream (no other op uses it)
  std::optional<caching_allocator> ipc_consumer_;  // op_ipc's consumer (same device)
  std::optional<live_block> held_;  // op_ipc: the exported block freed, its free held
  stream_handle ipc_stream_ = 0;    // its stream (no other op uses it)
  std::uint64_t since_check_ = 0;
  std::uint64_t work_ends_us_ = 0;  // launch_tracked: all enqueued work ends by then at the latest
  program_stats stats_;
  bool keep_trace_ = false;
  std::vector<std::string> trace_;
};

}  // namespace streamsafe::fuzz
