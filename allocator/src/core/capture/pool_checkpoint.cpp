// streamsafe core: checkpoint and restore of a CUDA graph's private pool
// (core/pool_checkpoint.hpp), for PyTorch's cudagraph trees, which restore a pool's layout when
// they switch paths.
//
// checkpoint_graph_pool reads the pool's segments under mu_ and the pool's stream lock: each
// block allocated (active, and not freed by a held or exported free), the other blocks merged
// into runs not allocated. restore_graph_pool, under the same locks, in three steps:
//  1. checks everything that could refuse before changing anything: no capture underway (a
//     free with events, an event query and a stream wait all break one), the graph's pool not
//     released, each segment of the checkpoint still the pool's with its size and pool, its
//     blocks tiling it, no active block of the pool held (capture or IPC), and the memory of
//     each allocated block of the checkpoint mapped, not paused or being released, and pending
//     only behind recorded events;
//  2. frees every active block of the pool by the ordinary free (free_found_locked): a block
//     with uses on other streams goes pending behind their events, as after deallocate; then
//     the quick caches are merged back and the completed pending blocks retired;
//  3. carves each allocated block of the checkpoint out of the free memory at its address.
//     Memory still pending other streams' work is taken as take_pending_locked takes it: the
//     pool's stream waits on the events (on the device; the host does not block) and those
//     streams become uses of the new block, so that its next free fences them again.
// The pool's memory serves only its graphs and the routes into it (capture.cpp), so nothing
// else can take the blocks freed in step 2 before step 3 runs: every step holds mu_.
#include "core/allocator_impl.hpp"
#include "core/common/format.hpp"
#include "core/common/logging.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace streamsafe {

using detail::hex;

namespace {

std::string where(std::uint64_t graph, int device) {
  return "streamsafe: restore_graph_pool(graph " + std::to_string(graph) + ") on device " +
         std::to_string(device) + ": ";
}

bool overlaps(const block* b, std::uintptr_t lo, std::uintptr_t hi) {
  return b->addr < hi && lo < b->addr + b->size;
}

// Stream s is known and not destroyed (the registry is the device lock's).
bool alive(const detail::stream_registry& streams, stream_handle s) {
  auto it = streams.states.find(s);
  return it != streams.states.end() && it->second->alive.load(std::memory_order_acquire);
}

}  // namespace

caching_allocator::impl::stream_state& caching_allocator::impl::checkpoint_pool_locked(
    std::uint64_t graph, const char* what) {
  auto rec = capture_.graphs.find(graph);
  stream_state* st = rec == capture_.graphs.end() ? nullptr : graph_state_locked(rec->second.pool);
  if (!st || st->graph_released) {
    throw std::invalid_argument(
        std::string("streamsafe: ") + what + "(graph " + std::to_string(graph) + ") on device " +
        std::to_string(backend_.device()) + ": no such graph, or its private pool was released");
  }
  return *st;
}

// Step 1 for one segment of the checkpoint (mu_ and st's lock held).
void caching_allocator::impl::check_restorable_locked(const stream_state& st,
                                                      const pool_checkpoint& c,
                                                      const pool_checkpoint_segment& cs) const {
  const std::string at = where(c.graph, backend_.device()) + "the checkpoint's segment at " +
                         hex(cs.address) + " (" + std::to_string(cs.size_bytes) + " bytes)";
  auto it = streams_.segments.find(cs.address);
  if (it == streams_.segments.end() || &state_of(*it->second->owner) != &st ||
      it->second->size != cs.size_bytes || it->second->small != cs.small) {
    throw std::logic_error(at +
                           " is no longer a segment of the graph's pool (released by "
                           "empty_cache or the out-of-memory path since the checkpoint, or "
                           "the checkpoint is of another pool)");
  }
  const segment* seg = it->second;
  if (seg->paused) throw std::logic_error(at + " is paused (pause of its tag)");
  std::uintptr_t next = cs.address;
  for (const pool_checkpoint_block& cb : cs.blocks) {
    if (cb.address != next || cb.size_bytes == 0 || cb.size_bytes % 512 != 0) {
      throw std::logic_error(at + ": its blocks do not tile it (at " + hex(cb.address) + ")");
    }
    next += cb.size_bytes;
    if (!cb.allocated) continue;
    const std::uintptr_t hi = cb.address + cb.size_bytes;
    for (const block* b = seg->first; b; b = b->next) {
      if (!overlaps(b, cb.address, hi)) continue;
      const char* why = nullptr;
      if (!b->mapped) why = "is unmapped";
      else if (b->state == block_state::releasing) why = "is being released";
      else if (b->state == block_state::pending_free && b->events.empty())
        why = "is pending other streams' work whose events are not recorded yet";
      else if (b->state == block_state::pending_free && !alive(streams_, seg->owner->stream))
        why =
            "is pending other streams' work, and the pool's stream, which would wait on it, is "
            "destroyed";
      if (why) {
        throw std::logic_error(at + ": the memory of its allocated block at " + hex(cb.address) +
                               " (" + std::to_string(cb.size_bytes) + " bytes) " + why);
      }
    }
  }
  if (next != cs.address + cs.size_bytes)
    throw std::logic_error(at + ": its blocks do not tile it (they end at " + hex(next) + ")");
}

