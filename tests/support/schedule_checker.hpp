// Test support: the schedule checker. Threads, each with its own stream, drive one allocator
// with a memory limit over the simulated device (allocate, free, record_stream, frees on other
// streams, empty_cache in both modes, reclaim, pause and resume of a tag, statistics and
// snapshot reads, IPC export to a consumer allocator), and every step is checked:
//   fault     the simulated device records no fault;
//   limit     reserved never passes the limit: the statistics (current and peak), the
//             snapshot's reserved;
//   device-limit  nor the device's own bytes and their peak (recording_device);
//   oom       no out_of_memory while the oracle (support/could_serve.hpp), evaluated just before
//             the call, says the request could be served (also for resume);
//   oracle    the oracle's two views agree (the snapshot never keeps more than the device);
//   snapshot-sum  the snapshot's segments map what its reserved counts (each byte once);
//   accounting    between turns with the release worker off, reserved is what the device holds;
//   invariants, snapshot, error   check_invariants, the snapshot's consistency, an unexpected
//             exception.
// Interleavings:
//   * turn-taking (run_turns): the threads block on a turn token between operations; a
//     scheduler seeded from the seed gives the turn to one thread at a time and advances the
//     simulated clock after each step. A seed and the list of turns reproduce the run (the
//     release worker, when on, still runs by itself: its timing is not replayed);
//   * every interleaving (run_all_interleavings): a small program of two threads (a prologue,
//     then 2-3 operations each), run once for each order of those operations;
//   * free-running (run_free): the threads run at once, with a clock thread; an out_of_memory is
//     judged only when no other allocation or resume overlapped the call (else inconclusive).
// Each thread's operations come from its own generator seeded from the seed, drawn the same way
// whatever the state, so a thread's k-th operation is the same in every interleaving. Kernels
// run at most 1 ms and the clock advances after each step, so no stream is held anywhere near
// the allocator's bounded wait (1 s): every fence completes within it.
#pragma once

#include "support/could_serve.hpp"
#include "support/sim_fixture.hpp"

#include <streamsafe/core/caching_allocator.hpp>
#include <streamsafe/core/errors.hpp>
#include <streamsafe/core/sleep.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace streamsafe::test::checker {

enum class op_kind : std::uint8_t {
  allocate,
  allocate_tagged,
  free_host,
  record_then_free,  // a read on another thread's stream, record_stream, host free
  free_on_other,     // a read on another thread's stream, stream-ordered free there
  record_only,       // a read on another thread's stream, record_stream; the block stays live
  empty_cache_wait,
  empty_cache_defer,
  reclaim,
  pause_tag,
  resume_tag,
  read_stats,
  read_snapshot,
  ipc_share,  // export to the consumer allocator, a read there, release; the block stays live
};

inline const char* to_string(op_kind k) {
  switch (k) {
    case op_kind::allocate: return "allocate";
    case op_kind::allocate_tagged: return "allocate_tagged";
    case op_kind::free_host: return "free";
    case op_kind::record_then_free: return "record_stream+free";
    case op_kind::free_on_other: return "free_on_other_stream";
    case op_kind::record_only: return "record_stream";
    case op_kind::empty_cache_wait: return "empty_cache(wait)";
    case op_kind::empty_cache_defer: return "empty_cache(defer)";
    case op_kind::reclaim: return "reclaim";
    case op_kind::pause_tag: return "pause";
    case op_kind::resume_tag: return "resume";
    case op_kind::read_stats: return "stats";
    case op_kind::read_snapshot: return "snapshot";
    case op_kind::ipc_share: return "ipc_share";
  }
  return "?";
}

struct op {
  op_kind kind = op_kind::read_stats;
  std::size_t size_bytes = 0;
  std::uint32_t pick = 0;
  std::uint32_t duration_us = 0;
};

struct config {
  std::uint64_t seed = 0;
  backend_kind backend = backend_kind::cuda_malloc;
  empty_cache_mode mode = empty_cache_mode::wait;
  bool release_worker = false;
  std::size_t limit_bytes = 256 * MiB;
  int threads = 2;
  std::size_t chunk_bytes = 20 * MiB;  // expandable large-pool chunk (and peak chunk)
  std::size_t chunks_per_peak = 0;     // expandable_chunks_per_peak: 16 makes chunks of 2-20 MiB
  bool tags = false;                   // expandable: each thread's tag, paused and resumed
  bool ipc = false;
  int max_live = 6;  // blocks a thread holds at most

  std::string to_string() const {
    std::ostringstream os;
    os << "seed " << seed << ": backend:" << streamsafe::to_string(backend)
       << " empty_cache:" << streamsafe::to_string(mode)
       << " release_worker:" << (release_worker ? "on" : "off") << " limit:" << limit_bytes / MiB
       << "MiB threads:" << threads;
    if (backend == backend_kind::expandable) os << " chunk:" << chunk_bytes / MiB << "MiB";
    if (chunks_per_peak != 0) os << " chunks_per_peak:" << chunks_per_peak;
    os << " tags:" << tags << " ipc:" << ipc;
    return os.str();
  }

