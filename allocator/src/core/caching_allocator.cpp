// streamsafe core: allocation, free, record_stream and bookkeeping of the caching allocator.
//
// Allocation order for a rounded request on stream s (pool = s's small or large pool):
//   1. a good fit among the pool's free blocks (segregated lists, free_lists.hpp); with the
//      cuda_malloc backend a whole free segment far larger than a large request is skipped
//      (segment_fit.hpp) for the best block that may be split;
//   2. a block of the pool whose host free is done but whose other-stream uses are pending:
//      first the pending blocks whose events have completed are retired (process_events_locked,
//      which otherwise runs only when k_pending_batch more blocks are pending), then s waits
//      on the events of the best pending block (stream_wait_event), the host never blocks;
//   3. growth: a new cudaMalloc segment, or more chunks mapped into s's expandable segment;
//      if it would raise peak reserved, the whole segments skipped in step 1 are released first
//      (fenced); at the memory limit, a skipped whole segment is split after all;
//   4. (out of memory) a whole free segment of another stream's pool, moved behind a fence
//      that s waits on; then a safe release of the cache (fenced) and one retry; then
//      out_of_memory.
// Steps 1-2 are the fast path: only s's stream lock is held. Steps 3-4 take the device lock.
// Invariants and the locks: see block.hpp and allocator_state.hpp.
#include "allocator_state.hpp"
#include "logging.hpp"
#include "segment_fit.hpp"
#include "size_classes.hpp"

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <sstream>

namespace streamsafe {

using detail::block;
using stream_lock = detail::biased_lock;
using detail::block_state;
using detail::pool;
using detail::segment;

namespace {

std::string format_bytes(std::size_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  if (bytes >= (std::size_t{1} << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1 << 30));
  else if (bytes >= (std::size_t{1} << 20)) std::snprintf(buf, sizeof buf, "%.2f MiB", b / (1 << 20));
  else if (bytes >= 1024) std::snprintf(buf, sizeof buf, "%.2f KiB", b / 1024);
  else std::snprintf(buf, sizeof buf, "%zu B", bytes);
  return std::string(buf) + " (" + std::to_string(bytes) + " bytes)";
}

std::string hex(std::uintptr_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, v);
  return buf;
}

const char* state_name(block_state s) {
  switch (s) {
    case block_state::free: return "free";
    case block_state::active: return "active";
    case block_state::pending_free: return "freed, waiting for its stream uses";
    case block_state::releasing: return "being released to the driver";
    case block_state::quick_cached: return "free (cached for reuse)";
  }
  return "?";
}

std::atomic<std::uint64_t> next_allocator_id{1};

// Each thread remembers the stream states it used last, per allocator (no lock to find them).
struct stream_cache_entry {
  std::uint64_t owner = 0;
  stream_handle stream = 0;
  void* state = nullptr;
};
constexpr int k_stream_cache = 4;
struct thread_cache {
  stream_cache_entry streams[k_stream_cache];
  unsigned next = 0;
  stream_cache_entry last_used;  // the state of this thread's last allocation
};
// initial-exec: one TLS access without __tls_get_addr, also in position-independent code (the
// 128 bytes fit glibc's static TLS surplus, so a dlopen'ed library may use it too).
thread_local thread_cache t_cache __attribute__((tls_model("initial-exec")));

}  // namespace


caching_allocator::impl::impl(device_backend& backend, options opts)
    : backend_(backend), opts_(opts), id_(next_allocator_id.fetch_add(1)) {
  std::size_t free_bytes = 0;
  backend_.memory_info(free_bytes, device_total_bytes_);
  limit_bytes_ = device_total_bytes_;
  if (opts_.memory_limit_bytes != 0) limit_bytes_ = std::min(limit_bytes_, opts_.memory_limit_bytes);
  if (opts_.memory_fraction > 0) {
    limit_bytes_ = std::min(limit_bytes_, static_cast<std::size_t>(opts_.memory_fraction *
                                                                   static_cast<double>(device_total_bytes_)));
  }
  if (opts_.backend == backend_kind::expandable) {
    if (!backend_.supports_expandable()) {
      throw config_error(std::string("streamsafe: backend:expandable needs virtual memory management, which the '") +
                         backend_.name() + "' device backend does not offer");
    }
    small_chunk_bytes_ = backend_.map_granularity_bytes();
    large_chunk_bytes_ = detail::round_up(std::max(opts_.expandable_chunk_bytes, small_chunk_bytes_), small_chunk_bytes_);
  }
  if (opts_.release_fence == fence_scope::allocation_stream) {
    detail::log().warn(
        "release_fence:allocation_stream is UNSAFE: memory used on other streams without record_stream may be "
        "released while that work still runs (PyTorch expandable-segment behaviour, kept to reproduce the race)");
  }
  detail::log().debug("device {}: {} backend, {}, limit {} bytes", backend_.device(), backend_.name(),
                      opts_.to_string(), limit_bytes_);
  trace_log_ = detail::log().should_log(spdlog::level::trace);
  if (opts_.trace_capacity != 0) {
    own_trace_ = std::make_unique<trace_recorder>(opts_.trace_capacity);
    trace_.store(own_trace_.get());
  }
}

// ---- streams ------------------------------------------------------------------------------------

caching_allocator::impl::stream_state& caching_allocator::impl::new_state_locked(stream_handle key,
                                                                                 stream_handle handle) {
  auto state = std::make_unique<stream_state>();
  state->event_cache.reserve(k_event_cache);
  state->handle = handle;
  state->small_pool.stream = state->large_pool.stream = handle;
  state->small_pool.small = true;
  state->small_pool.state = state->large_pool.state = state.get();
  const std::size_t n = stream_count_.load(std::memory_order_relaxed);
  if (n < k_sampled_streams) {
    stream_table_[n].store(state.get(), std::memory_order_release);
    stream_count_.store(n + 1, std::memory_order_release);
  }
  return *streams_.emplace(key, std::move(state)).first->second;
}

caching_allocator::impl::stream_state& caching_allocator::impl::get_or_create_stream_locked(stream_handle stream) {
  auto it = streams_.find(stream);
  if (it == streams_.end()) {
    return new_state_locked(stream, stream);
  } else if (!it->second->alive.load(std::memory_order_acquire)) {
    // A handle value recycled by the driver: the new stream inherits the old one's cached
    // blocks, so it waits, on the device, for the old stream's last work (its tombstone) and,
    // as for a segment moved between streams, for every stream the fence scope covers (uses
    // that were legal without a record, FSDP2-style).
    const bool every_stream = opts_.release_fence != fence_scope::allocation_stream;
    for (auto& t : tombstones_) {
      if (t.stream == stream || every_stream) {  // other dead streams may have used its blocks too
        backend_.stream_wait_event(stream, t.event);
        ++stats_.stream_waits;
      }
    }
    if (every_stream) {
      for (auto& [other, state] : streams_) {
        if (other == stream || state->graph != 0 || !state->alive.load(std::memory_order_acquire)) continue;
        order_after_locked(stream, other);
      }
    }
    it->second->alive.store(true, std::memory_order_release);
  }
  return *it->second;
}

caching_allocator::impl::stream_state& caching_allocator::impl::state_for(stream_handle stream) {
  thread_cache& tc = t_cache;
  for (auto& e : tc.streams) {
    if (e.owner == id_ && e.stream == stream) {
      auto* st = static_cast<stream_state*>(e.state);
      if (st->alive.load(std::memory_order_acquire)) return *st;
      break;
    }
  }
  std::lock_guard<std::mutex> dlk(mu_);
  stream_state& st = get_or_create_stream_locked(stream);
  tc.streams[tc.next++ % k_stream_cache] = {id_, stream, &st};
  return st;
}

