// streamsafe core: allocation, free, record_stream and bookkeeping of the caching allocator.
//
// Allocation order for a rounded request on stream s (pool = s's small or large pool):
//   1. best fit among the pool's free blocks (size, then address);
//   2. a block of the pool whose host free is done but whose other-stream uses are pending:
//      s waits on their events (stream_wait_event), the host never blocks;
//   3. growth: a new cudaMalloc segment, or more chunks mapped into s's expandable segment;
//   4. (out of memory) a whole free segment of another stream's pool, moved behind a fence
//      that s waits on; then a safe release of the cache (fenced) and one retry; then
//      out_of_memory.
// Invariants and the lock: see block.hpp and allocator_state.hpp.
#include "allocator_state.hpp"
#include "logging.hpp"
#include "size_classes.hpp"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <sstream>

namespace streamsafe {

using detail::block;
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
  }
  return "?";
}

}  // namespace

caching_allocator::impl::impl(device_backend& backend, options opts)
    : backend_(backend), opts_(opts) {
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
}

caching_allocator::impl::stream_state& caching_allocator::impl::stream_locked(stream_handle stream) {
  auto it = streams_.find(stream);
  if (it == streams_.end()) {
    auto state = std::make_unique<stream_state>();
    state->small_pool.stream = state->large_pool.stream = stream;
    state->small_pool.small = true;
    it = streams_.emplace(stream, std::move(state)).first;
  } else if (!it->second->alive) {
    // A handle value recycled by the driver: the new stream must not see the old one's blocks
    // before the old stream's last work has completed.
    for (auto& t : tombstones_) {
      if (t.stream == stream) {
        backend_.stream_wait_event(stream, t.event);
        ++stats_.stream_waits;
      }
    }
    it->second->alive = true;
  }
  return *it->second;
}

event_handle caching_allocator::impl::get_event_locked() {
  if (!free_events_.empty()) {
    event_handle e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  return backend_.create_event();
}

void caching_allocator::impl::note_use_locked(segment* seg, stream_handle stream) {
  if (stream != seg->stream &&
      std::find(seg->used_streams.begin(), seg->used_streams.end(), stream) == seg->used_streams.end()) {
    seg->used_streams.push_back(stream);
  }
}

block* caching_allocator::impl::best_fit_locked(detail::free_set& set, std::size_t rounded, bool small) const {
  auto it = set.lower_bound(detail::block_order::key{rounded, 0});
  if (it == set.end()) return nullptr;
  block* b = *it;
  if (!small && opts_.max_split_size_bytes != 0 && !b->seg->expandable) {
    // Oversize blocks are never split, and serve only requests close to their size.
    if (rounded < opts_.max_split_size_bytes && b->size >= opts_.max_split_size_bytes) return nullptr;
    if (rounded >= opts_.max_split_size_bytes && b->size >= rounded + detail::k_large_segment_bytes) return nullptr;
  }
  return b;
}

block* caching_allocator::impl::merge_locked(block* dst, block* src) {
  // Joins two address-adjacent blocks; the lower one survives.
  block* lo = dst->addr < src->addr ? dst : src;
  block* hi = lo == dst ? src : dst;
  lo->size += hi->size;
  lo->next = hi->next;
  if (hi->next) hi->next->prev = lo;
  delete hi;
  return lo;
}

void caching_allocator::impl::free_block_locked(block* b) {
  b->state = block_state::free;
  b->requested = 0;
  b->uses.clear();
  pool& p = *b->seg->owner;
  if (block* prev = b->prev; prev && prev->state == block_state::free && prev->mapped == b->mapped) {
    p.set_for(prev).erase(prev);
    b = merge_locked(prev, b);
  }
  if (block* next = b->next; next && next->state == block_state::free && next->mapped == b->mapped) {
    p.set_for(next).erase(next);
    b = merge_locked(b, next);
  }
  p.set_for(b).insert(b);
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
  auto* rest = new block;
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

void caching_allocator::impl::retire_pending_locked(block* b) {
  pending_blocks_.erase(b->pending_pos);
  for (auto& e : b->events) put_event_locked(e.event);
  b->events.clear();
  stats_.active_bytes.decrease(static_cast<std::int64_t>(b->size));
  stats_.active.decrease(1);
  free_block_locked(b);
}

void caching_allocator::impl::process_events_locked() {
  // Events of one stream complete in order; as PyTorch does, stop at the first pending block.
  while (!pending_blocks_.empty()) {
    block* b = pending_blocks_.front();
    for (auto& e : b->events) {
      if (!backend_.query_event(e.event)) return;
    }
    retire_pending_locked(b);
  }
}

block* caching_allocator::impl::take_pending_locked(stream_handle stream, bool small, std::size_t rounded) {
  block* best = nullptr;
  for (block* b : pending_blocks_) {
    if (b->seg->stream == stream && b->seg->small == small && b->mapped && b->size >= rounded &&
        (!best || b->size < best->size)) {
      best = b;
    }
  }
  if (!best) return nullptr;
  for (auto& e : best->events) {
    backend_.stream_wait_event(stream, e.event);
    ++stats_.stream_waits;
  }
  pool& p = *best->seg->owner;
  retire_pending_locked(best);
  return best_fit_locked(p.mapped, rounded, small);
}

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
  auto* b = new block;
  b->addr = seg->base;
  b->size = size;
  b->seg = seg;
  seg->first = b;
  segments_.emplace(seg->base, seg);
  p.mapped.insert(b);
  stats_.reserved_bytes.increase(static_cast<std::int64_t>(size));
  stats_.segment.increase(1);
  ++stats_.num_device_alloc;
  detail::log().debug("device {}: segment_alloc {} bytes at {} for stream {}", backend_.device(), size,
                      hex(seg->base), hex(p.stream));
  return b;
}

bool caching_allocator::impl::map_chunks_locked(std::uintptr_t addr, std::size_t bytes, std::size_t chunk) {
  // One backend map per chunk, so that any chunk can later be unmapped alone.
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
    if (done) backend_.unmap(reinterpret_cast<void*>(addr), done);
    return false;
  }
  return true;
}