  // Every choice from the seed.
  static config from_seed(std::uint64_t seed, int min_threads, int max_threads) {
    std::mt19937_64 g(seed * 0x9E3779B97F4A7C15ULL + 1);
    config c;
    c.seed = seed;
    c.backend = g() % 2 ? backend_kind::expandable : backend_kind::cuda_malloc;
    c.mode = g() % 2 ? empty_cache_mode::defer : empty_cache_mode::wait;
    c.release_worker = c.mode == empty_cache_mode::defer && g() % 2 == 0;
    static constexpr std::size_t limits[] = {128 * MiB, 256 * MiB, 512 * MiB};
    c.limit_bytes = limits[g() % 3];
    c.threads = min_threads + static_cast<int>(g() % (max_threads - min_threads + 1));
    c.chunk_bytes = g() % 2 ? 2 * MiB : 20 * MiB;
    c.tags = c.backend == backend_kind::expandable && g() % 2 == 0;
    c.ipc = g() % 3 == 0;
    // Drawn last, so that every earlier choice of a seed stays what it was.
    c.chunks_per_peak = c.backend == backend_kind::expandable && c.chunk_bytes == 20 * MiB &&
                                g() % 2 == 0
                            ? 16
                            : 0;
    return c;
  }
};

struct step_record {
  int thread = 0;
  op what;
  std::string outcome;
  std::uint64_t begin = 0, end = 0;  // free-running: the step's place in the global order
};

struct violation {
  std::string kind;
  std::string message;
};

struct run_result {
  config cfg;
  std::vector<step_record> steps;
  std::optional<violation> failure;  // the first
  std::vector<violation> notes;      // kinds that did not end the run: the first of each
  std::uint64_t ooms = 0;            // out_of_memory (allocate and resume) seen
  std::uint64_t oom_judged = 0;      // of them, judged against the oracle
  std::uint64_t inconclusive = 0;    // free-running: an overlapping growth made it unjudgeable

  std::string turns() const {
    std::string t;
    for (const auto& s : steps) t += std::to_string(s.thread);
    return t;
  }
  std::string replay_text() const {
    std::ostringstream os;
    os << cfg.to_string() << "\nturns: " << turns() << "\n";
    std::size_t i = 0;
    for (const auto& s : steps) {
      os << "  " << i++ << ": t" << s.thread << " " << to_string(s.what.kind);
      if (s.what.kind == op_kind::allocate || s.what.kind == op_kind::allocate_tagged)
        os << " " << s.what.size_bytes;
      os << " -> " << s.outcome;
      if (s.end != 0) os << " [" << s.begin << ", " << s.end << "]";
      os << "\n";
    }
    for (const auto& n : notes) os << "violation [" << n.kind << "]: " << n.message << "\n";
    if (failure) os << "violation [" << failure->kind << "]: " << failure->message << "\n";
    return os.str();
  }
};

// A thrown check: ends the run.
struct violation_error : std::exception {
  violation v;
  explicit violation_error(violation x) : v(std::move(x)) {}
  const char* what() const noexcept override { return v.message.c_str(); }
};

// One thread's generator of operations: the same draws whatever the state.
class op_source {
 public:
  op_source(std::uint64_t seed, int thread, const config& c, bool small_program)
      : g_(seed * 1000003ULL + static_cast<std::uint64_t>(thread) * 7919ULL + 17), c_(c),
        small_program_(small_program) {}

  op next() {
    op o;
    const std::uint64_t kind_draw = g_() % 100;
    const std::uint64_t size_class = g_() % 4;
    const std::uint64_t size_draw = g_();
    o.pick = static_cast<std::uint32_t>(g_() % 1024);
    o.duration_us = static_cast<std::uint32_t>(g_() % 1001);
    o.kind = kind_of(kind_draw);
    const std::size_t large_max = std::max<std::size_t>(c_.limit_bytes / 3, 12 * MiB);
    std::size_t lo = 0, hi = 0;
    if (size_class == 0) {
      lo = 512, hi = MiB;
    } else if (size_class == 1) {
      lo = MiB + 512, hi = 10 * MiB - 512;
    } else {
      lo = 10 * MiB, hi = large_max;
    }
    o.size_bytes = (lo + size_draw % (hi - lo + 1)) / 512 * 512;
    if (o.size_bytes == 0) o.size_bytes = 512;
    return o;
  }

 private:
  // Bands of a draw in [0, 100): the kind of the first band whose bound is above the draw.
  struct band {
    std::uint64_t below;
    op_kind kind;
  };
  // Small programs: mostly what moves memory between states.
  static constexpr band k_small_bands[] = {
      {40, op_kind::allocate},  {55, op_kind::record_then_free},  {65, op_kind::free_on_other},
      {75, op_kind::free_host}, {83, op_kind::empty_cache_defer}, {88, op_kind::empty_cache_wait},
      {93, op_kind::pause_tag}, {100, op_kind::resume_tag}};
  static constexpr band k_bands[] = {
      {28, op_kind::allocate},         {36, op_kind::allocate_tagged},   {48, op_kind::free_host},
      {58, op_kind::record_then_free}, {65, op_kind::free_on_other},     {69, op_kind::record_only},
      {73, op_kind::empty_cache_wait}, {78, op_kind::empty_cache_defer}, {80, op_kind::reclaim},
      {83, op_kind::pause_tag},        {87, op_kind::resume_tag},        {90, op_kind::read_stats},
      {93, op_kind::read_snapshot},    {100, op_kind::ipc_share}};