caching_allocator::impl::stream_state* caching_allocator::impl::owner_locked(const void* ptr) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = segments_.upper_bound(addr);
  if (it == segments_.begin()) return nullptr;
  const segment* seg = std::prev(it)->second;
  if (addr >= seg->base + seg->size) return nullptr;
  return &state_of(*seg->owner);
}

// ---- small helpers --------------------------------------------------------------------------------

block* caching_allocator::impl::new_block(stream_state& st) {
  if (block* b = st.spare) {
    st.spare = b->next;
    // A fresh block, but the vectors keep their capacity: a recycled block recording a use or
    // an event allocates nothing.
    std::vector<stream_handle> uses = std::move(b->uses);
    std::vector<detail::pending_event> events = std::move(b->events);
    uses.clear();
    events.clear();
    *b = block{};
    b->uses = std::move(uses);
    b->events = std::move(events);
    return b;
  }
  return new block;
}

void caching_allocator::impl::recycle_block(stream_state& st, block* b) {
  b->next = st.spare;
  st.spare = b;
}

event_handle caching_allocator::impl::get_event() {
  {
    std::lock_guard<std::mutex> lk(events_mu_);
    if (!free_events_.empty()) {
      event_handle e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
  }
  return backend_.create_event();
}

void caching_allocator::impl::put_event(event_handle e) {
  std::lock_guard<std::mutex> lk(events_mu_);
  free_events_.push_back(e);
}

event_handle caching_allocator::impl::get_event(stream_state& st) {
  if (st.event_cache.empty()) return get_event();
  const event_handle e = st.event_cache.back();
  st.event_cache.pop_back();
  return e;
}

void caching_allocator::impl::put_event(stream_state& st, event_handle e) {
  if (st.event_cache.size() < k_event_cache) st.event_cache.push_back(e);  // never reallocates
  else put_event(e);
}

void caching_allocator::impl::order_after_locked(stream_handle waiter, stream_handle on) {
  // waiter waits, on the device, for the work enqueued on `on` so far (one pooled event).
  event_handle e = get_event();
  try {
    backend_.record_event(e, on);
    backend_.stream_wait_event(waiter, e);
  } catch (...) {
    put_event(e);
    throw;
  }
  put_event(e);
  ++stats_.events_recorded;
  ++stats_.stream_waits;
}

void caching_allocator::impl::add_use_locked(block* b, stream_handle stream) {
  if (stream != b->seg->stream && std::find(b->uses.begin(), b->uses.end(), stream) == b->uses.end()) {
    b->uses.push_back(stream);
  }
  note_use_locked(b->seg, stream);
}

void caching_allocator::impl::note_use_locked(segment* seg, stream_handle stream) {
  if (stream != seg->stream &&
      std::find(seg->used_streams.begin(), seg->used_streams.end(), stream) == seg->used_streams.end()) {
    seg->used_streams.push_back(stream);
  }
}

void caching_allocator::impl::sample_peaks() {
  // Called when a stream passes its own peak: the device-wide sum may be a new peak.
  std::int64_t allocated = 0, active = 0, requested = 0;
  const std::size_t n = stream_count_.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < n; ++i) {
    const stream_state* st = stream_table_[i].load(std::memory_order_acquire);
    allocated += st->cur_allocated.load(std::memory_order_relaxed);
    active += st->cur_allocated.load(std::memory_order_relaxed) + st->cur_pending.load(std::memory_order_relaxed);
    requested += st->cur_requested.load(std::memory_order_relaxed);
  }
  auto raise = [](std::atomic<std::int64_t>& peak, std::int64_t v) {
    std::int64_t cur = peak.load(std::memory_order_relaxed);
    while (v > cur && !peak.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
    }
  };
  raise(peak_allocated_, allocated);
  raise(peak_active_, active);
  raise(peak_requested_, requested);
}

// ---- blocks -------------------------------------------------------------------------------------

block* caching_allocator::impl::best_fit(pool& p, std::size_t rounded) const {
  block* b = p.mapped.find(rounded);
  if (!b) return nullptr;
  if (opts_.max_split_size_bytes != 0 && split_limit_refuses(p, b, rounded)) return nullptr;
  // A whole free segment far larger than the request stays whole (segment_fit.hpp): the best
  // block that may be split instead, if any. One compare for blocks close in size.
  if (b->size - rounded > detail::k_whole_segment_slack_bytes && keeps_whole(b, rounded)) {
    return p.mapped.find_if(rounded, [&](const block* x) { return !keeps_whole(x, rounded) && !split_limit_refuses(p, x, rounded); });
  }
  return b;
}

bool caching_allocator::impl::split_limit_refuses(const pool& p, const block* b, std::size_t rounded) const noexcept {
  if (p.small || opts_.max_split_size_bytes == 0 || b->seg->expandable) return false;
  // Oversize blocks are never split, and serve only requests close to their size.
  if (rounded < opts_.max_split_size_bytes && b->size >= opts_.max_split_size_bytes) return true;
  return rounded >= opts_.max_split_size_bytes && b->size >= rounded + detail::k_large_segment_bytes;
}

bool caching_allocator::impl::keeps_whole(const block* b, std::size_t rounded) const noexcept {
  return !b->seg->expandable &&
         detail::keeps_segment_whole(b->size, rounded, opts_.whole_segment_split_ratio, !b->prev && !b->next);
}

block* caching_allocator::impl::fit_ignoring_whole_rule(pool& p, std::size_t rounded) const {
  block* b = p.mapped.find(rounded);
  return b && !split_limit_refuses(p, b, rounded) ? b : nullptr;
}

block* caching_allocator::impl::merge_locked(block* lo, block* hi) {
  lo->size += hi->size;
  lo->next = hi->next;
  if (hi->next) hi->next->prev = lo;
  recycle_block(state_of(*lo->seg->owner), hi);
  return lo;
}

block* caching_allocator::impl::free_block_locked(block* b) {
  b->state = block_state::free;
  b->requested = 0;
  b->uses.clear();
  pool& p = *b->seg->owner;
  auto remove = [&](block* x) {
    if (x->mapped) p.mapped.erase(x);
    else p.unmapped.erase(x);
  };
  if (block* prev = b->prev; prev && prev->state == block_state::free && prev->mapped == b->mapped) {
    remove(prev);
    b = merge_locked(prev, b);
  }
  if (block* next = b->next; next && next->state == block_state::free && next->mapped == b->mapped) {
    remove(next);
    b = merge_locked(b, next);
  }
  if (b->mapped) p.mapped.insert(b);
  else p.unmapped.insert(b);
  return b;
}

void caching_allocator::impl::split_locked(block* b, std::size_t rounded) {
  const std::size_t remaining = b->size - rounded;
  bool split = (b->seg->expandable || b->seg->small) ? remaining >= detail::k_min_block_bytes
                                                      : remaining > detail::k_small_request_bytes;
  if (!b->seg->expandable && !b->seg->small && opts_.max_split_size_bytes != 0 &&
      b->size >= opts_.max_split_size_bytes) {
    split = false;
  }
  if (!split) return;
  block* rest = new_block(state_of(*b->seg->owner));
  rest->addr = b->addr + rounded;
  rest->size = remaining;
  rest->seg = b->seg;
  rest->prev = b;
  rest->next = b->next;
  rest->mapped = b->mapped;
  if (b->next) b->next->prev = rest;
  b->next = rest;
  b->size = rounded;
  free_block_locked(rest);  // merges with a free follower of the same mapped state
}

void caching_allocator::impl::flush_quick_locked(pool& p) {
  detail::active_map& parked = state_of(p).active;  // quick_cached blocks stay there while parked
  p.quick.drain([&](block* b) {
    parked.erase(b->addr);
    free_block_locked(b);
  });
}

