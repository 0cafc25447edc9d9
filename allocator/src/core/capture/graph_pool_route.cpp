// streamsafe core: allocation into a CUDA graph's private pool outside a capture
// (caching_allocator::begin_allocate_to_graph_pool), what PyTorch's beginAllocateToPool with a
// filter does outside CUDAGraph::capture_begin: torch.compile's cudagraph trees run warm-up and
// eager code between captures into the graph's pool, so that its checkpoint holds that memory.
//
// capture_.routes lists the open routes, innermost last; routes_open_ mirrors its size so that
// allocate tests for a route without mu_. An allocation on stream s goes, in this order, to
//  1. the pool of a capture underway on s (capture.cpp: a capture is served by its own graph);
//  2. the pool of the innermost route whose filter takes s:
//     * outside a capture, the pool's cached blocks, behind one device-side wait of s on the
//       pool's stream (the capturing stream, whose stream order holds the blocks' last uses;
//       uses on other streams keep a block pending until their events complete), else new memory;
//     * during a capture (of any stream) new memory only: no event may be recorded then;
//     * s becomes a use of the block (not of the pool's stream): its free waits for s's work;
//  3. otherwise the ordinary path (or, during a capture, the capture rules for other streams).
// Routed blocks are the pool's: its checkpoint, statistics (the pool's stream_state) and
// snapshot segments count them, frees return them to it, restore_graph_pool frees them.
// An open route counts in the pool's pool_graphs like a graph sharing it: the pool is retired
// (its memory releasable) when the last of its graphs and routes lets go.
// Locks: mu_ (the routes, the registry), then the pool's stream lock for its blocks. The
// filters run under mu_.
#include "core/allocator_impl.hpp"
#include "core/blocks/size_classes.hpp"
#include "core/common/format.hpp"
#include "core/growth/growth_hook.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace streamsafe {

const detail::pool_route* caching_allocator::impl::route_of_locked(stream_handle stream) const {
  for (auto it = capture_.routes.rbegin(); it != capture_.routes.rend(); ++it) {
    if (it->filter(stream)) return &*it;
  }
  return nullptr;
}

void* caching_allocator::impl::allocate_in_route_locked(device_lock& dlk, std::size_t size,
                                                        std::size_t rounded, bool small,
                                                        stream_handle key,
                                                        std::uint64_t pool_graph) {
  stream_state& g = *graph_state_locked(pool_graph);
  const bool capture = capturing();
  // The pool's stream holds its cached blocks' last uses in stream order; a destroyed one's
  // work is not waited on by name: new memory then.
  auto pool_stream = streams_.states.find(g.handle);
  const bool reuse = !capture && (g.handle == key ||
                                  (pool_stream != streams_.states.end() &&
                                   pool_stream->second->alive.load(std::memory_order_acquire)));
  if (reuse && g.handle != key) order_after_locked(key, g.handle);
  detail::unique_lock<stream_lock> slk(g.mu);
  pool& p = pool_of(g, small);
  block* b = nullptr;
  if (reuse) {
    if (!g.pending.empty()) process_events_locked(g);
    b = take_cached_fit_locked(p, rounded);
  }
  auto grow = [&]() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
    return growth_hook_->new_memory_locked(*this, p, rounded, 0);
  };
  if (!b) b = grow();
  if (!b && !capture) {
    // A growth under the limit after what must go back went (the serve path's last steps,
    // growth_policy.cpp): the other pools' idle cache, never a host wait but the bounded one.
    slk.unlock();
    const bool room = make_room_locked(dlk, detail::segment_bytes_for(rounded));
    slk.lock();
    if (room && !capturing()) b = grow();
  }
  if (!b) {
    throw_out_of_memory_locked(dlk, &slk, size, rounded, key, &g,
                               (capture ? capture_note_locked() : std::string()) +
                                   "; the allocation is routed into the private pool of graph " +
                                   std::to_string(pool_graph) +
                                   ", which grows with new device memory only");
  }
  void* ptr = finish_allocation(g, b, rounded, size);
  if (key != g.handle) add_use_locked(b, key);
  return ptr;
}

void* caching_allocator::impl::allocate_routed(std::size_t size, std::size_t rounded, bool small,
                                               stream_handle stream, tag_id tag) {
  const stream_handle key = key_of(stream);
  device_lock dlk(mu_);
  detect_captures_locked(dlk);
  if (capture_.find(key))
    return allocate_during_capture_locked(dlk, size, rounded, small, key, tag);
  if (const detail::pool_route* r = route_of_locked(stream)) {
    get_or_create_stream_locked(key);  // known: its events fence the block's free
    return allocate_in_route_locked(dlk, size, rounded, small, key, r->pool);
  }
  if (capturing()) return allocate_during_capture_locked(dlk, size, rounded, small, key, tag);
  return nullptr;
}

std::uint64_t caching_allocator::begin_allocate_to_graph_pool(std::uint64_t graph,
                                                              stream_filter filter) {
  impl& m = *impl_;
  if (m.inherited()) m.throw_inherited("begin_allocate_to_graph_pool");
  const auto fail = [&](const char* why) {
    throw std::invalid_argument("streamsafe: begin_allocate_to_graph_pool(graph " +
                                std::to_string(graph) + ") on device " +
                                std::to_string(m.backend_.device()) + ": " + why);
  };
  if (!filter) fail("the filter is empty");
  device_lock lk(m.mu_);
  auto rec = m.capture_.graphs.find(graph);
  impl::stream_state* g = rec == m.capture_.graphs.end() ? nullptr
                                                         : m.graph_state_locked(rec->second.pool);
  if (!g || g->graph_released)
    fail("no such graph, or its private pool was released (every graph of the pool released)");
  {
    detail::lock_guard<stream_lock> glk(g->mu);
    ++g->pool_graphs;  // the route uses the pool
  }
  const std::uint64_t id = m.capture_.next_route_id++;
  m.capture_.routes.push_back({id, rec->second.pool, std::move(filter)});
  m.routes_open_.store(static_cast<int>(m.capture_.routes.size()), std::memory_order_release);
  return id;
}

void caching_allocator::end_allocate_to_graph_pool(std::uint64_t route) {
  impl& m = *impl_;
  if (m.inherited()) return;  // a forked child: the parent's routes are not its own
  device_lock lk(m.mu_);
  auto it = std::find_if(m.capture_.routes.begin(), m.capture_.routes.end(),
                         [&](const detail::pool_route& r) { return r.id == route; });
  if (it == m.capture_.routes.end()) {
    throw std::invalid_argument("streamsafe: end_allocate_to_graph_pool(route " +
                                std::to_string(route) + ") on device " +
                                std::to_string(m.backend_.device()) +
                                ": no such route open (ids come from "
                                "begin_allocate_to_graph_pool; each ends once)");
  }
  impl::stream_state& g = *m.graph_state_locked(it->pool);
  m.capture_.routes.erase(it);
  m.routes_open_.store(static_cast<int>(m.capture_.routes.size()), std::memory_order_release);
  const std::vector<stream_handle> every = m.every_stream_locked();
  detail::lock_guard<stream_lock> glk(g.mu);
  if (--g.pool_graphs == 0) m.retire_pool_locked(g, every);
}

}  // namespace streamsafe
