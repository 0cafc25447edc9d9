// streamsafe core: growth's mechanisms: new segments, ranges and chunks, and the move of a whole
// free segment from another stream. When each is used is the growth policy's choice
// (growth_policy.cpp, which numbers its steps).
//
// cuda_malloc backend: one segment per growth (segment_bytes_for), within limits_.limit_bytes; a
// growth of a large pool that would raise peak reserved first takes a whole free segment of another
// stream's large pool (steal_segment_locked, as the policy does at the memory limit).
// expandable backend: reserved address ranges per pool (a first one, and another when a request
// fits in no hole of those the pool has), chunks mapped into their unmapped blocks as needed
// (each chunk mapped alone, so that any may later be unmapped alone; segment::chunks). A growth
// maps exactly what the request lacks, rounded up to the driver's granularity: in chunks of
// the pool's chunk size, the last one the rest, so that no growth leaves up to a chunk of free
// mapped memory behind the request.
// Invariant: stats_.reserved_bytes counts every mapped byte of every segment (and of the
// segments being released, release.cpp). Locks: the device lock (mu_) and the lock of the
// growing pool's stream are held by every function here; steal_segment_locked also takes the
// other stream's lock, re-checking its choice under it.
#include "core/allocator_impl.hpp"
#include "core/blocks/segment_fit.hpp"
#include "core/blocks/size_classes.hpp"
#include "core/common/format.hpp"
#include "core/common/logging.hpp"

#include <algorithm>
#include <cctype>
#include <cstdint>