block* caching_allocator::impl::expandable_fit_locked(pool& p, std::size_t rounded) {
  const std::size_t gran = p.small ? small_chunk_bytes_ : large_chunk_bytes_;
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
    auto* b = new block;
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
  if (block* fit = best_fit_locked(p.unmapped, rounded, p.small)) choice = fit;
  if (!p.unmapped.empty()) {
    block* largest = *p.unmapped.rbegin();
    if (largest->size >= need(largest) && (!choice || need(largest) < need(choice))) choice = largest;
  }
  if (!choice) return nullptr;
  const std::size_t map_bytes = need(choice);
  if (map_bytes == 0 || map_bytes > choice->size) return nullptr;
  if (static_cast<std::size_t>(stats_.reserved_bytes.current) + map_bytes > limit_bytes_) return nullptr;
  if (!map_chunks_locked(choice->addr, map_bytes, gran)) return nullptr;
  segment* seg = choice->seg;
  p.unmapped.erase(choice);
  if (map_bytes < choice->size) {
    auto* rest = new block;
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
  ++stats_.num_device_alloc;
  detail::log().debug("device {}: segment_map {} bytes at {} (stream {})", backend_.device(), map_bytes,
                      hex(choice->addr), hex(p.stream));
  free_block_locked(choice);  // merges with the free mapped block before it
  return best_fit_locked(p.mapped, rounded, p.small);
}

block* caching_allocator::impl::steal_segment_locked(pool& p, std::size_t rounded) {
  if (opts_.backend == backend_kind::expandable || opts_.release_fence == fence_scope::device) return nullptr;
  segment* best = nullptr;
  for (auto& [base, seg] : segments_) {
    const block* f = seg->first;
    if (seg->expandable || seg->owner == &p || seg->small != p.small || f->next || f->state != block_state::free ||
        f->size < rounded) {
      continue;
    }
    if (!best || seg->size < best->size) best = seg;
  }
  if (!best) return nullptr;
  // The new stream waits, on the device, for every stream that may still touch the segment.
  for (stream_handle s : fence_streams_locked(best)) {
    if (s == p.stream) continue;
    event_handle e = get_event_locked();
    try {
      backend_.record_event(e, s);
      backend_.stream_wait_event(p.stream, e);
    } catch (...) {
      put_event_locked(e);
      throw;
    }
    put_event_locked(e);
    ++stats_.events_recorded;
    ++stats_.stream_waits;
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

block* caching_allocator::impl::find_block_locked(pool& p, std::size_t rounded, bool allow_growth) {
  if (block* b = best_fit_locked(p.mapped, rounded, p.small)) return b;
  if (block* b = take_pending_locked(p.stream, p.small, rounded)) return b;
  if (!allow_growth) return nullptr;
  if (opts_.backend == backend_kind::expandable) return expandable_fit_locked(p, rounded);
  return new_segment_locked(p, rounded);
}

std::size_t caching_allocator::impl::largest_free_locked() const {
  std::size_t largest = 0;
  for (auto& [s, state] : streams_) {
    for (const pool* p : {&state->small_pool, &state->large_pool}) {
      if (!p->mapped.empty()) largest = std::max(largest, (*p->mapped.rbegin())->size);
    }
  }
  return largest;
}

std::string caching_allocator::impl::oom_message_locked(std::size_t size, std::size_t rounded,
                                                         stream_handle stream) {
  std::size_t free_bytes = 0, total_bytes = 0;
  try {
    backend_.memory_info(free_bytes, total_bytes);
  } catch (const std::exception&) {
  }
  std::ostringstream os;
  os << "streamsafe: out of memory on device " << backend_.device() << ": tried to allocate "
     << format_bytes(size);
  if (rounded != size) os << " (rounded to " << format_bytes(rounded) << ")";
  os << " on stream " << hex(stream) << "; device total " << format_bytes(total_bytes) << ", free "
     << format_bytes(free_bytes) << "; allocated " << format_bytes(static_cast<std::size_t>(stats_.allocated_bytes.current))
     << ", reserved " << format_bytes(static_cast<std::size_t>(stats_.reserved_bytes.current))
     << ", largest free block " << format_bytes(largest_free_locked()) << "; limit "
     << format_bytes(limit_bytes_);
  if (deferred_bytes_ != 0) os << "; " << format_bytes(deferred_bytes_) << " waiting for release fences";
  return os.str();
}

void caching_allocator::impl::throw_invalid_pointer_locked(const void* ptr, const char* what) const {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  std::ostringstream os;
  os << "streamsafe: " << what << "(" << hex(addr) << ") on device " << backend_.device() << ": ";
  auto it = segments_.upper_bound(addr);
  if (it != segments_.begin()) {
    const segment* seg = std::prev(it)->second;
    if (addr < seg->base + seg->size) {
      for (const block* b = seg->first; b; b = b->next) {
        if (addr < b->addr || addr >= b->addr + b->size) continue;
        if (b->addr == addr) {
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

// ---- public interface -------------------------------------------------------------------------

caching_allocator::caching_allocator(device_backend& backend, options opts)
    : impl_(std::make_unique<impl>(backend, opts)) {}

caching_allocator::~caching_allocator() { impl_->destroy_all(); }

void* caching_allocator::allocate(std::size_t size_bytes, stream_handle stream) {
  impl& m = *impl_;
  if (size_bytes == 0) {
    throw invalid_size("streamsafe: allocate(0 bytes) on device " + std::to_string(m.backend_.device()) +
                       ", stream " + hex(stream) + ": the size must be positive");
  }
  std::unique_lock<std::mutex> lk(m.mu_);
  if (size_bytes > detail::k_max_request_bytes || size_bytes > m.limit_bytes_) {
    ++m.stats_.num_ooms;
    std::string msg = m.oom_message_locked(size_bytes, size_bytes, stream) +
                      "; the request exceeds the device's memory limit";
    lk.unlock();
    detail::log().error("{}", msg);
    throw out_of_memory(msg);
  }
  const std::size_t rounded = detail::round_request(size_bytes);
  const bool small = detail::is_small(rounded);
  if (!m.pending_blocks_.empty()) m.process_events_locked();
  block* b = m.find_block_locked(m.pool_locked(stream, small), rounded, true);
  if (!b && !m.deferred_.empty()) {
    m.finish_deferred(lk, false);
    b = m.find_block_locked(m.pool_locked(stream, small), rounded, true);
  }
  if (!b) b = m.steal_segment_locked(m.pool_locked(stream, small), rounded);
  if (!b) {
    ++m.stats_.num_alloc_retries;
    m.release_cached(lk, empty_cache_mode::wait);
    b = m.find_block_locked(m.pool_locked(stream, small), rounded, true);
  }
  if (!b) {
    ++m.stats_.num_ooms;
    std::string msg = m.oom_message_locked(size_bytes, rounded, stream);
    lk.unlock();
    detail::log().error("{}", msg);
    throw out_of_memory(msg);
  }
  b->seg->owner->mapped.erase(b);
  b->state = block_state::active;  // before the split, so the remainder does not merge back
  m.split_locked(b, rounded);
  b->requested = size_bytes;
  m.active_blocks_.emplace(b->addr, b);
  m.stats_.allocated_bytes.increase(static_cast<std::int64_t>(b->size));
  m.stats_.active_bytes.increase(static_cast<std::int64_t>(b->size));
  m.stats_.requested_bytes.increase(static_cast<std::int64_t>(size_bytes));
  m.stats_.allocation.increase(1);
  m.stats_.active.increase(1);
  if (detail::log().should_log(spdlog::level::trace)) {
    detail::log().trace("alloc {} bytes at {} stream {}", size_bytes, hex(b->addr), hex(stream));
  }
  return reinterpret_cast<void*>(b->addr);
}

void caching_allocator::impl::deallocate_impl(void* ptr, const stream_handle* stream) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = active_blocks_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == active_blocks_.end()) throw_invalid_pointer_locked(ptr, stream ? "deallocate(stream)" : "deallocate");
  block* b = it->second;
  segment* seg = b->seg;
  std::vector<stream_handle> wait_on = b->uses;
  if (stream && *stream != seg->stream &&
      std::find(wait_on.begin(), wait_on.end(), *stream) == wait_on.end()) {
    stream_locked(*stream);
    wait_on.push_back(*stream);
  }
  // Record every event first: a failure leaves the block active and the state unchanged.
  std::vector<detail::pending_event> events;
  events.reserve(wait_on.size());
  try {
    for (stream_handle s : wait_on) {
      event_handle e = get_event_locked();
      events.push_back({e, s});
      backend_.record_event(e, s);
    }
  } catch (...) {
    for (auto& e : events) put_event_locked(e.event);
    throw;
  }
  if (stream) note_use_locked(seg, *stream);
  active_blocks_.erase(it);
  stats_.allocated_bytes.decrease(static_cast<std::int64_t>(b->size));
  stats_.requested_bytes.decrease(static_cast<std::int64_t>(b->requested));
  stats_.allocation.decrease(1);
  stats_.events_recorded += events.size();
  if (events.empty()) {
    stats_.active_bytes.decrease(static_cast<std::int64_t>(b->size));
    stats_.active.decrease(1);
    free_block_locked(b);
    return;
  }
  b->events = std::move(events);
  b->uses.clear();
  b->state = block_state::pending_free;
  b->pending_pos = pending_blocks_.insert(pending_blocks_.end(), b);
}

void caching_allocator::deallocate(void* ptr) { impl_->deallocate_impl(ptr, nullptr); }

void caching_allocator::deallocate(void* ptr, stream_handle stream) { impl_->deallocate_impl(ptr, &stream); }

void caching_allocator::record_stream(void* ptr, stream_handle stream) {
  impl& m = *impl_;
  std::lock_guard<std::mutex> lk(m.mu_);
  auto it = m.active_blocks_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == m.active_blocks_.end()) m.throw_invalid_pointer_locked(ptr, "record_stream");
  block* b = it->second;
  m.stream_locked(stream);
  if (stream != b->seg->stream && std::find(b->uses.begin(), b->uses.end(), stream) == b->uses.end()) {
    b->uses.push_back(stream);
  }
  m.note_use_locked(b->seg, stream);
}

void caching_allocator::notify_stream_destroyed(stream_handle stream) {
  impl& m = *impl_;
  std::lock_guard<std::mutex> lk(m.mu_);
  auto it = m.streams_.find(stream);
  if (it == m.streams_.end() || !it->second->alive) return;
  event_handle e = m.get_event_locked();
  try {
    m.backend_.record_event(e, stream);
  } catch (...) {
    m.put_event_locked(e);
    throw;
  }
  ++m.stats_.events_recorded;
  m.tombstones_.push_back({e, stream});
  it->second->alive = false;
}

statistics caching_allocator::stats() const {
  const impl& m = *impl_;
  std::lock_guard<std::mutex> lk(m.mu_);
  statistics s = m.stats_;
  std::int64_t inactive_split = 0;
  for (auto& [base, seg] : m.segments_) {
    for (const block* b = seg->first; b; b = b->next) {
      if (b->state == block_state::free && b->mapped && (b->prev || b->next)) {
        inactive_split += static_cast<std::int64_t>(b->size);
      }
    }
  }
  s.inactive_split_bytes.current = inactive_split;
  s.inactive_split_bytes.peak = std::max(s.inactive_split_bytes.peak, inactive_split);
  return s;
}

void caching_allocator::reset_peak_stats() {
  std::lock_guard<std::mutex> lk(impl_->mu_);
  statistics& s = impl_->stats_;
  for (stat* st : {&s.allocated_bytes, &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes,
                   &s.requested_bytes, &s.allocation, &s.segment, &s.active}) {
    st->reset_peak();
  }
}

std::size_t caching_allocator::largest_free_block_bytes() const {
  std::lock_guard<std::mutex> lk(impl_->mu_);
  return impl_->largest_free_locked();
}

int caching_allocator::device() const noexcept { return impl_->backend_.device(); }

const options& caching_allocator::config() const noexcept { return impl_->opts_; }

caching_allocator::block_info caching_allocator::find_block(const void* ptr) const {
  std::lock_guard<std::mutex> lk(impl_->mu_);
  auto it = impl_->active_blocks_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == impl_->active_blocks_.end()) return {};
  return {it->second->addr, it->second->size, it->second->seg->stream};
}

void caching_allocator::check_invariants() const {
  const impl& m = *impl_;
  std::lock_guard<std::mutex> lk(m.mu_);
  auto fail = [](const std::string& what) { throw std::logic_error("streamsafe invariant violated: " + what); };
  std::int64_t reserved = 0, allocated = 0, active = 0;
  std::size_t active_count = 0, free_in_sets = 0, free_seen = 0, pending_seen = 0;
  for (auto& [base, seg] : m.segments_) {
    if (seg->base != base) fail("segment map key differs from its base");
    std::uintptr_t expect = seg->base;
    std::size_t mapped = 0;
    for (const block* b = seg->first; b; b = b->next) {
      if (b->addr != expect) fail("blocks do not tile segment " + hex(seg->base) + " at " + hex(b->addr));
      if (b->seg != seg) fail("block " + hex(b->addr) + " points at another segment");
      if (b->next && b->next->prev != b) fail("broken prev link after " + hex(b->addr));
      if (b->size == 0 || b->size % detail::k_min_block_bytes != 0) fail("block size not a multiple of 512");
      if (b->mapped) mapped += b->size;
      if (!seg->expandable && !b->mapped) fail("unmapped block in a cuda_malloc segment");
      const auto& set = b->mapped ? seg->owner->mapped : seg->owner->unmapped;
      const bool in_set = set.count(const_cast<block*>(b)) != 0;
      switch (b->state) {
        case block_state::free:
          ++free_seen;
          if (!in_set) fail("free block " + hex(b->addr) + " missing from its pool");
          if (b->next && b->next->state == block_state::free && b->next->mapped == b->mapped)
            fail("two free neighbours not merged at " + hex(b->addr));
          break;
        case block_state::active: {
          if (in_set) fail("active block " + hex(b->addr) + " is in a free pool");
          auto it = m.active_blocks_.find(b->addr);
          if (it == m.active_blocks_.end() || it->second != b) fail("active block missing from the active map");
          allocated += static_cast<std::int64_t>(b->size);
          active += static_cast<std::int64_t>(b->size);
          ++active_count;
          if (!b->mapped) fail("active block is unmapped");
          break;
        }
        case block_state::pending_free:
          if (in_set) fail("pending block in a free pool");
          if (*b->pending_pos != b) fail("pending block not in the pending list");
          active += static_cast<std::int64_t>(b->size);
          ++pending_seen;
          break;
        case block_state::releasing:
          if (in_set) fail("releasing block in a free pool");
          break;
      }
      expect += b->size;
    }
    if (expect != seg->base + seg->size) fail("blocks do not cover segment " + hex(seg->base));
    if (mapped != seg->mapped_bytes) fail("mapped bytes of segment " + hex(seg->base) + " disagree");
    reserved += static_cast<std::int64_t>(mapped);
  }
  for (auto& [s, state] : m.streams_) {
    for (const pool* p : {&state->small_pool, &state->large_pool}) {
      free_in_sets += p->mapped.size() + p->unmapped.size();
      for (const block* b : p->mapped) {
        if (b->seg->owner != p || !b->mapped || b->state != block_state::free) fail("pool holds a foreign or non-free block");
      }
      for (const block* b : p->unmapped) {
        if (b->seg->owner != p || b->mapped || b->state != block_state::free) fail("unmapped pool holds a bad block");
      }
    }
  }
  if (free_in_sets != free_seen) fail("pools hold blocks that are not in any segment");
  if (pending_seen != m.pending_blocks_.size()) fail("pending list size disagrees");
  if (active_count != m.active_blocks_.size()) fail("active map holds blocks not in any segment");
  if (reserved != m.stats_.reserved_bytes.current) fail("reserved bytes statistic disagrees with segments");
  if (allocated != m.stats_.allocated_bytes.current) fail("allocated bytes statistic disagrees with blocks");
  if (active != m.stats_.active_bytes.current) fail("active bytes statistic disagrees with blocks");
}

}  // namespace streamsafe