void caching_allocator::impl::retire_pending_locked(stream_state& st, block* b) {
  st.pending.erase(b);
  trace(trace_action::free_completed, b->addr, b->size, b->seg->stream);
  for (auto& e : b->events) {
    if (e.stream != detail::k_tombstone_stream) put_event(st, e.event);  // tombstones are not pooled
  }
  b->events.clear();
  st.stats.pending_bytes.sub(static_cast<std::int64_t>(b->size));
  st.stats.pending.sub(1);
  st.cur_pending.store(st.stats.pending_bytes.current, std::memory_order_relaxed);
  free_block_locked(b);
}

void caching_allocator::impl::process_events_locked(stream_state& st) {
  if (capturing()) return;  // no event query during a graph capture (capture.cpp)
  st.process_at = st.pending.size() + k_pending_batch;
  if (st.pending.empty()) return;
  // Stream order proves a prefix with one query per stream. Every event of st.pending was
  // recorded under st's lock in the same critical section that appended its block, so the
  // events on one stream s lie in the list in the order they were recorded, and they complete
  // in that order: when the newest of them has completed, all of them have. Tombstones (shared
  // by every pool) and per-thread stream handles (a different stream in each thread) prove
  // nothing and are queried one by one.
  constexpr int k_streams = 8;
  stream_handle asked[k_streams];
  bool done[k_streams];
  int n = 0;
  auto slot = [&](stream_handle s) {
    for (int i = 0; i < n; ++i) {
      if (asked[i] == s) return i;
    }
    return -1;
  };
  // The newest events only: a bounded walk from the back (a stream whose newest event lies
  // further back just gets no proof, and its events are queried one by one below).
  std::size_t walked = 0;
  for (const block* x = st.pending.back(); x && n < k_streams && walked < 2 * k_pending_batch;
       x = x->pending_prev, ++walked) {
    for (const auto& e : x->events) {
      if (n == k_streams) break;
      if (e.stream == detail::k_tombstone_stream || backend_.stream_is_per_thread(e.stream) || slot(e.stream) >= 0) continue;
      asked[n] = e.stream;
      done[n++] = backend_.query_event(e.event);
    }
  }
  // Then from the oldest, as PyTorch does: stop at the first block still in use.
  while (!st.pending.empty()) {
    block* b = st.pending.front();
    for (const auto& e : b->events) {
      const int i = e.stream == detail::k_tombstone_stream ? -1 : slot(e.stream);
      if (i >= 0 && done[i]) continue;
      if (!backend_.query_event(e.event)) return;
    }
    retire_pending_locked(st, b);
  }
}

block* caching_allocator::impl::take_pending_locked(stream_state& st, pool& p, std::size_t rounded) {
  if (capturing()) return nullptr;  // a stream wait on an outside event breaks a capture
  block* best = nullptr;
  for (block* b : st.pending) {
    if (b->seg->owner == &p && b->mapped && b->size >= rounded && (!best || b->size < best->size)) best = b;
  }
  if (!best) return nullptr;
  for (auto& e : best->events) {
    backend_.stream_wait_event(p.stream, e.event);
    ++st.stats.stream_waits;
  }
  retire_pending_locked(st, best);
  return best_fit(p, rounded);
}

// ---- growth (device lock and the stream lock held) -------------------------------------------------

block* caching_allocator::impl::new_segment_locked(pool& p, std::size_t rounded) {
  const std::size_t size = detail::segment_bytes_for(rounded);
  if (static_cast<std::size_t>(stats_.reserved_bytes.current) + size > limit_bytes_) return nullptr;
  void* base = backend_.allocate_segment(size);
  if (!base) return nullptr;
  auto* seg = new segment;
  seg->base = reinterpret_cast<std::uintptr_t>(base);
  seg->size = seg->mapped_bytes = size;
  seg->stream = p.stream;
  seg->small = p.small;
  seg->owner = &p;
  block* b = new_block(state_of(p));
  b->addr = seg->base;
  b->size = size;
  b->seg = seg;
  seg->first = b;
  segments_.emplace(seg->base, seg);
  p.mapped.insert(b);
  stats_.reserved_bytes.increase(static_cast<std::int64_t>(size));
  stats_.segment.increase(1);
  ++stats_.num_device_alloc;
  trace(trace_action::segment_alloc, seg->base, size, p.stream);
  detail::log().debug("device {}: segment_alloc {} bytes at {} for stream {}", backend_.device(), size,
                      hex(seg->base), hex(p.stream));
  return b;
}

std::size_t caching_allocator::impl::map_chunks_locked(std::uintptr_t addr, std::size_t bytes, std::size_t chunk) {
  // One backend map per chunk, so that any chunk can later be unmapped alone. Out of memory
  // part-way: the chunks mapped so far are unmapped again, except during a graph capture (no
  // unmap may run then), where they are kept, counted in the returned bytes.
  std::size_t done = 0;
  try {
    for (; done < bytes; done += chunk) {
      if (!backend_.map(reinterpret_cast<void*>(addr + done), chunk)) break;
    }
  } catch (...) {
    if (done) backend_.unmap(reinterpret_cast<void*>(addr), done);
    throw;
  }
  if (done < bytes) {
    if (capturing()) return done;
    if (done) backend_.unmap(reinterpret_cast<void*>(addr), done);
    return 0;
  }
  return done;
}

block* caching_allocator::impl::expandable_fit_locked(pool& p, std::size_t rounded) {
  const std::size_t gran = p.small ? small_chunk_bytes_ : large_chunk_bytes_;
  stream_state& st = state_of(p);
  if (!p.expandable) {
    const std::size_t reserve = detail::round_up(limit_bytes_, gran);
    void* base = backend_.reserve_address_range(reserve);
    auto* seg = new segment;
    seg->base = reinterpret_cast<std::uintptr_t>(base);
    seg->size = reserve;
    seg->stream = p.stream;
    seg->small = p.small;
    seg->expandable = true;
    seg->owner = &p;
    block* b = new_block(st);
    b->addr = seg->base;
    b->size = reserve;
    b->seg = seg;
    b->mapped = false;
    seg->first = b;
    segments_.emplace(seg->base, seg);
    p.unmapped.insert(b);
    p.expandable = seg;
    stats_.segment.increase(1);
  }
  // Bytes to map if we grow into unmapped block u, reusing a free mapped block just before it.
  auto need = [&](const block* u) -> std::size_t {
    std::size_t have = (u->prev && u->prev->state == block_state::free && u->prev->mapped) ? u->prev->size : 0;
    return have >= rounded ? 0 : detail::round_up(rounded - have, gran);
  };
  block* choice = nullptr;
  if (auto it = p.unmapped.lower_bound(detail::block_order::key{rounded, 0}); it != p.unmapped.end()) choice = *it;
  if (!p.unmapped.empty()) {
    block* largest = *p.unmapped.rbegin();
    if (largest->size >= need(largest) && (!choice || need(largest) < need(choice))) choice = largest;
  }
  if (!choice) return nullptr;
  std::size_t map_bytes = need(choice);
  if (map_bytes == 0 || map_bytes > choice->size) return nullptr;
  if (static_cast<std::size_t>(stats_.reserved_bytes.current) + map_bytes > limit_bytes_) return nullptr;
  const std::size_t mapped = map_chunks_locked(choice->addr, map_bytes, gran);
  if (mapped == 0) return nullptr;
  const bool partial = mapped < map_bytes;  // kept during a capture: free memory, too little
  map_bytes = mapped;
  segment* seg = choice->seg;
  p.unmapped.erase(choice);
  if (map_bytes < choice->size) {
    block* rest = new_block(st);
    rest->addr = choice->addr + map_bytes;
    rest->size = choice->size - map_bytes;
    rest->seg = seg;
    rest->prev = choice;
    rest->next = choice->next;
    rest->mapped = false;
    if (choice->next) choice->next->prev = rest;
    choice->next = rest;
    choice->size = map_bytes;
    p.unmapped.insert(rest);
  }
  choice->mapped = true;
  seg->mapped_bytes += map_bytes;
  stats_.reserved_bytes.increase(static_cast<std::int64_t>(map_bytes));
  stats_.num_device_alloc += map_bytes / gran;
  trace(trace_action::segment_map, choice->addr, map_bytes, p.stream);
  detail::log().debug("device {}: segment_map {} bytes at {} (stream {})", backend_.device(), map_bytes,
                      hex(choice->addr), hex(p.stream));
  free_block_locked(choice);  // merges with the free mapped block before it
  return partial ? nullptr : best_fit(p, rounded);
}