namespace streamsafe {

using detail::hex;

// A new segment of p at `base` as one free block: mapped (cuda_malloc) or not (expandable).
block* detail::growth_layer::add_segment_locked(pool& p, std::uintptr_t base, std::size_t size,
                                                bool mapped) {
  auto* seg = new segment;
  seg->base = base;
  seg->size = size;
  seg->mapped_bytes = mapped ? size : 0;
  seg->stream = p.stream;
  seg->small = p.small;
  seg->expandable = !mapped;
  seg->owner = &p;
  ++state_of(p).segments;
  block* b = new_block(state_of(p));
  b->addr = base;
  b->size = size;
  b->seg = seg;
  b->mapped = mapped;
  seg->first = b;
  streams_.segments.emplace(base, seg);
  if (mapped) p.mapped.insert(b);
  else p.unmapped.insert(b);
  detail::add_segment(stats_, seg->small);
  return b;
}

block* detail::growth_layer::new_segment_locked(pool& p, std::size_t rounded) {
  const std::size_t size = detail::segment_bytes_for(rounded);
  if (!growth_room_locked().fits_limit(size)) return nullptr;
  void* base = backend_.allocate_segment(size);
  if (!base) return nullptr;
  block* b = add_segment_locked(p, reinterpret_cast<std::uintptr_t>(base), size, true);
  detail::add_reserved(stats_, b->seg->small, static_cast<std::int64_t>(size));
  ++stats_.num_device_alloc;
  trace(trace_action::segment_alloc, b->addr, size, p.stream);
  detail::log().debug("device {}: segment_alloc {} bytes at {} for stream {}", backend_.device(),
                      size, hex(b->addr), hex(p.stream));
  return b;
}

// The chunk of a large-pool growth of `bytes`: expandable_chunk_mb, or less against the peak
// (options::expandable_chunks_per_peak): the high-water mark of reserved bytes, or reserved
// after this growth if more, over chunks_per_peak, down to the granularity.
std::size_t detail::growth_layer::large_chunk_for_locked(std::size_t bytes) const {
  const std::size_t g = limits_.small_chunk_bytes;
  if (limits_.chunks_per_peak == 0) return limits_.large_chunk_bytes;
  const auto reserved = static_cast<std::size_t>(stats_.reserved_bytes.current);
  const std::size_t peak = std::max(reserved_high_water_locked(), reserved + bytes);
  const std::size_t share = peak / limits_.chunks_per_peak / g * g;
  return std::min(limits_.large_chunk_bytes, std::max(g, share));
}

// Bytes mapped: chunks of `chunk` up to `fine_from` bytes into the range, of `fine` after it.
std::size_t detail::growth_layer::map_chunks_locked(segment* seg, std::uintptr_t addr,
                                                    std::size_t bytes, std::size_t chunk,
                                                    std::size_t fine_from, std::size_t fine) {
  // One backend map per chunk, so that any chunk can later be unmapped alone: `chunk` bytes
  // each up to `fine_from` bytes into the range and `fine` bytes each after it, the last one of
  // each part the rest (multiples of the granularity). Out of memory part-way: the
  // chunks mapped so far are unmapped again, except during a graph capture (no unmap may run
  // then), where they are kept, counted in the returned bytes.
  std::size_t done = 0;
  std::size_t maps = 0;
  auto forget = [&] {
    seg->chunks.erase(seg->chunks.lower_bound(addr), seg->chunks.lower_bound(addr + done));
  };
  try {
    while (done < bytes) {
      const std::size_t piece = done < fine_from ? std::min({chunk, bytes - done, fine_from - done})
                                                 : std::min(fine, bytes - done);
      // Recorded before the map, so that nothing can throw after a map succeeded.
      const auto at = seg->chunks.emplace(addr + done, piece).first;
      bool mapped = false;
      try {
        mapped = backend_.map(reinterpret_cast<void*>(addr + done), piece);
      } catch (...) {
        seg->chunks.erase(at);
        throw;
      }
      if (!mapped) {
        seg->chunks.erase(at);
        break;
      }
      ++maps;
      done += piece;
    }
  } catch (...) {
    if (done) {
      backend_.unmap(reinterpret_cast<void*>(addr), done);
      forget();
    }
    throw;
  }
  if (done < bytes && !capturing()) {
    if (done) {
      backend_.unmap(reinterpret_cast<void*>(addr), done);
      forget();
    }
    return 0;
  }
  stats_.num_device_alloc += maps;
  return done;
}

// The unmapped block of p to grow into for `rounded` bytes and how many bytes to map there;
// within_limit false: also when mapping map_bytes would pass the limit (reclaim by alias).
block* detail::growth_layer::choose_unmapped_locked(const pool& p, std::size_t rounded,
                                                    std::size_t& map_bytes, bool within_limit,
                                                    stream_handle side) const {
  // Bytes to map if we grow into unmapped block u, reusing a free mapped block just before it:
  // what the request lacks, to the granularity (map_chunks_locked cuts it into chunks). A side
  // stream maps all it needs: the free block before u may still be in use by work it is not
  // ordered after.
  auto need = [&](const block* u) -> std::size_t {
    std::size_t have = (side == 0 && u->prev && u->prev->state == block_state::free &&
                        u->prev->mapped)
                           ? u->prev->size
                           : 0;
    return have >= rounded ? 0 : detail::round_up(rounded - have, limits_.small_chunk_bytes);
  };
  // Only the ranges of `side` (0: the pool's own); a pool has a few ranges.
  auto ours = [&](const block* u) { return u->seg->side_stream == side; };
  block* choice = nullptr;
  for (auto it = p.unmapped.lower_bound(detail::block_order::key{rounded, 0});
       it != p.unmapped.end() && !choice; ++it)
    if (ours(*it)) choice = *it;
  for (auto it = p.unmapped.rbegin(); it != p.unmapped.rend(); ++it) {
    if (!ours(*it)) continue;
    block* largest = *it;
    if (largest->size >= need(largest) && (!choice || need(largest) < need(choice)))
      choice = largest;
    break;
  }
  if (!choice) return nullptr;
  map_bytes = need(choice);
  if (map_bytes == 0 || map_bytes > choice->size) return nullptr;
  if (within_limit && !growth_room_locked().fits_limit(map_bytes)) return nullptr;
  return choice;
}

// A new reserved range of p, large enough for `rounded` bytes.
void detail::growth_layer::reserve_range_locked(pool& p, std::size_t rounded, stream_handle side) {
  // The address space a range spans scales with the ranges already reserved: the first ones span
  // the limit (any request fits), then limit * 8 / (ranges + 8), never less than the request,
  // so that n ranges take about 8 * limit * (1 + ln(n / 16)) (63 streams' two pools each: about
  // 25 times the limit, not 126). A failed reservation (the address space, not memory) is tried
  // again at half the size down to the request; then out_of_memory says so.
  const std::size_t gran = p.small ? limits_.small_chunk_bytes : limits_.large_chunk_bytes;
  const std::size_t need = detail::round_up(rounded, gran);
  std::size_t ranges = 0;
  for (const auto& [base, seg] : streams_.segments) ranges += seg->expandable ? 1 : 0;
  const std::size_t scaled = ranges < 8 ? limits_.limit_bytes
                                        : limits_.limit_bytes / (ranges + 8) * 8;
  std::size_t reserve = std::max(need, detail::round_up(scaled, gran));
  void* base = nullptr;
  for (;;) {
    try {
      base = backend_.reserve_address_range(reserve);
      break;
    } catch (const backend_error& e) {
      // Only the address space running out (the driver's out-of-memory error) is tried smaller;
      // any other failure is the backend's to report.
      std::string what = e.what();
      std::transform(what.begin(), what.end(), what.begin(),
                     [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
      if (what.find("out_of_memory") == std::string::npos &&
          what.find("out of memory") == std::string::npos)
        throw;
      if (reserve == need) {
        ++stats_.num_ooms;
        throw out_of_memory("streamsafe: out of memory on device " +
                            std::to_string(backend_.device()) +
                            ": the virtual address space is exhausted (" + std::to_string(ranges) +
                            " expandable ranges reserved; reserving " + std::to_string(need) +
                            " bytes for a " + std::to_string(rounded) + "-byte request on stream " +
                            hex(p.stream) + " failed: " + e.what() + ")");
      }
      detail::log().warn("device {}: reserving {} bytes of address space failed ({}); trying {}",
                         backend_.device(), reserve, e.what(),
                         std::max(need, detail::round_up(reserve / 2, gran)));
      reserve = std::max(need, detail::round_up(reserve / 2, gran));
    }
  }
  segment* seg = add_segment_locked(p, reinterpret_cast<std::uintptr_t>(base), reserve, false)->seg;
  seg->side_stream = side;
  if (!p.expandable && side == 0) p.expandable = seg;
}

// long: one fit: the range chosen, the chunk sizes and the mapping share `choice` and `map_bytes`
block* detail::growth_layer::expandable_fit_locked(pool& p, std::size_t rounded,
                                                   stream_handle side) {
  const std::size_t gran = p.small ? limits_.small_chunk_bytes : limits_.large_chunk_bytes;
  // A pool reserves its first range on its first growth, and another range whenever a request
  // fits in no hole of the ranges it has while the memory under the limit is there: holes left
  // between live blocks never make the pool run out of memory with memory free. The first
  // ranges span the limit, so an empty one serves any request; with many pools they are smaller
  // (reserve_range_locked), and a request larger than a pool's empty range gets one of its own.
  // A side stream joined into the capture of p's graph (side != 0) grows into ranges of its own.
  std::size_t map_bytes = 0;
  bool has_range = p.expandable != nullptr;
  if (side != 0) {
    has_range = false;
    for (const auto& [base, seg] : streams_.segments)
      has_range = has_range || (seg->owner == &p && seg->side_stream == side);
  }
  block* choice = has_range ? choose_unmapped_locked(p, rounded, map_bytes, true, side) : nullptr;
  if (!choice && (!has_range || growth_room_locked().fits_limit(
                                    detail::round_up(rounded, limits_.small_chunk_bytes)))) {
    // The first range, or no hole fits while the memory is there: a fresh range.
    reserve_range_locked(p, rounded, side);
    choice = choose_unmapped_locked(p, rounded, map_bytes, true, side);
  }
  if (!choice) return nullptr;
  // Past the high-water mark of reserved bytes, where the peak is set, large pools map in
  // chunks of expandable_peak_chunk_mb, so that a later growth past the peak can unmap idle
  // memory that finely; memory mapped again below the mark (after empty_cache, a release before
  // a growth or a wake) takes chunks of expandable_chunk_mb, fewer driver calls for the same
  // bytes. The driver's cost is per chunk, not per byte (docs/observability.md). A growth that
  // crosses the mark maps its part below the mark in the larger chunks. Bytes queued for
  // release (defer mode) are on their way back: a step that maps its memory again while the
  // last step's is still queued stays below the mark.
  const std::size_t chunk = p.small ? gran : large_chunk_for_locked(map_bytes);
  std::size_t fine_from = SIZE_MAX;  // one chunk size (the default, and small pools)
  if (!p.small && limits_.peak_chunk_bytes < chunk) {
    const auto reserved = static_cast<std::size_t>(stats_.reserved_bytes.current);
    const std::size_t kept = reserved - std::min(reserved, queued_release_bytes_locked());
    const std::size_t high_water = reserved_high_water_locked();
    const std::size_t below_mark = high_water > kept ? high_water - kept : 0;
    fine_from = below_mark / limits_.small_chunk_bytes * limits_.small_chunk_bytes;
  }
  const std::size_t mapped = map_chunks_locked(choice->seg, choice->addr, map_bytes, chunk,
                                               fine_from,
                                               std::min(limits_.peak_chunk_bytes, chunk));
  if (mapped == 0) return nullptr;
  const bool partial = mapped < map_bytes;  // kept during a capture: free memory, too little
  map_bytes = mapped;
  p.unmapped.erase(choice);
  if (map_bytes < choice->size)
    p.unmapped.insert(split_off_locked(choice, map_bytes));  // the rest stays unmapped
  choice->mapped = true;
  choice->seg->mapped_bytes += map_bytes;
  detail::add_reserved(stats_, choice->seg->small, static_cast<std::int64_t>(map_bytes));
  trace(trace_action::segment_map, choice->addr, map_bytes, p.stream);
  detail::log().debug("device {}: segment_map {} bytes at {} (stream {})", backend_.device(),
                      map_bytes, hex(choice->addr), hex(p.stream));
  if (side != 0 && !partial) {
    // The side stream takes the memory just mapped, not merged with a free block before it
    // (which it may not be ordered after): finish_allocation makes it active at once.
    choice->state = block_state::free;
    p.mapped.insert(choice);
    return choice;
  }
  free_block_locked(choice);  // merges with the free mapped block before it
  return partial ? nullptr : best_fit(p, rounded);
}

// b, a run of whole chunks (free or queued), keeps the chunks that cover its first `bytes`; the
// rest is split off and returned (null: none). b's owner lock held (it guards seg->chunks).
block* detail::growth_layer::cut_chunks_locked(block* b, std::size_t bytes) {
  const segment* seg = b->seg;
  std::uintptr_t cut = b->addr;
  for (auto it = seg->chunks.lower_bound(b->addr); cut - b->addr < bytes && it != seg->chunks.end();
       ++it)
    cut = it->first + it->second;
  return cut < b->addr + b->size ? split_off_locked(b, cut - b->addr) : nullptr;
}

// whole_rule: not a segment the whole-segment rule keeps whole for the request. Whole cudaMalloc
// segments only (expandable ones are passed by: the expandable backend finds none).
block* detail::growth_layer::steal_segment_locked(pool& p, std::size_t rounded, bool whole_rule) {
  if (capturing() || opts_.release_fence == fence_scope::device) return nullptr;
  // The other stream's lock is dropped between the search and the move, and that stream's fast
  // path (its lock alone, no mu_) may meanwhile allocate from the chosen segment: the move
  // re-checks, under that lock, that the segment is still one whole free block, and otherwise
  // searches again (a retry follows another thread's allocation from that segment).
  auto whole_free = [&](segment* seg) {
    if (seg->owner->quick.count) flush_quick_locked(*seg->owner);
    const block* f = seg->first;
    return !f->next && f->state == block_state::free && f->size >= rounded &&
           !(whole_rule && keeps_whole(f, rounded));
  };
  segment* best = nullptr;
  std::unique_lock<stream_lock> olk;
  while (!best) {
    for (auto& [base, seg] : streams_.segments) {
      if (seg->expandable || seg->owner == &p || seg->small != p.small || seg->owner->tag != p.tag)
        continue;
      stream_state& other = state_of(*seg->owner);
      if (other.graph != 0 && !other.graph_released) continue;  // a graph's private pool
      detail::lock_guard<stream_lock> lk(other.mu);
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
  return move_segment_locked(best, p);
}

// Moves a whole free segment to p; p's stream waits for every stream that may still touch it.
block* detail::growth_layer::move_segment_locked(segment* best, pool& p) {
  // The new stream waits, on the device, for every stream that may still touch the segment.
  for (stream_handle s : fence_streams_locked(best)) {
    if (s == p.stream) continue;
    order_after_locked(p.stream, s);
  }
  for (auto& t : streams_.tombstones) {
    stream_wait_on(p.stream, t.event);
    ++stats_.stream_waits;
  }
  best->owner->mapped.erase(best->first);
  best->first->idle_fence = 0;  // its idle proof is its old pool's
  --state_of(*best->owner).segments;
  ++state_of(p).segments;
  best->owner = &p;
  best->stream = p.stream;
  best->used_streams.clear();
  p.mapped.insert(best->first);
  ++stats_.segments_moved;
  detail::log().debug(
      "device {}: moved free segment {} ({} bytes) to stream {} behind an event wait",
      backend_.device(), hex(best->base), best->size, hex(p.stream));
  return best->first;
}

// A destroyed stream's whole free segment for p, behind the tombstone (before growing).
block* caching_allocator::impl::adopt_dead_segment_locked(pool& p, std::size_t rounded) {
  // Before growing: a whole free segment of a destroyed stream, behind the tombstone (one
  // stream wait, none once the tombstone is seen complete). The search follows the destroyed
  // streams still holding memory, not the segments.
  if (streams_.dead.empty() || capturing() || opts_.release_fence == fence_scope::device)
    return nullptr;
  if (state_of(p).graph != 0 || p.tag != 0) return nullptr;  // a tag's memory stays its own
  retire_dead_streams_locked();
  segment* best = nullptr;
  std::unique_lock<stream_lock> olk;
  for (auto it = streams_.dead.rbegin(); it != streams_.dead.rend(); ++it) {  // the newest first
    stream_state* st = *it;
    std::unique_lock<stream_lock> lk(st->mu);
    pool& q = pool_of(*st, p.small);
    if (q.expandable) continue;
    if (q.quick.count) flush_quick_locked(q);
    segment* found = nullptr;
    q.mapped.for_each([&](block* b) {
      if (!b->prev && !b->next && b->size >= rounded && (!found || b->size < found->size))
        found = b->seg;
    });
    if (found && (!best || found->size < best->size)) {
      best = found;
      olk = std::move(lk);
      if (best->size == detail::segment_bytes_for(rounded)) break;
    }
  }
  if (!best) return nullptr;
  block* b = move_segment_locked(best, p);
  olk.unlock();
  if (streams_.tombstones.empty())
    retire_dead_streams_locked();  // the former owner may own nothing now
  return b;
}

}  // namespace streamsafe