  op_kind kind_of(std::uint64_t d) const {
    const band* bands = small_program_ ? k_small_bands : k_bands;
    std::size_t n = small_program_ ? std::size(k_small_bands) : std::size(k_bands);
    op_kind k = op_kind::allocate;
    for (std::size_t i = 0; i < n; ++i) {
      if (d < bands[i].below) {
        k = bands[i].kind;
        break;
      }
    }
    // Without tags (cuda_malloc, or off) or IPC, their operations become ordinary ones.
    if (!c_.tags && k == op_kind::pause_tag) return op_kind::free_host;
    if (!c_.tags && (k == op_kind::allocate_tagged || k == op_kind::resume_tag))
      return op_kind::allocate;
    if (!c_.ipc && k == op_kind::ipc_share) return op_kind::allocate;
    return k;
  }

  std::mt19937_64 g_;
  const config& c_;
  bool small_program_;
};

// The allocator under test, its device, and the threads' blocks.
class world {
 public:
  enum class judging { exact, free_running };

  explicit world(const config& c, judging j)
      : cfg_(c), judging_(j), dev_(sim_config(8 * GiB)), rec_(dev_) {
    options o = make_options(c.backend, fence_scope::all_streams, c.mode);
    o.memory_limit_bytes = c.limit_bytes;
    o.release_worker = c.release_worker ? release_worker_mode::on : release_worker_mode::off;
    o.expandable_chunk_bytes = c.chunk_bytes;
    o.expandable_peak_chunk_bytes = c.chunk_bytes;
    o.expandable_chunks_per_peak = c.chunks_per_peak;
    alloc_ = std::make_unique<caching_allocator>(rec_, o);
    rec_.set_trap_bytes(c.limit_bytes);
    if (c.ipc) {
      consumer_ = std::make_unique<caching_allocator>(dev_, make_options(c.backend));
      consumer_stream_ = dev_.create_stream();
    }
    for (int i = 0; i < c.threads; ++i) {
      threads_.push_back({});
      threads_.back().stream = dev_.create_stream();
      threads_.back().tag = "checker-" + std::to_string(i);
    }
  }

  ~world() {
    try {
      drain();
    } catch (...) {
    }
    alloc_.reset();
    consumer_.reset();
  }

  world(const world&) = delete;
  world& operator=(const world&) = delete;

  const config& cfg() const { return cfg_; }
  sim::simulated_device& device() { return dev_; }
  caching_allocator& allocator() { return *alloc_; }
  std::uint64_t ooms() const { return ooms_; }
  std::uint64_t oom_judged() const { return oom_judged_; }
  std::uint64_t inconclusive() const { return inconclusive_; }
  const std::vector<violation>& notes() const { return notes_; }

  // Runs one operation on thread i; returns its outcome. Throws violation_error.
  std::string step(int i, const op& o) {
    try {
      return run_op(i, o);
    } catch (const violation_error&) {
      throw;
    } catch (const std::exception& e) {
      throw violation_error({"error", std::string(to_string(o.kind)) + " threw: " + e.what()});
    }
  }

  // The checks between steps (with no step running, but for the release worker).
  void check_all() {
    check_cheap();
    const memory_snapshot snap = alloc_->snapshot();
    std::size_t segment_bytes = 0;
    for (const auto& seg : snap.segments) segment_bytes += seg.mapped_bytes;
    const auto snap_reserved = static_cast<std::size_t>(snap.stats.reserved_bytes.current);
    if (snap_reserved > cfg_.limit_bytes)
      fail("limit", "the snapshot's reserved " + std::to_string(snap_reserved) +
                        " bytes, above the limit " + std::to_string(cfg_.limit_bytes));
    // Each byte in one place: the segments map what reserved counts (an alias of queued
    // memory at a second address is the same memory, counted at both addresses otherwise).
    if ((segment_bytes > cfg_.limit_bytes || segment_bytes != snap_reserved) &&
        !noted("snapshot-sum"))
      note("snapshot-sum", "the snapshot's segments map " + std::to_string(segment_bytes) +
                               " bytes, its reserved is " + std::to_string(snap_reserved) +
                               " (limit " + std::to_string(cfg_.limit_bytes) + ", the device " +
                               std::to_string(rec_.bytes()) + "); " + describe(snap));
    // With no step running and no worker, reserved is what the device holds.
    if (!cfg_.release_worker && judging_ == judging::exact && snap_reserved != rec_.bytes() &&
        !noted("accounting"))
      note("accounting", "the snapshot's reserved " + std::to_string(snap_reserved) +
                             " bytes, the device holds " + std::to_string(rec_.bytes()));
    try {
      snap.check_consistency();
    } catch (const std::exception& e) {
      fail("snapshot", e.what());
    }
    try {
      alloc_->check_invariants();
    } catch (const std::exception& e) {
      fail("invariants", e.what());
    }
    // The oracle's two views: the snapshot never keeps more than the device.
    bool pausing = false;
    for (auto& t : threads_) pausing = pausing || t.tag_paused;
    if (!pausing) {
      const std::size_t snap_kept = oracle_kept_bytes(snap);
      const std::size_t dev_kept = rec_.kept_bytes(live_ranges());
      if (snap_kept > dev_kept)
        fail("oracle", "the snapshot keeps " + std::to_string(snap_kept) +
                           " bytes, the device only " + std::to_string(dev_kept) + "; " +
                           active_not_live(snap));
      // Equal when the device's pieces are the snapshot's units: segments, or 2 MiB chunks
      // (a tag resumed in larger handles keeps whole handles, more than the granules).
      if (cfg_.backend == backend_kind::cuda_malloc ||
          (cfg_.chunk_bytes == 2 * MiB && rec_.largest_physical_bytes() <= 2 * MiB)) {
        if (held_.empty() && snap_kept != dev_kept)
          fail("oracle", "the snapshot keeps " + std::to_string(snap_kept) + " bytes, the device " +
                             std::to_string(dev_kept));
      }
    }
  }

