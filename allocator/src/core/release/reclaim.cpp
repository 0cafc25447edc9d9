// streamsafe core: reclaim, taking memory back from the release queue (the mechanism; when to
// do it is growth_policy.cpp's decision).
//
// Memory that empty_cache (defer mode), a pause or the growth policy queued for release stays
// mapped until the driver call: it is still memory, counted as reserved, and a request reuses it
// before any new memory. Three ways, all without a host wait or new memory from the driver:
//  * in place (reclaim_in_place_locked): a queued block of the requesting pool goes back to its
//    free lists, as it was before it was detached. A block of a pool is reused on the pool's own
//    stream in stream order, and its uses on other streams were settled when it was freed
//    (pending events, record_stream); the fence only guarded the unmap, which no longer happens.
//  * a whole cudaMalloc segment of another pool (reclaim_segment_locked): the requesting stream
//    waits, on the device, for the fence events of its batch (they cover every stream that may
//    still touch it), and the segment moves to the requesting pool.
//  * chunks of another expandable pool (reclaim_by_alias_locked): the same wait, then the
//    physical chunks are mapped a second time into the requesting pool's range
//    (device_backend::map_alias, no new memory); the old mapping stays queued, marked aliased,
//    and its unmap later gives nothing back (it frees an address, not memory).
// A batch left with no block is dropped and its fence events go back to the pool.
// Locks: mu_ and the requesting pool's stream lock; another pool's lock is taken around the
// changes to its segment's blocks.
#include "core/allocator_impl.hpp"
#include "core/blocks/segment_fit.hpp"
#include "core/blocks/size_classes.hpp"
#include "core/common/format.hpp"
#include "core/common/logging.hpp"

#include <algorithm>
#include <mutex>

