// streamsafe core: what a release gives back and which streams its fence covers. Whole free
// cuda_malloc segments, and the whole free chunks inside free blocks of expandable segments,
// are detached (state releasing) into a release_batch; the fence's streams follow the fence
// scope. release.cpp has the rules of a release; empty_cache.cpp calls these. Every function
// here runs with the device lock (mu_) held.
#include "core/release/release_collect.hpp"

#include <algorithm>

namespace streamsafe {

std::vector<stream_handle> detail::release_collect_layer::fence_streams_locked(
    const segment* seg) const {
  std::vector<stream_handle> out;
  auto alive =
      [&](stream_handle s) STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {  // under mu_, as its caller
        auto it = streams_.states.find(s);
        return it != streams_.states.end() && it->second->alive.load(std::memory_order_acquire);
      };
  switch (opts_.release_fence) {
    case fence_scope::allocation_stream:
      if (alive(seg->stream)) out.push_back(seg->stream);
      break;
    case fence_scope::used_streams:
      if (alive(seg->stream)) out.push_back(seg->stream);
      for (stream_handle s : seg->used_streams) {
        if (alive(s)) out.push_back(s);
      }
      break;
    case fence_scope::all_streams:
      for (auto& [s, state] : streams_.states) {
        if (state->graph == 0 && state->alive.load(std::memory_order_acquire)) out.push_back(s);
      }
      break;
    case fence_scope::device: break;
  }
  // A resume's restore copies (wake.cpp) run on the internal copy stream; the segment's stream is
  // ordered after them only while it is alive, so the fence covers the copy stream itself.
  if (sleep_.has_copy_stream && opts_.release_fence != fence_scope::device)
    out.push_back(sleep_.copy_stream);
  return out;
}

void detail::release_collect_layer::add_fence_streams_locked(release_batch& batch,
                                                             const segment* seg) const {
  for (stream_handle s : fence_streams_locked(seg)) {
    if (std::find(batch.streams.begin(), batch.streams.end(), s) == batch.streams.end())
      batch.streams.push_back(s);
  }
}

void detail::release_collect_layer::detach_whole_segment_locked(release_batch& batch,
                                                                segment* seg) {
  block* f = seg->first;
  seg->owner->mapped.erase(f);
  f->state = block_state::releasing;
  batch.blocks.push_back(f);
  batch.bytes += f->size;
  add_fence_streams_locked(batch, seg);
}

// The whole chunks of seg's free mapped blocks but `keep`, detached into batch; true if any.
bool detail::release_collect_layer::detach_free_chunks_locked(release_batch& batch, segment* seg,
                                                              const block* keep) {
  // The whole chunks inside each free mapped block of an expandable segment (but `keep`) become
  // blocks of state releasing in `batch`; the pieces around them stay free.
  bool took = false;
  for (block* b = seg->first; b; b = b->next) {
    if (b->state != block_state::free || !b->mapped || b == keep) continue;
    std::uintptr_t lo = 0;
    std::uintptr_t hi = 0;
    if (!whole_chunks_of(seg, b, lo, hi)) continue;
    seg->owner->mapped.erase(b);
    block* mid = b;
    if (lo > b->addr) {
      mid = split_off_locked(b, lo - b->addr);
      seg->owner->mapped.insert(b);
    }
    if (hi < mid->addr + mid->size)
      seg->owner->mapped.insert(split_off_locked(mid, hi - mid->addr));
    mid->state = block_state::releasing;
    batch.blocks.push_back(mid);
    batch.bytes += mid->size;
    took = true;
    b = mid;
  }
  return took;
}

// The chunks wholly inside mapped block b of expandable seg: [lo, hi); false if none.
bool detail::release_collect_layer::whole_chunks_of(const segment* seg, const block* b,
                                                    std::uintptr_t& lo, std::uintptr_t& hi) {
  // The chunks of a mapped block lie back to back; those wholly inside it form [lo, hi).
  const auto& chunks = seg->chunks;
  const std::uintptr_t end = b->addr + b->size;
  auto first = chunks.lower_bound(b->addr);
  if (first == chunks.end() || first->first >= end) return false;
  auto last = std::prev(chunks.lower_bound(end));  // the chunk holding the block's last byte
  lo = first->first;
  hi = last->first + last->second <= end ? last->first + last->second : last->first;
  return hi > lo;
}

// Forgets seg's chunks in [addr, addr + bytes) after their unmap; returns how many.
std::size_t detail::release_collect_layer::forget_chunks(segment* seg, std::uintptr_t addr,
                                                         std::size_t bytes) {
  const auto from = seg->chunks.lower_bound(addr);
  const auto to = seg->chunks.lower_bound(addr + bytes);
  const auto n = static_cast<std::size_t>(std::distance(from, to));
  seg->chunks.erase(from, to);
  return n;
}

// True when [addr, addr + bytes) is a union of whole mapped chunks of seg.
bool detail::release_collect_layer::whole_chunk_run(const segment* seg, std::uintptr_t addr,
                                                    std::size_t bytes) {
  const auto first = seg->chunks.find(addr);
  const auto end = seg->chunks.lower_bound(addr + bytes);
  if (first == seg->chunks.end() || end == first) return false;
  const auto last = std::prev(end);
  return last->first + last->second == addr + bytes;
}

// Free memory that can go back: everything, only released graphs' pools, or only one tag's.
detail::release_batch detail::release_collect_layer::collect_releasable_locked(
    bool released_graphs_only, const tag_id* only_tag) {
  release_batch batch;
  for (auto& [base, seg] : streams_.segments)
    collect_segment_locked(batch, seg, released_graphs_only, only_tag);
  return batch;
}

void detail::release_collect_layer::collect_segment_locked(release_batch& batch, segment* seg,
                                                           bool released_graphs_only,
                                                           const tag_id* only_tag) {
  stream_state& owner = state_of(*seg->owner);
  if (owner.graph != 0 && !owner.graph_released) return;  // a graph that may still replay
  if (released_graphs_only && owner.graph == 0) return;
  if (seg->paused) return;  // sleep.cpp: pause and resume own its mapping
  if (only_tag && seg->owner->tag != *only_tag) return;
  detail::lock_guard<stream_lock> slk(owner.mu);
  if (!seg->expandable) {
    if (!seg->first->next && seg->first->state == block_state::free)
      detach_whole_segment_locked(batch, seg);
    return;
  }
  if (detach_free_chunks_locked(batch, seg, nullptr)) add_fence_streams_locked(batch, seg);
}

}  // namespace streamsafe