  // With no step running and no release worker (free-running: a thread that holds every step
  // out), reserved is what the device holds; `window` names the steps since the last such check.
  void check_quiet(const std::string& window) {
    if (cfg_.release_worker) return;
    const auto reserved = static_cast<std::size_t>(alloc_->stats().reserved_bytes.current);
    if (reserved != rec_.bytes())
      fail("accounting", "reserved " + std::to_string(reserved) + " bytes, the device holds " +
                             std::to_string(rec_.bytes()) + ", " + window + "; " +
                             describe(alloc_->snapshot()));
  }

  // Faults and the limit: cheap enough for every step of a free-running thread.
  void check_cheap() {
    if (dev_.fault_count() != 0) fail("fault", dev_.faults().front().message);
    const statistics st = alloc_->stats();
    if (static_cast<std::size_t>(st.reserved_bytes.current) > cfg_.limit_bytes ||
        static_cast<std::size_t>(st.reserved_bytes.peak) > cfg_.limit_bytes)
      fail("limit", "statistics: reserved " + std::to_string(st.reserved_bytes.current) +
                        ", peak " + std::to_string(st.reserved_bytes.peak) + ", above the limit " +
                        std::to_string(cfg_.limit_bytes));
    if (rec_.peak_bytes() > cfg_.limit_bytes || dev_.bytes_in_use() > cfg_.limit_bytes)
      fail("device-limit",
           "the device held " + std::to_string(rec_.peak_bytes()) + " bytes at its peak (now " +
               std::to_string(dev_.bytes_in_use()) + "), above the limit " +
               std::to_string(cfg_.limit_bytes) + "; statistics: reserved " +
               std::to_string(st.reserved_bytes.current) + "; " + describe(alloc_->snapshot()));
  }

  // Frees everything and lets the device go idle (end of a run).
  void drain() {
    for (int i = 0; i < cfg_.threads; ++i) {
      auto& t = threads_[static_cast<std::size_t>(i)];
      while (!t.live.empty()) {
        alloc_->deallocate(t.live.back().ptr);
        t.live.pop_back();
      }
    }
    dev_.run_until_idle();
    if (consumer_) consumer_->reclaim();
    alloc_->empty_cache(empty_cache_mode::wait);
  }

 private:
  struct block {
    void* ptr = nullptr;
    std::size_t size_bytes = 0;   // requested
    std::size_t block_bytes = 0;  // find_block
    bool tagged = false;
    bool exported = false;
    bool read_elsewhere = false;   // read on another thread's stream: never exported then
    std::uint64_t registered = 0;  // its entry in the registry (register_block)
  };
  struct thread_state {
    stream_handle stream = 0;
    std::string tag;
    bool tag_paused = false;  // pausing, paused or not fully resumed
    std::vector<block> live;
  };

  [[noreturn]] void fail(const std::string& kind, const std::string& message) {
    throw violation_error({kind, message});
  }
  // A violation that does not end the run (the allocator's state is intact): its first
  // occurrence is kept.
  bool noted(const std::string& kind) const {
    for (const auto& n : notes_)
      if (n.kind == kind) return true;
    return false;
  }
  void note(const std::string& kind, const std::string& message) {
    notes_.push_back({kind, message});
  }

  std::vector<std::pair<std::uintptr_t, std::size_t>> live_ranges() {
    std::lock_guard<std::mutex> lk(registry_mu_);
    std::vector<std::pair<std::uintptr_t, std::size_t>> r;
    for (const auto& [a, e] : registry_) r.emplace_back(a, e.first);
    r.insert(r.end(), held_.begin(), held_.end());
    return r;
  }
  // Returns the entry's number: once a block is freed, another thread may get its address and
  // register it before the freeing thread unregisters, which must then leave the new entry.
  std::uint64_t register_block(void* p, std::size_t n) {
    std::lock_guard<std::mutex> lk(registry_mu_);
    registry_[addr(p)] = {n, ++registered_};
    return registered_;
  }
  void unregister_block(const block& b) {
    std::lock_guard<std::mutex> lk(registry_mu_);
    const auto it = registry_.find(addr(b.ptr));
    if (it != registry_.end() && it->second.second == b.registered) registry_.erase(it);
    // A free of an exported block may be held: counted live until the allocator has no held
    // frees (conservative for the device's view).
    if (b.exported) held_[addr(b.ptr)] = b.block_bytes;
  }
  void forget_held_if_none() {
    if (alloc_->ipc_status().held_frees != 0) return;
    std::lock_guard<std::mutex> lk(registry_mu_);
    held_.clear();
  }