namespace streamsafe {

using detail::hex;
using ghost_range = detail::release_queue::ghost_range;

// reclaim.cpp: taking queued memory back (no host wait, no new memory).
void caching_allocator::impl::wait_on_fence_locked(stream_handle stream,
                                                   const release_batch& batch) {
  for (const auto& e : batch.fence) {
    stream_wait_on(stream, e.event);
    ++stats_.stream_waits;
  }
  for (const auto& t : streams_.tombstones) {  // destroyed streams' last work
    stream_wait_on(stream, t.event);
    ++stats_.stream_waits;
  }
}

void caching_allocator::impl::take_from_batch_locked(
    const std::deque<release_batch>::iterator& batch, block* b) {
  auto& blocks = batch->blocks;
  blocks.erase(std::find(blocks.begin(), blocks.end(), b));
  if (!b->aliased) {
    batch->bytes -= b->size;
    releases_.deferred_bytes -= b->size;
  }
  if (blocks.empty()) {
    for (auto& e : batch->fence) {
      if (e.stream != detail::k_tombstone_stream) put_event(e.event);
    }
    releases_.deferred.erase(batch);
  }
}

// The smallest queued block of p that serves the request, back to p's free lists
// (whole_rule: not a segment the whole-segment rule keeps whole for the request).
block* caching_allocator::impl::reclaim_in_place_locked(pool& p, std::size_t rounded,
                                                        bool whole_rule) {
  if (capturing()) return nullptr;
  auto free_mapped = [](const block* b) {
    return b && b->state == block_state::free && b->mapped ? b->size : 0;
  };
  block* best = nullptr;
  auto from = releases_.deferred.end();
  for (auto it = releases_.deferred.begin(); it != releases_.deferred.end(); ++it) {
    for (block* b : it->blocks) {
      if (b->seg->owner != &p || b->seg->paused || b->aliased) continue;
      // Expandable: a chunk run merges back with the free pieces around it. cuda_malloc: a whole
      // segment, refused when the whole-segment rule would keep it whole for this request.
      const std::size_t serves = b->seg->expandable
                                     ? b->size + free_mapped(b->prev) + free_mapped(b->next)
                                     : (whole_rule && keeps_whole(b, rounded) ? 0 : b->size);
      if (serves < rounded) continue;
      if (!best || b->size < best->size) {
        best = b;
        from = it;
      }
    }
  }
  if (!best) return nullptr;
  take_from_batch_locked(from, best);
  stats_.release_reclaimed_bytes += best->size;
  detail::log().debug(
      "device {}: {} bytes at {} reclaimed from the release queue for a {} byte "
      "request on stream {}",
      backend_.device(), best->size, hex(best->addr), rounded, hex(p.stream));
  free_block_locked(best);
  return whole_rule ? best_fit(p, rounded) : fit_ignoring_whole_rule(p, rounded);
}

// cuda_malloc: the smallest queued whole segment of another pool that serves the request,
// moved to p behind a wait of p's stream on its release fence.
block* caching_allocator::impl::reclaim_segment_locked(pool& p, std::size_t rounded,
                                                       bool whole_rule) {
  if (capturing() || opts_.release_fence == fence_scope::device) return nullptr;
  block* best = nullptr;
  auto from = releases_.deferred.end();
  for (auto it = releases_.deferred.begin(); it != releases_.deferred.end(); ++it) {
    if (it->device_sync) continue;
    for (block* b : it->blocks) {
      const segment* seg = b->seg;
      if (seg->expandable || seg->owner == &p || seg->small != p.small || seg->paused ||
          b->size < rounded || (whole_rule && keeps_whole(b, rounded)))
        continue;
      if (!best || b->size < best->size) {
        best = b;
        from = it;
      }
    }
  }
  if (!best) return nullptr;
  wait_on_fence_locked(p.stream, *from);  // before the batch's events can go back to the pool
  take_from_batch_locked(from, best);
  segment* seg = best->seg;
  --state_of(*seg->owner).segments;  // under mu_
  ++state_of(p).segments;
  seg->owner = &p;
  seg->stream = p.stream;
  seg->used_streams.clear();
  best->state = block_state::free;
  best->idle_fence = 0;
  p.mapped.insert(best);
  ++stats_.segments_moved;
  stats_.release_reclaimed_bytes += best->size;
  detail::log().debug(
      "device {}: queued segment {} ({} bytes) reclaimed for stream {} behind a "
      "wait on its release fence",
      backend_.device(), hex(seg->base), seg->size, hex(p.stream));
  return whole_rule ? best_fit(p, rounded) : fit_ignoring_whole_rule(p, rounded);
}

// ---- expandable: queued chunks of any pool mapped again into p's range --------------------

// Where p grows for `rounded` bytes: an unmapped block of its ranges (a fresh range if none
// fits), extending the free mapped block before it; *need: the bytes to map there.
block* caching_allocator::impl::alias_target_locked(pool& p, std::size_t rounded,
                                                    std::size_t* need) {
  block* target = p.expandable ? choose_unmapped_locked(p, rounded, *need, false) : nullptr;
  if (!target) {
    reserve_range_locked(p, rounded);
    target = choose_unmapped_locked(p, rounded, *need, false);
  }
  return target && *need != 0 ? target : nullptr;
}

// The queued runs that cover `need` bytes, the largest first (the fewest driver calls for the
// bytes); of the last one only the chunks that cover the rest, the others stay queued. Returns
// the bytes.
std::size_t caching_allocator::impl::choose_queued_runs_locked(const pool& p, std::size_t need,
                                                               std::vector<queued_run>* chosen) {
  std::vector<queued_run> all;
  for (auto it = releases_.deferred.begin(); it != releases_.deferred.end(); ++it) {
    if (it->device_sync) continue;
    for (block* b : it->blocks) {
      if (b->seg->expandable && !b->aliased && !b->seg->paused) all.push_back({it, b});
    }
  }
  std::stable_sort(all.begin(), all.end(),
                   [](const queued_run& a, const queued_run& b) { return a.b->size > b.b->size; });
  std::size_t taken = 0;
  for (queued_run& c : all) {
    if (taken >= need) break;
    const std::size_t lacking = need - taken;
    if (c.b->size > lacking) {
      stream_state& owner = state_of(*c.b->seg->owner);
      // Guards the run's neighbours; p's own stream lock is held already.
      std::unique_lock<stream_lock> olk(owner.mu, std::defer_lock);
      if (&owner != &state_of(p)) olk.lock();
      if (block* rest = cut_chunks_locked(c.b, lacking)) c.batch->blocks.push_back(rest);
    }
    chosen->push_back(c);
    taken += c.b->size;
  }
  return taken;
}

// Whole chunks overshoot the hole at `target`: the smallest unmapped block of p that holds
// `taken` bytes (a fresh range if none); *need: what the request lacks there.
block* caching_allocator::impl::refit_alias_target_locked(pool& p, std::size_t rounded,
                                                          std::size_t taken, std::size_t* need) {
  auto fits = [&]() -> block* {
    auto it = p.unmapped.lower_bound(detail::block_order::key{taken, 0});
    return it == p.unmapped.end() ? nullptr : *it;
  };
  block* target = fits();
  if (!target) {
    reserve_range_locked(p, taken);
    target = fits();
  }
  if (!target) return nullptr;
  const block* prev = target->prev;
  const std::size_t have = prev && prev->state == block_state::free && prev->mapped ? prev->size
                                                                                    : 0;
  *need = have >= rounded ? 0 : detail::round_up(rounded - have, limits_.small_chunk_bytes);
  return target;
}

// p's stream waits on each chosen batch's fence, once; then the chosen chunks are mapped again
// at target, `fresh` bytes mapped anew after them. False (nothing left mapped): the driver had
// no memory.
bool caching_allocator::impl::map_queued_chunks_locked(pool& p, block* target,
                                                       const std::vector<queued_run>& chosen,
                                                       std::size_t fresh) {
  // Before anything changes (a failed wait leaves everything as it was; a wait for nothing only
  // orders more).
  std::vector<const release_batch*> waited;
  for (const queued_run& c : chosen) {
    if (std::find(waited.begin(), waited.end(), &*c.batch) == waited.end()) {
      wait_on_fence_locked(p.stream, *c.batch);
      waited.push_back(&*c.batch);
    }
  }
  segment* dst = target->seg;
  std::uintptr_t at = target->addr;
  std::size_t aliased = 0;
  auto undo = [&] {
    if (aliased) {
      backend_.unmap(reinterpret_cast<void*>(target->addr), aliased);
      forget_chunks(dst, target->addr, aliased);
    }
  };
  try {
    for (const queued_run& c : chosen) {
      if (!backend_.map_alias(reinterpret_cast<void*>(at), reinterpret_cast<void*>(c.b->addr),
                              c.b->size)) {
        undo();
        return false;
      }
      const auto& src = c.b->seg->chunks;
      for (auto it = src.lower_bound(c.b->addr);
           it != src.end() && it->first < c.b->addr + c.b->size; ++it)
        dst->chunks.emplace(at + (it->first - c.b->addr), it->second);
      at += c.b->size;
      aliased += c.b->size;
    }
    if (fresh != 0) {
      const std::size_t gran = p.small ? limits_.small_chunk_bytes : limits_.large_chunk_bytes;
      if (map_chunks_locked(dst, at, fresh, gran) != fresh) {
        undo();
        return false;
      }
    }
  } catch (...) {
    undo();
    throw;
  }
  return true;
}

// Mapped: the old mappings stay queued, marked aliased (ghosts of the new address), and target
// becomes a free mapped block of p.
void caching_allocator::impl::commit_alias_locked(pool& p, block* target,
                                                  const std::vector<queued_run>& chosen,
                                                  std::size_t aliased, std::size_t fresh) {
  std::uintptr_t at = target->addr;
  for (const queued_run& c : chosen) {
    c.batch->bytes -= c.b->size;
    releases_.deferred_bytes -= c.b->size;
    c.b->aliased = true;
    c.b->ghost_owned = 0;
    c.b->alias_at = at;
    releases_.ghosts.emplace(at, ghost_range{c.b->size, c.b, c.b->addr});
    // The memory counts where it is mapped now: in p's kind (a ghost counts only ghost_owned).
    detail::move_reserved(stats_, c.b->seg->small, p.small, static_cast<std::int64_t>(c.b->size));
    at += c.b->size;
  }
  const std::size_t total = aliased + fresh;
  p.unmapped.erase(target);
  if (total < target->size) p.unmapped.insert(split_off_locked(target, total));
  target->mapped = true;
  target->seg->mapped_bytes += total;
  if (fresh != 0) {
    detail::add_reserved(stats_, p.small, static_cast<std::int64_t>(fresh));
    trace(trace_action::segment_map, at, fresh, p.stream);
  }
  stats_.release_reclaimed_bytes += aliased;
  detail::log().debug(
      "device {}: {} queued bytes mapped again at {} for stream {} behind a wait on "
      "their release fences ({} bytes mapped anew)",
      backend_.device(), aliased, hex(target->addr), hex(p.stream), fresh);
  free_block_locked(target);
}

// expandable (its growth hook's call): queued chunks of any pool mapped again into p's range
// behind their fences, what they lack mapped anew within the limit (within_peak: only if that
// keeps reserved at or below its peak; in_flight set when the release worker's release in flight
// is what stands in the way).
block* caching_allocator::impl::reclaim_by_alias_locked(pool& p, std::size_t rounded,
                                                        bool within_peak, bool* in_flight) {
  if (capturing() || opts_.release_fence == fence_scope::device || releases_.deferred.empty())
    return nullptr;
  std::size_t need = 0;
  block* target = alias_target_locked(p, rounded, &need);
  if (!target) return nullptr;
  std::vector<queued_run> chosen;
  const std::size_t taken = choose_queued_runs_locked(p, need, &chosen);
  if (chosen.empty()) return nullptr;
  if (taken > target->size && !(target = refit_alias_target_locked(p, rounded, taken, &need)))
    return nullptr;
  const std::size_t fresh = need > taken ? need - taken : 0;  // mapped anew, under the limit
  const detail::growth_room room = growth_room_locked();
  if (!room.fits_limit(fresh) || taken + fresh > target->size) return nullptr;
  // Memory the release worker is giving back right now still counts: the caller waits for that
  // release (driver calls, never a fence) and asks again.
  if (within_peak && fresh != 0 && room.raises_peak(fresh)) {
    if (in_flight && worker_release_in_flight_locked()) *in_flight = true;
    return nullptr;
  }
  if (!map_queued_chunks_locked(p, target, chosen, fresh)) return nullptr;
  commit_alias_locked(p, target, chosen, taken, fresh);
  return best_fit(p, rounded);
}

// A new address's [addr, addr + bytes), in a segment of kind `small`, goes back to the driver:
// the bytes of it still mapped at a ghost (the old address of reclaimed memory) become that
// ghost's to give back, counted in the ghost's kind from now on.
std::size_t caching_allocator::impl::unghost_locked(std::uintptr_t addr, std::size_t bytes,
                                                    bool small) {
  if (releases_.ghosts.empty()) return 0;
  const std::uintptr_t end = addr + bytes;
  std::size_t held = 0;
  auto it = releases_.ghosts.upper_bound(addr);
  if (it != releases_.ghosts.begin()) --it;
  while (it != releases_.ghosts.end() && it->first < end) {
    const std::uintptr_t lo = it->first;
    const std::uintptr_t hi = lo + it->second.bytes;
    block* ghost = it->second.ghost;
    const std::uintptr_t from = it->second.from;
    if (hi <= addr) {
      ++it;
      continue;
    }
    const std::uintptr_t cut_lo = std::max(lo, addr);
    const std::uintptr_t cut_hi = std::min(hi, end);
    held += cut_hi - cut_lo;
    ghost->ghost_owned += cut_hi - cut_lo;
    detail::move_reserved(stats_, small, ghost->seg->small,
                          static_cast<std::int64_t>(cut_hi - cut_lo));
    it = releases_.ghosts.erase(it);  // the parts of the entry outside the range stay
    if (lo < cut_lo) releases_.ghosts.emplace(lo, ghost_range{cut_lo - lo, ghost, from});
    if (cut_hi < hi) {
      it = releases_.ghosts.emplace(cut_hi, ghost_range{hi - cut_hi, ghost, from + (cut_hi - lo)})
               .first;
    }
  }
  return held;
}

// The ghost b's unmap: forgets its entries, returns the bytes it gives back (of ghost_owned).
// Older ghosts of memory mapped at b's address (entries inside b's range) follow that memory:
// where b's memory is still mapped at a newer address, their entries move there; where it is
// not (b owns it: the newer address went first), the older ghost maps it last and owns it now.
std::size_t caching_allocator::impl::drop_ghost_locked(block* b) {
  auto& ghosts = releases_.ghosts;
  const std::uintptr_t lo_b = b->addr;
  const std::uintptr_t hi_b = b->addr + b->size;
  // b's own entries (they may have moved with its memory): address in b's range -> (bytes,
  // where that memory is mapped now).
  std::map<std::uintptr_t, std::pair<std::size_t, std::uintptr_t>> mine;
  for (auto g = ghosts.begin(); g != ghosts.end();) {
    if (g->second.ghost == b) {
      mine.emplace(g->second.from, std::make_pair(g->second.bytes, g->first));
      g = ghosts.erase(g);
    } else {
      ++g;
    }
  }
  std::vector<std::pair<std::uintptr_t, ghost_range>> keep;
  std::size_t passed = 0;  // of b's own bytes, now an older ghost's
  auto it = ghosts.upper_bound(lo_b);
  if (it != ghosts.begin()) --it;
  while (it != ghosts.end() && it->first < hi_b) {
    const std::uintptr_t lo = it->first;
    const ghost_range e = it->second;
    const std::uintptr_t hi = lo + e.bytes;
    if (hi <= lo_b) {
      ++it;
      continue;
    }
    it = ghosts.erase(it);
    const std::uintptr_t in_lo = std::max(lo, lo_b);
    const std::uintptr_t in_hi = std::min(hi, hi_b);
    if (lo < in_lo) keep.push_back({lo, {in_lo - lo, e.ghost, e.from}});
    if (in_hi < hi) keep.push_back({in_hi, {hi - in_hi, e.ghost, e.from + (in_hi - lo)}});
    // [in_lo, in_hi): m is the first of b's entries that ends past `at`.
    std::uintptr_t at = in_lo;
    auto m = mine.upper_bound(at);
    if (m != mine.begin() && std::prev(m)->first + std::prev(m)->second.first > at) --m;
    while (at < in_hi) {
      const std::uintptr_t next = m == mine.end() ? in_hi : std::min(m->first, in_hi);
      if (at < next) {  // b's own memory: mapped at e.ghost alone once b's unmap returns
        const std::size_t n = next - at;
        e.ghost->ghost_owned += n;
        passed += n;
        detail::move_reserved(stats_, b->seg->small, e.ghost->seg->small,
                              static_cast<std::int64_t>(n));
        at = next;
        continue;
      }
      const std::uintptr_t end = std::min(m->first + m->second.first, in_hi);
      keep.push_back({m->second.second + (at - m->first), {end - at, e.ghost, e.from + (at - lo)}});
      at = end;
      ++m;
    }
  }
  for (const auto& k : keep) ghosts.emplace(k.first, k.second);
  return b->ghost_owned - std::min(passed, b->ghost_owned);
}

}  // namespace streamsafe