block* caching_allocator::impl::steal_segment_locked(pool& p, std::size_t rounded) {
  if (opts_.backend == backend_kind::expandable || opts_.release_fence == fence_scope::device) return nullptr;
  if (capturing()) return nullptr;
  // The other stream's lock is dropped between the search and the move, and that stream's fast
  // path (its lock alone, no mu_) may meanwhile allocate from the chosen segment: the move
  // re-checks, under that lock, that the segment is still one whole free block, and otherwise
  // searches again (a retry follows another thread's allocation from that segment).
  auto whole_free = [&](segment* seg) {
    if (seg->owner->quick.count) flush_quick_locked(*seg->owner);
    const block* f = seg->first;
    return !f->next && f->state == block_state::free && f->size >= rounded;
  };
  segment* best = nullptr;
  std::unique_lock<stream_lock> olk;
  while (!best) {
    for (auto& [base, seg] : segments_) {
      if (seg->expandable || seg->owner == &p || seg->small != p.small) continue;
      stream_state& other = state_of(*seg->owner);
      if (other.graph != 0 && !other.graph_released) continue;  // a graph's private pool
      std::lock_guard<stream_lock> lk(other.mu);
      if (!whole_free(seg)) continue;
      if (!best || seg->size < best->size) best = seg;
    }
    if (!best) return nullptr;
    olk = std::unique_lock<stream_lock>(state_of(*best->owner).mu);
    if (!whole_free(best)) {
      olk.unlock();
      best = nullptr;
    }
  }
  // The new stream waits, on the device, for every stream that may still touch the segment.
  for (stream_handle s : fence_streams_locked(best)) {
    if (s == p.stream) continue;
    order_after_locked(p.stream, s);
  }
  for (auto& t : tombstones_) {
    backend_.stream_wait_event(p.stream, t.event);
    ++stats_.stream_waits;
  }
  best->owner->mapped.erase(best->first);
  best->owner = &p;
  best->stream = p.stream;
  best->used_streams.clear();
  p.mapped.insert(best->first);
  ++stats_.segments_moved;
  detail::log().debug("device {}: moved free segment {} ({} bytes) to stream {} behind an event wait",
                      backend_.device(), hex(best->base), best->size, hex(p.stream));
  return best->first;
}

block* caching_allocator::impl::find_block_locked(stream_state& st, pool& p, std::size_t rounded, bool grow) {
  if (!st.pending.empty()) process_events_locked(st);
  if (block* b = p.quick.pop(rounded)) return b;
  if (p.quick.count) flush_quick_locked(p);
  if (block* b = best_fit(p, rounded)) return b;
  if (block* b = take_pending_locked(st, p, rounded)) return b;
  return grow ? grow_locked(p, rounded) : nullptr;
}

block* caching_allocator::impl::grow_locked(pool& p, std::size_t rounded) {
  if (opts_.backend == backend_kind::expandable) return expandable_fit_locked(p, rounded);
  if (block* b = new_segment_locked(p, rounded)) return b;
  // At the memory limit the whole-segment rule gives way: split the best fit rather than fail.
  return opts_.whole_segment_split_ratio != 0 ? fit_ignoring_whole_rule(p, rounded) : nullptr;
}

void* caching_allocator::impl::finish_allocation(stream_state& st, block* b, std::size_t rounded, std::size_t size) {
  if (b->state == block_state::quick_cached) {
    b->state = block_state::active;  // from the quick cache: exactly the right size, and
                                     // still in st.active (active_map.hpp)
  } else {
    b->seg->owner->mapped.erase(b);
    b->state = block_state::active;  // before the split, so the remainder does not merge back
    split_locked(b, rounded);
    st.active.insert(b);
  }
  b->requested = size;
  const std::int64_t old_peak = st.stats.allocated_bytes.peak;
  const auto bytes = static_cast<std::int64_t>(b->size);
  st.stats.allocated_bytes.add(bytes);
  st.stats.requested_bytes.add(static_cast<std::int64_t>(size));
  st.stats.allocation.add(1);
  st.stats.active_bytes_peak = std::max(st.stats.active_bytes_peak, st.stats.allocated_bytes.current + st.stats.pending_bytes.current);
  st.stats.active_peak = std::max(st.stats.active_peak, st.stats.allocation.current + st.stats.pending.current);
  st.cur_allocated.store(st.stats.allocated_bytes.current, std::memory_order_relaxed);
  st.cur_requested.store(st.stats.requested_bytes.current, std::memory_order_relaxed);
  if (st.stats.allocated_bytes.current > old_peak) sample_peaks();
  t_cache.last_used = {id_, st.handle, &st};
  trace(trace_action::alloc, b->addr, size, st.handle);
  if (trace_log_) detail::log().trace("alloc {} bytes at {} stream {}", size, hex(b->addr), hex(st.handle));
  return reinterpret_cast<void*>(b->addr);
}

void* caching_allocator::impl::allocate_slow(stream_state& st, std::size_t size, std::size_t rounded, bool small) {
  std::unique_lock<std::mutex> dlk(mu_);
  detect_captures_locked(dlk);
  if (capturing()) return allocate_during_capture_locked(dlk, size, rounded, small, st.handle);
  if (wants_collection_locked(rounded)) {
    // garbage_collection_threshold / max_cached_bytes: give free cached segments back first
    // (in defer mode only what is safe now, never waiting).
    release_cached(dlk, opts_.empty_cache);
  }
  std::unique_lock<stream_lock> slk(st.mu);
  pool& p = pool_of(st, small);
  block* b = find_block_locked(st, p, rounded, false);
  if (!b && growth_raises_peak_with_refused_locked(p, rounded)) {
    // Whole free segments the rule refuses to this request would sit idle while the pool grows
    // past its peak: they go back to the driver first, behind their fence (segment_fit.hpp).
    // Opportunistic: a failed release leaves its memory in the pool, and the allocation goes on.
    slk.unlock();
    try {
      release_refused_segments(dlk, st, rounded);
    } catch (const std::exception& e) {
      detail::log().warn("device {}: giving refused whole segments back before growing failed: {}", backend_.device(),
                         e.what());
    }
    slk.lock();
    b = find_block_locked(st, p, rounded);  // the pool may have changed while its lock was dropped
  } else if (!b) {
    b = grow_locked(p, rounded);  // both locks held since the search above: straight to growth
  }
  if (!b && !deferred_.empty()) {
    slk.unlock();
    finish_deferred(dlk, false);
    slk.lock();
    b = find_block_locked(st, p, rounded);
  }
  if (!b) b = steal_segment_locked(p, rounded);
  if (!b) {
    ++stats_.num_alloc_retries;
    slk.unlock();
    // empty_cache:wait waits (host, no lock held) on exactly the fence events; empty_cache:defer
    // never blocks the host here: it releases what is safe now and queues the rest (case K8: a
    // fenced stream may run a collective that waits for work this thread has yet to enqueue).
    release_cached(dlk, opts_.empty_cache);
    slk.lock();
    b = find_block_locked(st, p, rounded);
  }
  if (!b) {
    ++stats_.num_ooms;
    trace(trace_action::oom, 0, size, p.stream);
    std::string msg = oom_message_locked(size, rounded, p.stream, &st);
    slk.unlock();
    dlk.unlock();
    detail::log().error("{}", msg);
    throw out_of_memory(msg);
  }
  return finish_allocation(st, b, rounded, size);
}