  // Orders stream `waiter` after the work enqueued so far on `after` (the program's own order).
  void order_after(stream_handle waiter, stream_handle after) {
    if (waiter == after) return;
    const event_handle e = dev_.create_event();
    dev_.record_event(e, after);
    dev_.stream_wait_event(waiter, e);
    dev_.destroy_event(e);
  }

  stream_handle other_stream(int i, std::uint32_t pick) const {
    const int n = cfg_.threads;
    const int j = (i + 1 + static_cast<int>(pick % static_cast<std::uint32_t>(n - 1))) % n;
    return threads_[static_cast<std::size_t>(j)].stream;
  }

  // A live block of thread i that work may touch (not under a paused tag, not exported), or -1.
  int usable_block(int i, std::uint32_t pick, bool untagged_only = false) const {
    const auto& t = threads_[static_cast<std::size_t>(i)];
    const std::size_t n = t.live.size();
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t at = (pick + k) % n;
      const block& b = t.live[at];
      if (b.tagged && (t.tag_paused || untagged_only)) continue;
      // The simulated consumer's import is a view at the block's own address: its close would
      // see the producer's reads there on other streams as its own pending work (two processes
      // would not): an exported block is read elsewhere by the consumer only, and only a block
      // never read on another stream is exported.
      if (b.exported || (untagged_only && b.read_elsewhere)) continue;
      return static_cast<int>(at);
    }
    return -1;
  }

  // A growth-like call (allocate, resume) on thread i, judged against the oracle.
  struct judgement {
    bool could = false;
    std::string why;
    bool exact = true;
  };
  // The two counts move together, under growth_mu_: with two separate atomic steps, a growth B
  // could count as started before A and in flight after A, and A be judged exact while B ran
  // beside it (the snapshot then lacked B's allocation).
  struct growth_guard {
    world& w;
    std::uint64_t started = 0;
    int in_flight_before = 0;
    explicit growth_guard(world& x) : w(x) {
      std::lock_guard<std::mutex> lk(x.growth_mu_);
      started = x.growth_started_.fetch_add(1) + 1;
      in_flight_before = x.growth_in_flight_.fetch_add(1);
    }
    ~growth_guard() { w.growth_in_flight_.fetch_sub(1); }
    bool exact() const {
      return w.judging_ == judging::exact ||
             (in_flight_before == 0 && w.growth_started_.load() == started);
    }
  };

  // An out_of_memory of a growth-like call: a violation when the oracle said it could serve
  // and no other growth overlapped the call.
  std::string judge_oom(const growth_guard& guard, bool could, const std::string& call,
                        const out_of_memory& e) {
    ++ooms_;
    if (!guard.exact()) {
      ++inconclusive_;
      return "out_of_memory (not judged: an overlapping growth)";
    }
    ++oom_judged_;
    if (could)
      fail("oom", "out_of_memory while the oracle says it could serve: " + call +
                      "\nmessage: " + e.what());
    return "out_of_memory";
  }

  judgement judge_allocate(int i, std::size_t size, bool tagged) {
    const auto& t = threads_[static_cast<std::size_t>(i)];
    const memory_snapshot snap = alloc_->snapshot();
    oracle_request r;
    r.size_bytes = size;
    r.stream = t.stream;
    r.tag = tagged ? t.tag : std::string();
    const oracle_verdict s = oracle_from_snapshot(snap, cfg_.backend, cfg_.limit_bytes, r);
    const oracle_verdict d = rec_.verdict(live_ranges(), cfg_.backend, cfg_.limit_bytes,
                                          s.new_bytes);
    judgement j;
    j.could = (s.fits_growth() && d.fits_growth()) || s.fits_free_block;
    j.why = "snapshot: " + s.to_string() + "; device: " + d.to_string() + "; " + describe(snap);
    return j;
  }

  // The snapshot's active blocks that the program does not hold (for messages).
  std::string active_not_live(const memory_snapshot& snap) {
    const auto live = live_ranges();
    std::ostringstream os;
    os << "active blocks the program does not hold:";
    std::size_t n = 0;
    for (const auto& seg : snap.segments) {
      for (const auto& b : seg.blocks) {
        if (b.state != snapshot_block_state::active) continue;
        bool held = false;
        for (const auto& [a, size] : live) held = held || (a == b.address);
        if (held || ++n > 8) continue;
        os << " " << b.address << "+" << b.size_bytes << " (stream " << b.stream << ", segment of "
           << seg.size_bytes << ")";
      }
    }
    if (n == 0) os << " none (the device's segments differ)";
    return os.str();
  }

  // Reserved split by state, for messages.
  static std::string describe(const memory_snapshot& snap) {
    std::size_t by[5] = {};
    for (const auto& seg : snap.segments)
      for (const auto& b : seg.blocks) by[static_cast<int>(b.state)] += b.size_bytes;
    std::ostringstream os;
    os << "reserved " << snap.stats.reserved_bytes.current << " (active " << by[0]
       << ", pending_free " << by[1] << ", inactive " << by[2] << ", releasing " << by[4] << ") in "
       << snap.segments.size() << " segments";
    // STREAMSAFE_CHECKER_DUMP=1: every segment and its blocks (state:bytes), for a replayed seed.
    const char* dump = std::getenv("STREAMSAFE_CHECKER_DUMP");
    if (dump != nullptr && *dump == '1') {
      static const char* const names[] = {"active", "pending", "inactive", "unmapped", "releasing"};
      for (const auto& seg : snap.segments) {
        os << "\n  segment " << std::hex << seg.address << std::dec << " stream " << seg.stream
           << " tag '" << seg.tag << "' " << (seg.pool == snapshot_pool::small ? "small" : "large")
           << " size " << seg.size_bytes << " mapped " << seg.mapped_bytes << " paused "
           << seg.paused_bytes << " aliased " << seg.aliased_bytes << ":";
        for (const auto& b : seg.blocks)
          os << " " << names[static_cast<int>(b.state)] << ":" << b.size_bytes;
      }
    }
    return os.str();
  }

  std::string run_op(int i, const op& o) {
    auto& t = threads_[static_cast<std::size_t>(i)];
    switch (o.kind) {
      case op_kind::allocate:
      case op_kind::allocate_tagged: {
        const bool tagged = o.kind == op_kind::allocate_tagged;
        if (static_cast<int>(t.live.size()) >= cfg_.max_live) return free_one(i, o.pick);
        if (tagged && t.tag_paused) return "skipped (tag paused)";
        growth_guard guard(*this);
        const judgement j = judge_allocate(i, o.size_bytes, tagged);
        void* p = nullptr;
        try {
          if (tagged) {
            tag_scope scope(t.tag);
            p = alloc_->allocate(o.size_bytes, t.stream);
          } else {
            p = alloc_->allocate(o.size_bytes, t.stream);
          }
        } catch (const out_of_memory& e) {
          return judge_oom(guard, j.could,
                           "allocate(" + std::to_string(o.size_bytes) + ") on t" +
                               std::to_string(i) + (tagged ? " (tagged)" : "") + ": " + j.why,
                           e);
        }
        const caching_allocator::block_info info = alloc_->find_block(p);
        block b{p, o.size_bytes, info.size_bytes, tagged, false, false, 0};
        b.registered = register_block(p, info.size_bytes);
        t.live.push_back(b);
        dev_.launch(t.stream, o.duration_us, {writes(p, o.size_bytes)}, "write after allocate");
        return "ok";
      }
      case op_kind::free_host: return free_one(i, o.pick);
      case op_kind::record_then_free:
      case op_kind::free_on_other:
      case op_kind::record_only: {
        const int k = usable_block(i, o.pick);
        if (k < 0) return "skipped (no usable block)";
        t.live[static_cast<std::size_t>(k)].read_elsewhere = true;
        const block b = t.live[static_cast<std::size_t>(k)];
        const stream_handle other = other_stream(i, o.pick);
        order_after(other, t.stream);
        dev_.launch(other, o.duration_us, {reads(b.ptr, b.size_bytes)}, "read on another stream");
        if (o.kind == op_kind::free_on_other) {
          remove_live(i, k);
          alloc_->deallocate(b.ptr, other);
          unregister_block(b);
          return "ok";
        }
        alloc_->record_stream(b.ptr, other);
        if (o.kind == op_kind::record_only) return "ok";
        remove_live(i, k);
        alloc_->deallocate(b.ptr);
        unregister_block(b);
        return "ok";
      }
      case op_kind::empty_cache_wait:
        alloc_->empty_cache(empty_cache_mode::wait);
        forget_held_if_none();
        return "ok";
      case op_kind::empty_cache_defer:
        alloc_->empty_cache(empty_cache_mode::defer);
        forget_held_if_none();
        return "ok";
      case op_kind::reclaim:
        alloc_->reclaim();
        forget_held_if_none();
        return "ok";
      case op_kind::pause_tag: {
        if (t.tag_paused) return "skipped (paused)";
        t.tag_paused = true;  // before the call: no work touches its blocks from now on
        const pause_status s = alloc_->pause(t.tag, pause_mode::discard);
        return std::string("ok (") + to_string(s.phase) + ")";
      }
      case op_kind::resume_tag: {
        if (!t.tag_paused) return "skipped (active)";
        growth_guard guard(*this);
        const memory_snapshot snap = alloc_->snapshot();
        const oracle_verdict v = oracle_resume_from_snapshot(snap, cfg_.limit_bytes, t.tag);
        // The device's whole chunks too (with chunks above 2 MiB the snapshot's granules
        // count less).
        const oracle_verdict d = rec_.verdict(live_ranges(), cfg_.backend, cfg_.limit_bytes,
                                              v.new_bytes);
        try {
          alloc_->resume(t.tag);
        } catch (const out_of_memory& e) {
          return judge_oom(guard, v.could_serve && d.could_serve,
                           "resume(" + t.tag + "): snapshot: " + v.to_string() +
                               "; device: " + d.to_string() + "; " + describe(snap),
                           e);
        }
        t.tag_paused = alloc_->tag_status(t.tag).phase != tag_phase::active;
        return t.tag_paused ? "ok (not active yet)" : "ok";
      }
      case op_kind::read_stats: {
        (void)alloc_->stats();
        return "ok";
      }
      case op_kind::read_snapshot: {
        const memory_snapshot s = alloc_->snapshot();
        try {
          s.check_consistency();
        } catch (const std::exception& e) {
          fail("snapshot", e.what());
        }
        return "ok";
      }
      case op_kind::ipc_share: {
        if (!consumer_) return "skipped (no ipc)";
        const int k = usable_block(i, o.pick, true);
        if (k < 0) return "skipped (no block to export)";
        block& b = t.live[static_cast<std::size_t>(k)];
        const ipc_handle h = alloc_->export_block(b.ptr);
        b.exported = true;
        std::lock_guard<std::mutex> lk(
            consumer_mu_);     // the consumer's stream, one reader at a time
        consumer_->reclaim();  // closes the imports whose reads completed
        const imported_block imp = consumer_->import_block(h);
        order_after(consumer_stream_, t.stream);
        dev_.launch(consumer_stream_, o.duration_us, {reads(imp.ptr, b.size_bytes)},
                    "consumer read");
        alloc_->notify_import_released(consumer_->release_import(imp.ptr, consumer_stream_));
        return "ok";
      }
    }
    return "?";
  }

  // The consumer waits for its reads and closes its imports (before the producer may reuse an
  // exported block's address: the simulated import is a view at that address).
  void close_imports() {
    std::lock_guard<std::mutex> lk(consumer_mu_);
    const event_handle e = dev_.create_event();
    dev_.record_event(e, consumer_stream_);
    dev_.synchronize_event(e);
    dev_.destroy_event(e);
    consumer_->reclaim();
  }

  void remove_live(int i, int k) {
    auto& live = threads_[static_cast<std::size_t>(i)].live;
    live.erase(live.begin() + k);
  }

  std::string free_one(int i, std::uint32_t pick) {
    auto& t = threads_[static_cast<std::size_t>(i)];
    if (t.live.empty()) return "skipped (nothing to free)";
    const std::size_t k = pick % t.live.size();
    const block b = t.live[k];
    remove_live(i, static_cast<int>(k));
    if (b.exported) close_imports();
    alloc_->deallocate(b.ptr);
    unregister_block(b);
    return "freed";
  }

  config cfg_;
  judging judging_;
  sim::simulated_device dev_;
  recording_device rec_;
  std::unique_ptr<caching_allocator> alloc_;
  std::unique_ptr<caching_allocator> consumer_;
  stream_handle consumer_stream_ = 0;
  std::mutex consumer_mu_;
  std::vector<thread_state> threads_;
  std::mutex registry_mu_;
  // Live blocks: address -> (block bytes, entry number).
  std::map<std::uintptr_t, std::pair<std::size_t, std::uint64_t>> registry_;
  std::uint64_t registered_ = 0;                // the last entry number (registry_mu_)
  std::map<std::uintptr_t, std::size_t> held_;  // freed exported blocks, maybe held
  std::mutex growth_mu_;                        // growth_guard's two counts change together
  std::atomic<std::uint64_t> growth_started_{0};
  std::atomic<int> growth_in_flight_{0};
  std::atomic<std::uint64_t> ooms_{0}, oom_judged_{0}, inconclusive_{0};
  std::vector<violation> notes_;  // written by check_all only (no step running)
};