// Step 3 for one allocated block of the checkpoint (mu_ and st's lock held; checked by step 1).
void* caching_allocator::impl::restore_block_locked(stream_state& st, segment* seg,
                                                    const pool_checkpoint_block& cb) {
  pool& p = *seg->owner;
  const std::uintptr_t lo = cb.address, hi = cb.address + cb.size_bytes;
  std::vector<stream_handle> carried;
  for (block* b = seg->first; b;) {
    block* next = b->next;  // retire_pending_locked may merge b with its neighbours
    if (overlaps(b, lo, hi) && b->state == block_state::pending_free) {
      for (const auto& e : b->events) {
        stream_wait_on(p.stream, e.event);
        ++st.stats.stream_waits;
        if (e.stream != detail::k_tombstone_stream && e.stream != seg->stream &&
            std::find(carried.begin(), carried.end(), e.stream) == carried.end())
          carried.push_back(e.stream);
      }
      retire_pending_locked(st, b);
      next = seg->first;  // merges changed the list: walk it again
    }
    b = next;
  }
  block* b = seg->first;
  while (b && b->addr + b->size <= lo) b = b->next;
  if (!b || b->state != block_state::free || !b->mapped || b->addr + b->size < hi) {
    throw std::logic_error(where(state_of(p).graph, backend_.device()) + "the memory at " +
                           hex(lo) + " is not free after the pool's blocks were freed");
  }
  p.mapped.erase(b);
  if (b->addr < lo) {
    block* lower = b;
    b = split_off_locked(lower, lo - lower->addr);
    p.mapped.insert(lower);
  }
  if (b->size > cb.size_bytes) p.mapped.insert(split_off_locked(b, cb.size_bytes));
  b->idle_fence = 0;
  b->state = block_state::active;
  b->uses = std::move(carried);
  st.active.insert(b);
  b->requested = cb.requested_bytes != 0 ? cb.requested_bytes : cb.size_bytes;
  count_allocation_locked(st, b);
  trace(trace_action::alloc, b->addr, b->requested, st.handle);
  return reinterpret_cast<void*>(b->addr);
}

// ---- public interface ---------------------------------------------------------------------------

pool_checkpoint caching_allocator::checkpoint_graph_pool(std::uint64_t graph) const {
  impl& m = *impl_;
  detail::lock_guard<detail::mutex> dlk(m.mu_);
  impl::stream_state& st = m.checkpoint_pool_locked(graph, "checkpoint_graph_pool");
  detail::lock_guard<stream_lock> slk(st.mu);
  pool_checkpoint c;
  c.device = m.backend_.device();
  c.graph = graph;
  for (const auto& [base, seg] : m.streams_.segments) {
    if (&state_of(*seg->owner) != &st) continue;
    pool_checkpoint_segment cs;
    cs.address = seg->base;
    cs.size_bytes = seg->size;
    cs.small = seg->small;
    cs.expandable = seg->expandable;
    for (const block* b = seg->first; b; b = b->next) {
      const bool allocated = b->state == block_state::active && !b->free_held && !b->ipc_held;
      if (!allocated && !cs.blocks.empty() && !cs.blocks.back().allocated) {
        cs.blocks.back().size_bytes += b->size;  // runs not allocated are one block
        continue;
      }
      cs.blocks.push_back({b->addr, b->size, allocated ? b->requested : 0, allocated});
    }
    c.segments.push_back(std::move(cs));
  }
  return c;
}

pool_restore caching_allocator::restore_graph_pool(const pool_checkpoint& c) {
  impl& m = *impl_;
  if (m.inherited()) m.throw_inherited("restore_graph_pool");
  device_lock dlk(m.mu_);
  if (m.capturing()) {
    throw std::logic_error(where(c.graph, m.backend_.device()) +
                           "a CUDA graph capture is underway on the device (a restore frees, "
                           "queries events and orders streams, which would break it)");
  }
  if (c.device != m.backend_.device()) {
    throw std::invalid_argument(where(c.graph, m.backend_.device()) +
                                "the checkpoint is of device " + std::to_string(c.device));
  }
  impl::stream_state& st = m.checkpoint_pool_locked(c.graph, "restore_graph_pool");
  detail::lock_guard<stream_lock> slk(st.mu);
  // Step 1: everything that refuses, before anything changes.
  for (const pool_checkpoint_segment& cs : c.segments) m.check_restorable_locked(st, c, cs);
  std::vector<block*> live;
  st.active.for_each([&](const block* b) {
    if (b->state == block_state::active) live.push_back(const_cast<block*>(b));
  });
  for (const block* b : live) {
    if (b->free_held || b->ipc_held || b->ipc_exports != 0) {
      throw std::logic_error(where(c.graph, m.backend_.device()) + "the pool's block at " +
                             hex(b->addr) +
                             (b->free_held ? " was freed during a capture (a held free)"
                                           : " is exported to another process (CUDA IPC)") +
                             ": it cannot be freed now");
    }
  }
  // Step 2: the pool's live blocks are freed, in address order.
  std::sort(live.begin(), live.end(),
            [](const block* a, const block* b) { return a->addr < b->addr; });
  pool_restore out;
  out.freed.reserve(live.size());
  for (block* b : live) {
    out.freed.push_back(reinterpret_cast<void*>(b->addr));
    m.free_found_locked(st, b, nullptr);
  }
  m.flush_quick_locked(st.small_pool);
  m.flush_quick_locked(st.large_pool);
  if (!st.pending.empty()) m.process_events_locked(st);
  // Step 3: the checkpoint's allocated blocks, at their addresses.
  for (const pool_checkpoint_segment& cs : c.segments) {
    segment* seg = m.streams_.segments.at(cs.address);
    for (const pool_checkpoint_block& cb : cs.blocks)
      if (cb.allocated) out.allocated.push_back(m.restore_block_locked(st, seg, cb));
  }
  detail::log().debug("device {}: graph {}'s pool restored: {} block(s) freed, {} allocated",
                      m.backend_.device(), c.graph, out.freed.size(), out.allocated.size());
  return out;
}

}  // namespace streamsafe