bool caching_allocator::impl::growth_raises_peak_with_refused_locked(const pool& p, std::size_t rounded) const {
  if (p.small || opts_.whole_segment_split_ratio == 0 || opts_.backend == backend_kind::expandable) return false;
  // Below the peak growth costs nothing; at the limit the rule gives way (find_block_locked).
  const std::size_t grown = static_cast<std::size_t>(stats_.reserved_bytes.current) + detail::segment_bytes_for(rounded);
  if (grown <= static_cast<std::size_t>(stats_.reserved_bytes.peak) || grown > limit_bytes_) return false;
  bool refused = false;
  p.mapped.for_each([&](const block* b) { refused = refused || (!b->prev && !b->next && keeps_whole(b, rounded)); });
  return refused;
}

bool caching_allocator::impl::wants_collection_locked(std::size_t rounded) const {
  if (opts_.garbage_collection_threshold <= 0 && opts_.max_cached_bytes == 0) return false;
  const auto reserved = static_cast<std::size_t>(stats_.reserved_bytes.current);
  if (opts_.garbage_collection_threshold > 0 &&
      static_cast<double>(reserved + detail::segment_bytes_for(rounded)) >
          opts_.garbage_collection_threshold * static_cast<double>(limit_bytes_)) {
    return true;
  }
  if (opts_.max_cached_bytes != 0) {
    std::int64_t allocated = 0;
    for (auto& [s, state] : streams_) allocated += state->cur_allocated.load(std::memory_order_relaxed);
    const auto cached = static_cast<std::int64_t>(reserved) - allocated;
    if (cached > static_cast<std::int64_t>(opts_.max_cached_bytes)) return true;
  }
  return false;
}

// ---- diagnostics ----------------------------------------------------------------------------------

std::size_t caching_allocator::impl::largest_free_locked(const stream_state* held) const {
  std::size_t largest = 0;
  for (auto& [s, state] : streams_) {
    std::unique_lock<stream_lock> slk(state->mu, std::defer_lock);
    if (state.get() != held) slk.lock();
    for (const pool* p : {&state->small_pool, &state->large_pool}) {
      if (const block* b = p->mapped.largest()) largest = std::max(largest, b->size);
    }
  }
  return largest;
}

std::string caching_allocator::impl::oom_message_locked(std::size_t size, std::size_t rounded, stream_handle stream,
                                                         const stream_state* held) {
  std::size_t free_bytes = 0, total_bytes = 0;
  try {
    backend_.memory_info(free_bytes, total_bytes);
  } catch (const std::exception&) {
  }
  std::int64_t allocated = 0;
  for (auto& [s, state] : streams_) allocated += state->cur_allocated.load(std::memory_order_relaxed);
  std::ostringstream os;
  os << "streamsafe: out of memory on device " << backend_.device() << ": tried to allocate "
     << format_bytes(size);
  if (rounded != size) os << " (rounded to " << format_bytes(rounded) << ")";
  os << " on stream " << hex(stream) << "; device total " << format_bytes(total_bytes) << ", free "
     << format_bytes(free_bytes) << "; allocated " << format_bytes(static_cast<std::size_t>(allocated))
     << ", reserved " << format_bytes(static_cast<std::size_t>(stats_.reserved_bytes.current))
     << ", largest free block " << format_bytes(largest_free_locked(held)) << "; limit "
     << format_bytes(limit_bytes_);
  if (deferred_bytes_ != 0) {
    // Which streams the queued releases still wait for (polled; a failing query names none).
    std::vector<stream_handle> busy;
    bool device_wide = false;
    for (const release_batch& batch : deferred_) {
      device_wide = device_wide || batch.device_sync;
      for (const auto& e : batch.fence) {
        bool done = true;
        try {
          done = backend_.query_event(e.event);
        } catch (const std::exception&) {
        }
        if (!done && std::find(busy.begin(), busy.end(), e.stream) == busy.end()) busy.push_back(e.stream);
      }
    }
    os << "; " << format_bytes(deferred_bytes_) << " waiting behind release fences";
    if (device_wide) {
      os << " (a device-wide fence)";
    } else if (!busy.empty()) {
      os << " (streams still busy:";
      for (stream_handle s : busy) os << " " << hex(s);
      os << ")";
    }
    os << ": call reclaim() once that work has completed, or set empty_cache:wait to let the allocator wait "
          "on the fences";
  }
  return os.str();
}

void caching_allocator::impl::throw_invalid_pointer_locked(const void* ptr, const char* what) const {
  // mu_ and the owning stream's lock (if any) are held.
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  std::ostringstream os;
  os << "streamsafe: " << what << "(" << hex(addr) << ") on device " << backend_.device() << ": ";
  auto it = segments_.upper_bound(addr);
  if (it != segments_.begin()) {
    const segment* seg = std::prev(it)->second;
    if (addr < seg->base + seg->size) {
      for (const block* b = seg->first; b; b = b->next) {
        if (addr < b->addr || addr >= b->addr + b->size) continue;
        if (b->addr == addr && b->free_held) {
          os << "double free: the block at this address (" << b->size
             << " bytes) was already freed during a CUDA graph capture (the free completes after the capture, "
                "or when its graph is released)";
        } else if (b->addr == addr) {
          os << "double free: the block at this address (" << b->size << " bytes) is " << state_name(b->state);
        } else {
          os << "interior pointer: it lies " << (addr - b->addr) << " bytes into the block at " << hex(b->addr)
             << " (" << b->size << " bytes, " << state_name(b->state)
             << "); pass the pointer that allocate returned";
        }
        throw invalid_pointer(os.str());
      }
    }
  }
  os << "unknown pointer: not allocated by this allocator (a foreign pointer, e.g. from cudaMalloc, or "
        "one owned by another device)";
  throw invalid_pointer(os.str());
}

// ---- free -------------------------------------------------------------------------------------------

void caching_allocator::impl::free_same_stream_locked(stream_state& st, block* b) {
  // No event: straight to the quick cache, staying in st.active (or out of it, to the free lists).
  if (trace_.load(std::memory_order_relaxed)) {
    trace(trace_action::free_requested, b->addr, b->requested, st.handle);
    trace(trace_action::free_completed, b->addr, b->requested, st.handle);
  }
  const auto bytes = static_cast<std::int64_t>(b->size);
  st.stats.allocated_bytes.sub(bytes);
  st.stats.requested_bytes.sub(static_cast<std::int64_t>(b->requested));
  st.stats.allocation.sub(1);
  st.cur_allocated.store(st.stats.allocated_bytes.current, std::memory_order_relaxed);
  st.cur_requested.store(st.stats.requested_bytes.current, std::memory_order_relaxed);
  b->requested = 0;
  b->state = block_state::quick_cached;
  if (!b->seg->owner->quick.push(b)) {
    st.active.erase(b->addr);
    free_block_locked(b);
  }
}

void caching_allocator::impl::free_found_locked(stream_state& st, block* b, const stream_handle* stream) {
  segment* seg = b->seg;
  if (b->uses.empty() && (!stream || *stream == seg->stream)) {
    free_same_stream_locked(st, b);
    return;
  }
  st.active.erase(b->addr);
  try {
    record_use_events_locked(b, stream, true);
  } catch (...) {
    st.active.insert(b);
    throw;
  }
  commit_free_locked(st, b, stream);
}