// The turn token: the scheduler gives the turn to one thread and waits for its step.
class turn_gate {
 public:
  // Scheduler side. False when the step did not end within `limit` (a hang).
  bool give(int thread, std::chrono::seconds limit) {
    std::unique_lock<std::mutex> lk(mu_);
    turn_ = thread;
    done_ = false;
    cv_.notify_all();
    return cv_.wait_for(lk, limit, [this] { return done_; });
  }
  void stop() {
    std::lock_guard<std::mutex> lk(mu_);
    stopped_ = true;
    cv_.notify_all();
  }
  // Thread side: false once stopped.
  bool wait_turn(int thread) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return stopped_ || turn_ == thread; });
    return !stopped_;
  }
  void finish() {
    std::lock_guard<std::mutex> lk(mu_);
    turn_ = -1;
    done_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int turn_ = -1;
  bool done_ = false;
  bool stopped_ = false;
};

[[noreturn]] inline void abort_hang(const run_result& r) {
  std::fprintf(stderr, "\nSCHEDULE CHECKER: a step did not finish within 60 s (a hang)\n%s",
               r.replay_text().c_str());
  std::fflush(stderr);
  std::abort();
}

// Runs thread i's steps when given the turn: the turn order is `turns` (or drawn from the seed
// when empty, `steps` of them); prologue turns first (small programs).
inline run_result run_turns(const config& c, std::vector<int> turns, std::size_t steps,
                            bool small_program = false) {
  run_result r;
  r.cfg = c;
  world w(c, world::judging::exact);
  std::vector<op_source> sources;
  for (int i = 0; i < c.threads; ++i) sources.emplace_back(c.seed, i, c, small_program);
  if (turns.empty()) {
    std::mt19937_64 g(c.seed ^ 0x5DEECE66DULL);
    for (std::size_t s = 0; s < steps; ++s) turns.push_back(static_cast<int>(g() % c.threads));
  }
  std::mt19937_64 clock(c.seed + 99);
  turn_gate gate;
  std::optional<violation> failure;  // written by the thread holding the turn
  std::string outcome;
  op current;
  std::vector<std::thread> threads;
  for (int i = 0; i < c.threads; ++i) {
    threads.emplace_back([&, i] {
      while (gate.wait_turn(i)) {
        current = sources[static_cast<std::size_t>(i)].next();
        try {
          outcome = w.step(i, current);
        } catch (const violation_error& e) {
          failure = e.v;
          outcome = "violation";
        }
        gate.finish();
      }
    });
  }
  for (int i : turns) {
    if (!gate.give(i, std::chrono::seconds(60))) {
      r.steps.push_back({i, current, "hang"});
      abort_hang(r);
    }
    r.steps.push_back({i, current, outcome});
    if (!failure) {
      try {
        w.check_all();
      } catch (const violation_error& e) {
        failure = e.v;
      }
    }
    if (failure) break;
    w.device().advance(clock() % 400);
  }
  gate.stop();
  for (auto& t : threads) t.join();
  r.failure = failure;
  r.notes = w.notes();
  r.ooms = w.ooms();
  r.oom_judged = w.oom_judged();
  return r;
}