caching_allocator::impl::stream_state* caching_allocator::impl::cached_live_state(stream_handle stream) const {
  for (const auto& e : t_cache.streams) {
    if (e.owner == id_ && e.stream == stream) {
      auto* st = static_cast<stream_state*>(e.state);
      return st->alive.load(std::memory_order_acquire) ? st : nullptr;
    }
  }
  return nullptr;
}

bool caching_allocator::impl::record_use_events_locked(block* b, const stream_handle* stream, bool device_locked) {
  // One event per stream that may still use b: its record_stream uses and, for a stream-ordered
  // free, the stream of last use. Every event is recorded before anything changes: a failure
  // leaves b->events empty and the block as it was. A stream announced as destroyed gets no
  // call: its tombstone event covers it (device lock needed to see them). Without the device
  // lock, only streams this thread knows to be alive are handled; otherwise nothing is
  // recorded and false is returned.
  const segment* seg = b->seg;
  stream_state& owner = state_of(*seg->owner);
  std::vector<detail::pending_event>& events = b->events;
  events.reserve(b->uses.size() + 1);
  auto unwind = [&] {
    for (auto& e : events) {
      if (e.stream != detail::k_tombstone_stream) put_event(owner, e.event);
    }
    events.clear();
  };
  auto record_on = [&](stream_handle s) {
    if (device_locked) {
      auto it = streams_.find(s);
      if (it != streams_.end() && !it->second->alive.load(std::memory_order_acquire)) {
        for (auto& t : tombstones_) {
          if (t.stream == s) events.push_back({t.event, detail::k_tombstone_stream});
        }
        return true;
      }
    } else if (cached_live_state(s) == nullptr) {
      return false;
    }
    event_handle e = get_event(owner);
    try {
      backend_.record_event(e, s);
    } catch (...) {
      put_event(owner, e);
      throw;
    }
    events.push_back({e, s});
    return true;
  };
  try {
    for (stream_handle s : b->uses) {
      if (!record_on(s)) {
        unwind();
        return false;
      }
    }
    if (stream && *stream != seg->stream &&
        std::find(b->uses.begin(), b->uses.end(), *stream) == b->uses.end() && !record_on(*stream)) {
      unwind();
      return false;
    }
  } catch (...) {
    unwind();
    throw;
  }
  return true;
}

void caching_allocator::impl::commit_free_locked(stream_state& st, block* b, const stream_handle* stream) {
  // b is out of the active map and b->events holds its recorded events (possibly none).
  segment* seg = b->seg;
  if (stream) note_use_locked(seg, *stream);
  const auto bytes = static_cast<std::int64_t>(b->size);
  trace(trace_action::free_requested, b->addr, b->requested, seg->stream);
  if (b->events.empty()) trace(trace_action::free_completed, b->addr, b->requested, seg->stream);
  st.stats.allocated_bytes.sub(bytes);
  st.stats.requested_bytes.sub(static_cast<std::int64_t>(b->requested));
  st.stats.allocation.sub(1);
  st.stats.events_recorded += b->events.size();
  st.cur_allocated.store(st.stats.allocated_bytes.current, std::memory_order_relaxed);
  st.cur_requested.store(st.stats.requested_bytes.current, std::memory_order_relaxed);
  b->uses.clear();
  if (b->events.empty()) {
    free_block_locked(b);
    return;
  }
  st.stats.pending_bytes.add(bytes);  // still active: waiting for other streams
  st.stats.pending.add(1);
  st.cur_pending.store(st.stats.pending_bytes.current, std::memory_order_relaxed);
  b->state = block_state::pending_free;
  st.pending.push_back(b);
}

void caching_allocator::impl::deallocate_impl(void* ptr, const stream_handle* stream) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  if (stream) state_for(*stream);  // a stream-ordered free makes the stream known (for fences)
  // Fast path: a free of a block of the stream this thread allocated from last, under that
  // stream's lock alone. A same-stream free records nothing; a free with uses on other streams
  // records their events here too when this thread knows each of those streams to be alive
  // (its stream cache); otherwise (a stream that may be gone, a free held by a graph capture,
  // a capture underway) the device lock is taken below, which lets the free see the tombstones
  // of destroyed streams and the capture's rules (capture.cpp).
  if (const stream_cache_entry& last = t_cache.last_used; last.owner == id_ && !capturing()) {
    auto& st = *static_cast<stream_state*>(last.state);
    std::lock_guard<stream_lock> slk(st.mu);
    if (block* b = st.active.find_active(addr)) {
      if (b->uses.empty() && (!stream || *stream == b->seg->stream) && !b->free_held) {
        free_same_stream_locked(st, b);
        return;
      }
      st.active.erase(addr);
      bool recorded = false;
      try {
        recorded = !b->free_held && record_use_events_locked(b, stream, false);
      } catch (...) {
        st.active.insert(b);
        throw;
      }
      if (recorded) {
        commit_free_locked(st, b, stream);
        return;
      }
      st.active.insert(b);  // a stream this thread does not know: the slow path below
    }
  }
  std::lock_guard<std::mutex> dlk(mu_);
  stream_state* owner = owner_locked(ptr);
  std::unique_lock<stream_lock> slk;
  if (owner) slk = std::unique_lock<stream_lock>(owner->mu);
  block* b = owner ? owner->active.find_active(addr) : nullptr;
  if (!b || b->free_held) throw_invalid_pointer_locked(ptr, stream ? "deallocate(stream)" : "deallocate");
  if (capturing() && free_during_capture_locked(*owner, b, stream)) return;
  free_found_locked(*owner, b, stream);
}

// ---- public interface -------------------------------------------------------------------------------

caching_allocator::caching_allocator(device_backend& backend, options opts)
    : impl_(std::make_unique<impl>(backend, opts)) {}

caching_allocator::~caching_allocator() { impl_->destroy_all(); }

void* caching_allocator::allocate(std::size_t size_bytes, stream_handle stream) {
  impl& m = *impl_;
  if (size_bytes == 0) {
    throw invalid_size("streamsafe: allocate(0 bytes) on device " + std::to_string(m.backend_.device()) +
                       ", stream " + hex(stream) + ": the size must be positive");
  }
  if (size_bytes > detail::k_max_request_bytes || size_bytes > m.limit_bytes_) {
    std::unique_lock<std::mutex> dlk(m.mu_);
    ++m.stats_.num_ooms;
    m.trace(trace_action::oom, 0, size_bytes, stream);
    std::string msg = m.oom_message_locked(size_bytes, size_bytes, stream, nullptr) +
                      "; the request exceeds the device's memory limit";
    dlk.unlock();
    detail::log().error("{}", msg);
    throw out_of_memory(msg);
  }
  const std::size_t rounded = m.opts_.roundup_power2_divisions
                                  ? detail::round_power2_divisions(size_bytes, m.opts_.roundup_power2_divisions)
                                  : detail::round_request(size_bytes);
  const bool small = detail::is_small(rounded);
  if (m.capturing()) {  // a CUDA graph capture is underway on the device (capture.cpp)
    std::unique_lock<std::mutex> dlk(m.mu_);
    m.detect_captures_locked(dlk);
    if (m.capturing()) return m.allocate_during_capture_locked(dlk, size_bytes, rounded, small, stream);
  }
  impl::stream_state& st = m.state_for(stream);
  {
    std::lock_guard<stream_lock> slk(st.mu);
    // Blocks waiting for other streams are retired in batches (process_events_locked): when
    // k_pending_batch more have queued up, or when nothing else fits.
    if (st.pending.size() >= st.process_at) m.process_events_locked(st);
    pool& p = impl::pool_of(st, small);
    // An exact-size block from the quick cache; anything else is a best fit after the quick
    // cache is merged back, so that caching never costs fragmentation.
    block* b = p.quick.pop(rounded);
    if (!b) {
      if (p.quick.count) m.flush_quick_locked(p);
      b = m.best_fit(p, rounded);
    }
    if (!b && !st.pending.empty()) {
      m.process_events_locked(st);
      b = m.best_fit(p, rounded);
      if (!b) b = m.take_pending_locked(st, p, rounded);
    }
    if (b) return m.finish_allocation(st, b, rounded, size_bytes);
  }
  return m.allocate_slow(st, size_bytes, rounded, small);
}

void caching_allocator::deallocate(void* ptr) { impl_->deallocate_impl(ptr, nullptr); }

void caching_allocator::deallocate(void* ptr, stream_handle stream) { impl_->deallocate_impl(ptr, &stream); }

void caching_allocator::record_stream(void* ptr, stream_handle stream) {
  impl& m = *impl_;
  m.state_for(stream);  // the stream becomes known (for fences)
  // Fast path: a block of the stream this thread allocated from last, under that stream's lock
  // (which guards the block and its segment's used streams).
  if (const stream_cache_entry& last = t_cache.last_used; last.owner == m.id_) {
    auto& st = *static_cast<impl::stream_state*>(last.state);
    std::lock_guard<stream_lock> slk(st.mu);
    if (block* b = st.active.find_active(reinterpret_cast<std::uintptr_t>(ptr)); b && !b->free_held) {
      m.add_use_locked(b, stream);
      return;
    }
  }
  std::lock_guard<std::mutex> dlk(m.mu_);
  impl::stream_state* owner = m.owner_locked(ptr);
  std::unique_lock<stream_lock> slk;
  if (owner) slk = std::unique_lock<stream_lock>(owner->mu);
  block* b = owner ? owner->active.find_active(reinterpret_cast<std::uintptr_t>(ptr)) : nullptr;
  if (!b || b->free_held) m.throw_invalid_pointer_locked(ptr, "record_stream");
  m.add_use_locked(b, stream);
}

void caching_allocator::notify_stream_destroyed(stream_handle stream) {
  impl& m = *impl_;
  std::lock_guard<std::mutex> lk(m.mu_);
  auto it = m.streams_.find(stream);
  if (it == m.streams_.end() || !it->second->alive.load()) return;
  event_handle e = m.get_event();
  try {
    m.backend_.record_event(e, stream);
  } catch (...) {
    m.put_event(e);
    throw;
  }
  ++m.stats_.events_recorded;
  m.tombstones_.push_back({e, stream});
  it->second->alive.store(false, std::memory_order_release);
}

statistics caching_allocator::stats() const {
  const impl& m = *impl_;
  std::lock_guard<std::mutex> dlk(m.mu_);
  statistics s = m.stats_;
  std::int64_t inactive_split = 0;
  for (auto& [h, st] : m.streams_) {
    std::lock_guard<stream_lock> slk(st->mu);
    auto add = [](stat& to, const stat& from) {
      to.current += from.current;
      to.allocated += from.allocated;
      to.freed += from.freed;
      to.peak = std::max(to.peak, from.peak);
    };
    const auto& x = st->stats;
    add(s.allocated_bytes, x.allocated_bytes.to_stat());
    add(s.requested_bytes, x.requested_bytes.to_stat());
    add(s.allocation, x.allocation.to_stat());
    const std::int64_t active_bytes = x.allocated_bytes.current + x.pending_bytes.current;
    add(s.active_bytes, stat{active_bytes, x.active_bytes_peak, x.allocated_bytes.total,
                             x.allocated_bytes.total - active_bytes});
    const std::int64_t active = x.allocation.current + x.pending.current;
    add(s.active, stat{active, x.active_peak, x.allocation.total, x.allocation.total - active});
    s.events_recorded += st->stats.events_recorded;
    s.stream_waits += st->stats.stream_waits;
  }
  for (auto& [base, seg] : m.segments_) {
    std::lock_guard<stream_lock> slk(impl::state_of(*seg->owner).mu);
    for (const block* b = seg->first; b; b = b->next) {
      if ((b->state == block_state::free || b->state == block_state::quick_cached) && b->mapped && (b->prev || b->next)) {
        inactive_split += static_cast<std::int64_t>(b->size);
      }
    }
  }
  // Device-wide peaks: sampled whenever a stream passes its own peak (exact for one stream).
  s.allocated_bytes.peak = std::max({s.allocated_bytes.peak, s.allocated_bytes.current, m.peak_allocated_.load()});
  s.active_bytes.peak = std::max({s.active_bytes.peak, s.active_bytes.current, m.peak_active_.load()});
  s.requested_bytes.peak = std::max({s.requested_bytes.peak, s.requested_bytes.current, m.peak_requested_.load()});
  s.inactive_split_bytes.current = inactive_split;
  s.inactive_split_bytes.peak = std::max(s.inactive_split_bytes.peak, inactive_split);
  return s;
}

void caching_allocator::reset_peak_stats() {
  impl& m = *impl_;
  std::lock_guard<std::mutex> dlk(m.mu_);
  std::int64_t allocated = 0, active = 0, requested = 0;
  for (auto& [h, st] : m.streams_) {
    std::lock_guard<stream_lock> slk(st->mu);
    auto& x = st->stats;
    for (impl::fast_stat* f : {&x.allocated_bytes, &x.requested_bytes, &x.allocation, &x.pending_bytes, &x.pending}) {
      f->peak = f->current;
    }
    x.active_bytes_peak = x.allocated_bytes.current + x.pending_bytes.current;
    x.active_peak = x.allocation.current + x.pending.current;
    allocated += x.allocated_bytes.current;
    active += x.active_bytes_peak;
    requested += x.requested_bytes.current;
  }
  m.peak_allocated_ = allocated;
  m.peak_active_ = active;
  m.peak_requested_ = requested;
  statistics& s = m.stats_;
  for (stat* x : {&s.reserved_bytes, &s.inactive_split_bytes, &s.segment}) x->reset_peak();
}

std::size_t caching_allocator::largest_free_block_bytes() const {
  std::lock_guard<std::mutex> dlk(impl_->mu_);
  return impl_->largest_free_locked(nullptr);
}

int caching_allocator::device() const noexcept { return impl_->backend_.device(); }

const options& caching_allocator::config() const noexcept { return impl_->opts_; }

caching_allocator::block_info caching_allocator::find_block(const void* ptr) const {
  impl& m = *impl_;
  std::lock_guard<std::mutex> dlk(m.mu_);
  impl::stream_state* owner = m.owner_locked(ptr);
  if (!owner) return {};
  std::lock_guard<stream_lock> slk(owner->mu);
  const block* b = owner->active.find_active(reinterpret_cast<std::uintptr_t>(ptr));
  if (!b) return {};
  return {b->addr, b->size, b->seg->stream};
}

void caching_allocator::set_trace_recorder(trace_recorder* recorder) noexcept {
  impl_->trace_.store(recorder, std::memory_order_release);
}

const trace_recorder* caching_allocator::trace() const noexcept {
  return impl_->trace_.load(std::memory_order_acquire);
}