// Every interleaving of a small program: each thread's prologue (run in turn), then every order
// of n0 and n1 operations. `visit` sees each run; returns the number of interleavings run.
inline std::size_t run_all_interleavings(const config& c, int prologue, int n0, int n1,
                                         const std::function<bool(const run_result&)>& visit) {
  std::vector<int> base;
  for (int k = 0; k < prologue; ++k) base.push_back(k % 2);
  std::vector<int> tail;
  for (int k = 0; k < n0; ++k) tail.push_back(0);
  for (int k = 0; k < n1; ++k) tail.push_back(1);
  std::size_t count = 0;
  do {
    std::vector<int> turns = base;
    turns.insert(turns.end(), tail.begin(), tail.end());
    ++count;
    if (!visit(run_turns(c, turns, 0, true))) break;
  } while (std::next_permutation(tail.begin(), tail.end()));
  return count;
}

// The threads at once, `steps` each, a clock thread advancing the device meanwhile.
inline run_result run_free(const config& c, std::size_t steps) {
  run_result r;
  r.cfg = c;
  world w(c, world::judging::free_running);
  std::mutex mu;
  std::optional<violation> failure;
  std::atomic<bool> stop{false};
  std::atomic<bool> threads_done{false};
  std::thread clock([&] {
    std::mt19937_64 g(c.seed + 7);
    const auto start = std::chrono::steady_clock::now();
    while (!threads_done.load()) {
      // A watchdog too: a deadlock must not hang CI.
      if (std::chrono::steady_clock::now() - start > std::chrono::seconds(120)) {
        std::fprintf(stderr,
                     "\nSCHEDULE CHECKER: free-running threads did not finish within "
                     "120 s (a hang)\n%s\n",
                     c.to_string().c_str());
        std::fflush(stderr);
        std::abort();
      }
      w.device().advance(g() % 300);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  });
  std::vector<std::thread> threads;
  std::vector<std::vector<step_record>> logs(static_cast<std::size_t>(c.threads));
  // Steps hold `gate` shared; a thread that gets it alone after its step checks the accounting
  // with nothing in flight, so a gap is found within the steps since the last such check.
  std::shared_mutex gate;
  std::atomic<std::uint64_t> order{0};
  std::uint64_t last_quiet = 0;  // under gate, exclusive
  for (int i = 0; i < c.threads; ++i) {
    threads.emplace_back([&, i] {
      op_source src(c.seed, i, c, false);
      for (std::size_t s = 0; s < steps && !stop.load(); ++s) {
        const op o = src.next();
        try {
          std::string out;
          std::uint64_t begin = 0, end = 0;
          {
            std::shared_lock<std::shared_mutex> in_step(gate);
            begin = ++order;
            out = w.step(i, o);
            end = ++order;
          }
          logs[static_cast<std::size_t>(i)].push_back({i, o, out, begin, end});
          w.check_cheap();
          // No step running: reserved must be what the device holds (quiet_check).
          if (gate.try_lock()) {
            std::lock_guard<std::shared_mutex> quiet(gate, std::adopt_lock);
            const std::uint64_t now = order.load();
            w.check_quiet("since step " + std::to_string(last_quiet) + " of the global order (" +
                          std::to_string(now) + " now)");
            last_quiet = now;
          }
        } catch (const violation_error& e) {
          logs[static_cast<std::size_t>(i)].push_back({i, o, "violation"});
          std::lock_guard<std::mutex> lk(mu);
          if (!failure) failure = e.v;
          stop.store(true);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  threads_done.store(true);
  clock.join();
  if (!failure) {
    try {
      w.check_all();
    } catch (const violation_error& e) {
      failure = e.v;
    }
  }
  for (auto& l : logs) r.steps.insert(r.steps.end(), l.begin(), l.end());
  r.failure = failure;
  r.notes = w.notes();
  r.ooms = w.ooms();
  r.oom_judged = w.oom_judged();
  r.inconclusive = w.inconclusive();
  return r;
}

// STREAMSAFE_CHECKER_SECONDS: the time each checker test runs (default 2 s).
inline double run_seconds(double fallback = 2.0) {
  const char* s = std::getenv("STREAMSAFE_CHECKER_SECONDS");
  if (s == nullptr || *s == '\0') return fallback;
  const double v = std::atof(s);
  return v > 0 ? v : fallback;
}

// STREAMSAFE_CHECKER_SEED: run this seed only (a reproducer).
inline std::optional<std::uint64_t> only_seed() {
  const char* s = std::getenv("STREAMSAFE_CHECKER_SEED");
  if (s == nullptr || *s == '\0') return std::nullopt;
  return std::strtoull(s, nullptr, 10);
}

}  // namespace streamsafe::test::checker