memory_snapshot caching_allocator::snapshot() const {
  const impl& m = *impl_;
  memory_snapshot snap;
  snap.stats = stats();  // then the walk, under all locks (the two may differ by concurrent calls)
  snap.device = m.backend_.device();
  snap.time_us = trace_recorder::now_us();
  std::lock_guard<std::mutex> dlk(m.mu_);
  std::vector<std::unique_lock<stream_lock>> locks;
  for (auto& [h, st] : m.streams_) locks.emplace_back(st->mu);
  for (auto& [base, seg] : m.segments_) {
    segment_snapshot ss;
    ss.address = seg->base;
    ss.size_bytes = seg->size;
    ss.mapped_bytes = seg->mapped_bytes;
    ss.stream = seg->stream;
    ss.pool = seg->small ? snapshot_pool::small : snapshot_pool::large;
    ss.expandable = seg->expandable;
    for (const block* b = seg->first; b; b = b->next) {
      block_snapshot bs;
      bs.address = b->addr;
      bs.size_bytes = b->size;
      bs.stream = seg->stream;
      switch (b->state) {
        case block_state::active:
          bs.state = snapshot_block_state::active;
          bs.requested_bytes = b->requested;
          break;
        case block_state::pending_free:
          bs.state = snapshot_block_state::pending_free;
          for (const auto& e : b->events) {
            if (e.stream != detail::k_tombstone_stream) bs.waiting_on.push_back(e.stream);
          }
          break;
        case block_state::releasing:
          bs.state = snapshot_block_state::releasing;
          break;
        case block_state::free:
        case block_state::quick_cached:
          bs.state = b->mapped ? snapshot_block_state::inactive : snapshot_block_state::unmapped;
          break;
      }
      ss.blocks.push_back(std::move(bs));
    }
    snap.segments.push_back(std::move(ss));
  }
  return snap;
}

void caching_allocator::check_invariants() const {
  const impl& m = *impl_;
  std::lock_guard<std::mutex> dlk(m.mu_);
  std::vector<std::unique_lock<stream_lock>> locks;
  for (auto& [h, st] : m.streams_) locks.emplace_back(st->mu);
  auto fail = [](const std::string& what) { throw std::logic_error("streamsafe invariant violated: " + what); };
  std::int64_t reserved = 0, allocated = 0, active = 0;
  std::size_t active_count = 0, free_seen = 0, pending_seen = 0, free_in_pools = 0, pending_total = 0,
              active_total = 0, cached_seen = 0, cached_in_pools = 0;
  for (auto& [base, seg] : m.segments_) {
    if (seg->base != base) fail("segment map key differs from its base");
    const impl::stream_state& owner = impl::state_of(*seg->owner);
    std::uintptr_t expect = seg->base;
    std::size_t mapped = 0;
    for (const block* b = seg->first; b; b = b->next) {
      if (b->addr != expect) fail("blocks do not tile segment " + hex(seg->base) + " at " + hex(b->addr));
      if (b->seg != seg) fail("block " + hex(b->addr) + " points at another segment");
      if (b->next && b->next->prev != b) fail("broken prev link after " + hex(b->addr));
      if (b->size == 0 || b->size % detail::k_min_block_bytes != 0) fail("block size not a multiple of 512");
      if (b->mapped) mapped += b->size;
      if (!seg->expandable && !b->mapped) fail("unmapped block in a cuda_malloc segment");
      const bool in_mapped = detail::free_lists::contains(b);
      const bool in_unmapped = seg->owner->unmapped.count(const_cast<block*>(b)) != 0;
      const bool in_pool = b->mapped ? in_mapped : in_unmapped;
      if (b->mapped && in_unmapped) fail("mapped block in the unmapped set");
      if (b->pending_linked != (b->state == block_state::pending_free))
        fail("block " + hex(b->addr) + ": its pending-list link disagrees with its state");
      switch (b->state) {
        case block_state::free:
          ++free_seen;
          if (!in_pool) fail("free block " + hex(b->addr) + " missing from its pool");
          if (b->next && b->next->state == block_state::free && b->next->mapped == b->mapped)
            fail("two free neighbours not merged at " + hex(b->addr));
          break;
        case block_state::active:
          if (in_pool || in_mapped) fail("active block " + hex(b->addr) + " is in a free pool");
          if (owner.active.find(b->addr) != b) fail("active block missing from its stream's active map");
          allocated += static_cast<std::int64_t>(b->size);
          active += static_cast<std::int64_t>(b->size);
          ++active_count;
          if (!b->mapped) fail("active block is unmapped");
          break;
        case block_state::pending_free:
          if (in_pool || in_mapped) fail("pending block in a free pool");
          active += static_cast<std::int64_t>(b->size);
          ++pending_seen;
          break;
        case block_state::releasing:
          if (in_pool || in_mapped) fail("releasing block in a free pool");
          break;
        case block_state::quick_cached:
          if (in_pool || in_mapped) fail("quick-cached block " + hex(b->addr) + " is also in the free lists");
          if (!b->mapped) fail("quick-cached block is unmapped");
          if (owner.active.find(b->addr) != b) fail("quick-cached block " + hex(b->addr) + " missing from its stream's active map");
          ++cached_seen;
          break;
      }
      expect += b->size;
    }
    if (expect != seg->base + seg->size) fail("blocks do not cover segment " + hex(seg->base));
    if (mapped != seg->mapped_bytes) fail("mapped bytes of segment " + hex(seg->base) + " disagree");
    reserved += static_cast<std::int64_t>(mapped);
  }
  std::int64_t stat_allocated = 0, stat_active = 0;
  for (auto& [h, st] : m.streams_) {
    for (const pool* p : {&st->small_pool, &st->large_pool}) {
      free_in_pools += p->mapped.size() + p->unmapped.size();
      p->mapped.for_each([&](const block* b) {
        if (b->seg->owner != p || !b->mapped || b->state != block_state::free) fail("pool holds a foreign or non-free block");
      });
      for (const block* b : p->unmapped) {
        if (b->seg->owner != p || b->mapped || b->state != block_state::free) fail("unmapped pool holds a bad block");
      }
      std::size_t in_quick = 0;
      p->quick.for_each([&](const block* b) {
        ++in_quick;
        if (b->seg->owner != p || b->state != block_state::quick_cached) fail("quick cache holds a foreign or non-quick-cached block");
      });
      if (in_quick != p->quick.count) fail("quick cache count disagrees");
      cached_in_pools += in_quick;
    }
    pending_total += st->pending.size();
    active_total += st->active.size();
    const impl::stream_state* owner_state = st.get();  // (clang 14: no lambda capture of a binding)
    st->active.for_each([&](const block* b) {
      if (&impl::state_of(*b->seg->owner) != owner_state ||
          (b->state != block_state::active && b->state != block_state::quick_cached))
        fail("active map holds a block of another stream, or one neither active nor quick-cached");
    });
    stat_allocated += st->stats.allocated_bytes.current;
    stat_active += st->stats.allocated_bytes.current + st->stats.pending_bytes.current;
    if (st->cur_allocated.load() != st->stats.allocated_bytes.current) fail("allocated mirror disagrees");
  }
  for (const segment* seg : m.releasing_segments_) {  // being freed with mu_ dropped (release.cpp)
    if (seg->expandable || seg->first->next || seg->first->state != block_state::releasing)
      fail("segment " + hex(seg->base) + " out of the segment map is not a whole segment being released");
    reserved += static_cast<std::int64_t>(seg->mapped_bytes);
  }
  std::size_t held_seen = 0;
  for (auto& [base, seg] : m.segments_) {
    for (const block* b = seg->first; b; b = b->next) held_seen += b->free_held ? 1 : 0;
  }
  for (const auto& h : m.held_frees_) {
    if (h.b->state != block_state::active || !h.b->free_held) fail("a free held during a capture is not an active held block");
  }
  if (held_seen != m.held_frees_.size()) fail("held frees disagree with the blocks marked held");
  if (free_in_pools != free_seen) fail("pools hold blocks that are not in any segment");
  if (cached_in_pools != cached_seen) fail("quick caches hold blocks that are not in any segment");
  if (pending_seen != pending_total) fail("pending lists disagree with pending blocks");
  if (active_count + cached_seen != active_total) fail("active maps hold blocks not in any segment");
  if (reserved != m.stats_.reserved_bytes.current) fail("reserved bytes statistic disagrees with segments");
  if (allocated != stat_allocated) fail("allocated bytes statistic disagrees with blocks");
  if (active != stat_active) fail("active bytes statistic disagrees with blocks");
}

}  // namespace streamsafe
