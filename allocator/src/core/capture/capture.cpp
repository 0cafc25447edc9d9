// streamsafe core: the caching allocator during CUDA graph capture (case K11).
//
// While a stream of the device captures (global capture mode), CUDA forbids, from any thread,
// the calls that may synchronise: releasing memory (cudaFree, cuMemUnmap), synchronising, and
// querying events; a capturing stream may not wait on an event recorded outside its capture.
// A captured graph also replays later, any number of times, so memory its kernels touch must
// not serve anyone else while it may replay. The rules kept here:
//  * capture_.captures lists the captures underway: announced (notify_capture_begin) or
//    detected on a slow path (backend_.stream_is_capturing of each known stream);
//    captures_underway_ mirrors its size so that the fast paths test it without the device lock.
//    A stream first seen by an allocation during another capture is asked there too.
//  * While any capture is underway: no fence, no release, no event query, no stream wait (the
//    pending lists, the deferred queue and empty_cache wait; an empty_cache asked for runs in
//    defer mode when the last capture ends); allocations are served only from memory that is
//    safe without a query: for a capturing stream its graph's private pool (blocks freed
//    earlier in the same capture, whose old uses precede the new ones in capture order, and
//    new segments or chunks, the one backend call allowed), for other streams their own free
//    blocks and new segments; otherwise out_of_memory.
//  * A side stream that joined a capture (it waited on an event recorded in it; the backend's
//    capture_id names the same capture) is that capture's too (join_capture_locked): its
//    allocations come from the graph's private pool, new memory only (a block the capturing
//    stream freed in the capture may still be used by work the side stream is not ordered
//    after), with the side stream as a use; its record ends with the capture. Its growth is a
//    segment of its own in the pool (a cudaMalloc segment, or an expandable range reserved for
//    it: segment::side_stream), as PyTorch keeps one segment per pool and stream.
//  * A graph's private pool is a stream_state keyed graph_key(id), whose handle is the
//    capturing stream. Blocks allocated in it return to it when freed, also after the capture,
//    and nobody else allocates from it; its segments are released (behind the usual fence, on
//    every stream) only after notify_graph_released(id). Allocations under a tag (tag_scope)
//    come from the pool's tagged pools: pause(tag) gives them back behind a fence on every
//    stream (the graph may replay anywhere) and resume maps them at the same addresses, so the
//    graph replays again without a new capture.
//  * Frees during a capture that would need events (uses on other streams), and frees of
//    memory from before the capture that the capture may touch (its stream or a recorded use is
//    capturing), are held (block::free_held, capture_.held_frees): the first kind completes when no
//    capture is underway, the second when its graph is released, behind events on every stream
//    (the graph may have replayed anywhere). A held free of the first kind in the capture's own
//    pool whose other uses are all streams of that capture records where each stood
//    (backend_.capture_position); once the capturing stream follows all of them inside the
//    capture (the side streams joined back by an event wait: backend_.capture_follows), the
//    block is free for it again, as a free on its own stream (reclaim_joined_frees_locked), unless
//    graph_capture_record_stream_reuse is off (then it completes when the capture ends).
// Every function here runs with the device lock (mu_) held.
#include "core/allocator_impl.hpp"
#include "core/common/logging.hpp"
#include "core/growth/growth_hook.hpp"
#include "core/streams/per_thread_stream.hpp"

#include <algorithm>
#include <string>

namespace streamsafe {

namespace {

std::string stream_name(stream_handle s) { return "stream " + std::to_string(s); }

}  // namespace

caching_allocator::impl::stream_state* caching_allocator::impl::graph_state_locked(
    std::uint64_t graph) {
  auto it = streams_.states.find(detail::graph_key(graph));
  return it == streams_.states.end() ? nullptr : it->second.get();
}

// share_pool_of: 0, or a graph whose private pool the capture allocates into (shared pools).
std::uint64_t caching_allocator::impl::begin_capture_locked(stream_handle stream, bool detected,
                                                            std::uint64_t share_pool_of) {
  if (stream == 0) {
    throw std::invalid_argument("streamsafe: notify_capture_begin(stream 0) on device " +
                                std::to_string(backend_.device()) +
                                ": the legacy default stream cannot capture a CUDA graph");
  }
  if (const detail::capture_record* c = capture_.find(stream)) {
    throw std::invalid_argument("streamsafe: notify_capture_begin(" + stream_name(stream) +
                                ") on device " + std::to_string(backend_.device()) +
                                ": the stream is already capturing (graph " +
                                std::to_string(c->graph) + "); call notify_capture_end first");
  }
  std::uint64_t pool_graph = 0;
  if (share_pool_of != 0) {
    auto it = capture_.graphs.find(share_pool_of);
    if (it == capture_.graphs.end() || graph_state_locked(it->second.pool)->graph_released) {
      throw std::invalid_argument(
          "streamsafe: notify_capture_begin(" + stream_name(stream) + ", share the pool of graph " +
          std::to_string(share_pool_of) + ") on device " + std::to_string(backend_.device()) +
          ": no such graph, or every graph of its pool was released (a pool is shared "
          "only while one of its graphs is not released)");
    }
    pool_graph = it->second.pool;
  }
  get_or_create_stream_locked(
      stream);  // the capturing stream is known, for fences (before the capture counts)
  const std::uint64_t graph = capture_.next_graph_id++;
  if (pool_graph == 0) {
    pool_graph = graph;
    stream_state& g = new_state_locked(detail::graph_key(graph), stream);
    g.graph = graph;
  }
  ++graph_state_locked(pool_graph)->pool_graphs;
  capture_.graphs[graph] = detail::graph_record{pool_graph, false};
  capture_.captures.push_back(
      {stream, graph, pool_graph, detected, false, backend_.capture_id(stream)});
  captures_underway_.store(static_cast<int>(capture_.captures.size()), std::memory_order_release);
  // A fast path that read "no capture" may be inside an event query: wait for it (it holds
  // its stream's lock); every later one sees the capture.
  for (auto& [key, st] : streams_.states) {
    detail::lock_guard<stream_lock> barrier(st->mu);
  }
  detail::log().debug(
      "device {}: CUDA graph capture {} on stream {:#x} ({}); {} capture(s) underway",
      backend_.device(), graph, stream, detected ? "detected" : "announced",
      capture_.captures.size());
  return graph;
}

std::uint64_t caching_allocator::impl::end_capture_locked(device_lock& lk, stream_handle stream) {
  auto it = std::find_if(capture_.captures.begin(), capture_.captures.end(),
                         [&](const detail::capture_record& c) { return c.stream == stream; });
  if (it == capture_.captures.end()) {
    throw std::invalid_argument(
        "streamsafe: notify_capture_end(" + stream_name(stream) + ") on device " +
        std::to_string(backend_.device()) +
        ": no capture is underway on this stream (never announced, or detected and "
        "already seen ending)");
  }
  const std::uint64_t graph = it->graph;
  const bool joined = it->joined;
  capture_.captures.erase(it);
  if (!joined) {  // the capture ends for the side streams that joined it too
    capture_.captures.erase(std::remove_if(capture_.captures.begin(), capture_.captures.end(),
                                           [&](const detail::capture_record& c) {
                                             return c.joined && c.graph == graph;
                                           }),
                            capture_.captures.end());
  }
  captures_underway_.store(static_cast<int>(capture_.captures.size()), std::memory_order_release);
  detail::log().debug(
      "device {}: CUDA graph capture {} on stream {:#x} ended; its private pool is kept until "
      "notify_graph_released({})",
      backend_.device(), graph, stream, graph);
  if (capture_.captures.empty()) after_captures_locked(lk);
  return graph;
}

// Asks the backend about each known stream.
void caching_allocator::impl::detect_captures_locked(device_lock& lk) {
  std::vector<stream_handle> began, ended;
  for (auto& [key, st] : streams_.states) {
    if (st->graph != 0 || st->handle == 0 || !st->alive.load(std::memory_order_acquire)) continue;
    const bool now = stream_capturing(st->handle);
    const detail::capture_record* c = capture_.find(st->handle);
    if (now && !c) began.push_back(st->handle);
    if (!now && c && c->detected) ended.push_back(st->handle);
  }
  for (stream_handle s : began) {
    if (join_capture_locked(s)) continue;  // a side stream of a capture underway
    const std::uint64_t graph = begin_capture_locked(s, true);
    detail::log().info(
        "device {}: stream {:#x} is capturing a CUDA graph that was not announced: its memory is "
        "kept "
        "for graph {} until notify_graph_released({})",
        backend_.device(), s, graph, graph);
  }
  for (stream_handle s : ended) end_capture_locked(lk, s);
}

// The capture underway on `stream`: its own, or, for a stream that joined a capture underway
// (it waited on an event recorded in the capture: backend_.capture_id names the same capture),
// a record of it joined to that capture's graph and pool. Null when the stream is not capturing.
const detail::capture_record* caching_allocator::impl::join_capture_locked(stream_handle stream) {
  if (const detail::capture_record* c = capture_.find(stream)) return c;
  if (capture_.captures.empty() || stream == 0 || detail::is_per_thread_key(stream)) return nullptr;
  const std::uint64_t id = backend_.capture_id(stream);
  if (id == 0) return nullptr;
  for (detail::capture_record& c : capture_.captures) {
    if (c.capture_id == 0 && !c.joined) c.capture_id = backend_.capture_id(c.stream);  // announced
    if (c.capture_id != id || c.joined) continue;
    const detail::capture_record side{stream, c.graph, c.pool, true, true, id};
    get_or_create_stream_locked(stream);  // known, for fences after the capture
    capture_.captures.push_back(side);
    captures_underway_.store(static_cast<int>(capture_.captures.size()), std::memory_order_release);
    detail::log().debug("device {}: stream {:#x} joined the CUDA graph capture {} on stream {:#x}",
                        backend_.device(), stream, side.graph,
                        graph_state_locked(side.pool)->handle);
    return &capture_.captures.back();
  }
  return nullptr;
}

// The last capture ended: the requests put off meanwhile run.
void caching_allocator::impl::after_captures_locked(device_lock& lk) {
  // Frees held until the end of every capture; frees held for a graph stay until its release.
  std::exception_ptr error = complete_held_frees_locked(0, {});
  std::vector<std::uint64_t> releases;
  releases.swap(capture_.releases_after);
  for (std::uint64_t graph : releases) release_graph_locked(graph);
  if (capture_.empty_cache_after && !error) {
    capture_.empty_cache_after = false;
    release_cached(lk, empty_cache_mode::defer);
  }
  if (error) std::rethrow_exception(error);
}

std::exception_ptr caching_allocator::impl::complete_held_frees_locked(
    std::uint64_t graph, const std::vector<stream_handle>& uses) {
  // Each held free of `graph` (0: of no graph) completes with `uses` added to its block's
  // uses; the first failure stops the rest, which stay held, and is returned for the caller to
  // rethrow once its own bookkeeping is done.
  std::vector<detail::held_free> held;
  held.swap(capture_.held_frees);
  std::exception_ptr error;
  for (detail::held_free& h : held) {
    if (h.graph != graph || error) {
      capture_.held_frees.push_back(h);
      continue;
    }
    stream_state& owner = state_of(*h.b->seg->owner);
    detail::lock_guard<stream_lock> slk(owner.mu);
    block* b = h.b;
    b->free_held = false;
    const std::vector<stream_handle> before = b->uses;
    for (stream_handle s : uses) {
      if (s != b->seg->stream && std::find(b->uses.begin(), b->uses.end(), s) == b->uses.end())
        b->uses.push_back(s);
    }
    try {
      free_found_locked(owner, b, h.has_stream ? &h.stream : nullptr);
    } catch (...) {
      b->uses = before;
      b->free_held = true;  // still held: the next end of a capture (or release) retries
      capture_.held_frees.push_back(h);
      error = std::current_exception();
    }
  }
  return error;
}

void caching_allocator::impl::release_graph_locked(std::uint64_t graph) {
  auto rec = capture_.graphs.find(graph);
  if (rec == capture_.graphs.end() || rec->second.released) {
    throw std::invalid_argument(
        "streamsafe: notify_graph_released(" + std::to_string(graph) + ") on device " +
        std::to_string(backend_.device()) +
        ": no such graph (ids come from notify_capture_begin; each is released once)");
  }
  for (const auto& c : capture_.captures) {
    if (c.graph == graph) {
      throw std::invalid_argument("streamsafe: notify_graph_released(" + std::to_string(graph) +
                                  ") on device " + std::to_string(backend_.device()) +
                                  ": the graph is still being captured on " +
                                  stream_name(c.stream) + "; call notify_capture_end first");
    }
  }
  if (capturing()) {  // fences would record events on capturing streams: after the captures
    if (std::find(capture_.releases_after.begin(), capture_.releases_after.end(), graph) ==
        capture_.releases_after.end()) {
      capture_.releases_after.push_back(graph);
    }
    return;
  }
  // The graph may have replayed on any stream: its memory is fenced on every stream we know.
  const std::vector<stream_handle> every = every_stream_locked();
  rec->second.released = true;
  stream_state* g = graph_state_locked(rec->second.pool);
  std::size_t live = 0, live_bytes = 0;
  {
    detail::lock_guard<stream_lock> glk(g->mu);
    // A pool shared between graphs (or used by an open route) goes back when the last of them
    // is released.
    if (--g->pool_graphs == 0) {
      retire_pool_locked(*g, every);
      g->active.for_each([&](const block* b) {
        if (b->state != block_state::active || b->free_held)
          return;  // a held free completes on its own
        ++live;
        live_bytes += b->size;
      });
    }
  }
  std::exception_ptr error = complete_held_frees_locked(graph, every);
  if (live != 0) {
    detail::log().warn(
        "device {}: graph {} released while its private pool holds {} live block(s) ({} bytes): "
        "they "
        "stay allocated and return to the released pool when freed; a graph that still replays "
        "over "
        "them after they are freed races with their next user",
        backend_.device(), graph, live, live_bytes);
  }
  detail::log().debug(
      "device {}: graph {} released: {}", backend_.device(), graph,
      g->graph_released ? "its private pool is returned by empty_cache and before the next capture"
                        : "its pool stays with the other graphs that share it");
  if (error) std::rethrow_exception(error);
}

// The ordinary streams the allocator knows and that are alive.
std::vector<stream_handle> caching_allocator::impl::every_stream_locked() {
  std::vector<stream_handle> every;
  for (auto& [key, st] : streams_.states) {
    if (st->graph == 0 && st->alive.load(std::memory_order_acquire)) every.push_back(st->handle);
  }
  return every;
}

// The last user of pool g let go: its memory becomes releasable, fenced on `every` stream.
void caching_allocator::impl::retire_pool_locked(stream_state& g,
                                                 const std::vector<stream_handle>& every) {
  g.graph_released = true;
  for (auto& [base, seg] : streams_.segments) {
    if (&state_of(*seg->owner) != &g) continue;
    for (stream_handle s : every) note_use_locked(seg, s);
  }
}

// A free while a capture is underway; true when it was handled (held or done).
bool caching_allocator::impl::free_during_capture_locked(stream_state& owner, block* b,
                                                         const stream_handle* stream) {
  // One rule for every pool (a stream's own or a graph's private pool): the capture may use the
  // block if its stream, a recorded use or the stream of this free is capturing. Unless the
  // block belongs to that capture's own pool (where it may serve the capture again, stream
  // order inside the graph putting its old uses first), the free is the graph's until the
  // graph is released: the graph may replay over it.
  const bool same_stream_only = b->uses.empty() && (!stream || *stream == b->seg->stream);
  std::uint64_t graph = 0;
  const detail::capture_record* c = capture_.find(b->seg->stream);
  for (std::size_t i = 0; !c && i < b->uses.size(); ++i) c = capture_.find(b->uses[i]);
  if (!c && stream) c = capture_.find(*stream);
  if (c && graph_state_locked(c->pool) != &owner) graph = c->graph;
  if (graph == 0 && same_stream_only) return false;  // an ordinary same-stream free: no event
  b->free_held = true;
  detail::held_free h{b, stream != nullptr, stream ? *stream : 0, graph, 0, {}};
  if (c && graph == 0) note_capture_positions_locked(h, *c);
  capture_.held_frees.push_back(std::move(h));
  ++capture_.deferrals;
  return true;
}

// A held free in capture c's own pool: when every other use of the block (its recorded uses, the
// stream of a stream-ordered free) is a stream of the same capture, their capture positions now.
void caching_allocator::impl::note_capture_positions_locked(detail::held_free& h,
                                                            const detail::capture_record& c) {
  std::vector<stream_handle> others = h.b->uses;
  if (h.has_stream && h.stream != h.b->seg->stream) others.push_back(h.stream);
  std::vector<std::vector<std::uintptr_t>> positions;
  for (stream_handle u : others) {
    const detail::capture_record* cu = capture_.find(u);
    if (!cu || cu->graph != c.graph || detail::is_per_thread_key(u))
      return;  // a use outside the capture (or a per-thread stream's): at the capture's end
    try {
      positions.push_back(backend_.capture_position(u));
    } catch (const std::exception&) {
      return;  // not known: the free completes when the capture ends
    }
  }
  h.join_graph = c.graph;
  h.positions = std::move(positions);
}

// The capturing stream of c allocates: held frees of its own pool whose other uses it now
// follows inside the capture (the side streams joined back, by an event wait) become free for
// it, as frees on its own stream: stream order inside the graph puts their uses first.
// graph_capture_record_stream_reuse:False (runtime_options): none does, they wait for the end.
void caching_allocator::impl::reclaim_joined_frees_locked(const detail::capture_record& c) {
  if (capture_.held_frees.empty() || detail::is_per_thread_key(c.stream) ||
      !runtime_.graph_capture_record_stream_reuse.load(std::memory_order_relaxed))
    return;
  for (auto it = capture_.held_frees.begin(); it != capture_.held_frees.end();) {
    detail::held_free& h = *it;
    bool follows = h.join_graph == c.graph && h.graph == 0;
    for (std::size_t i = 0; follows && i < h.positions.size(); ++i) {
      try {
        follows = backend_.capture_follows(c.stream, h.positions[i]);
      } catch (const std::exception&) {
        follows = false;
      }
    }
    if (!follows) {
      ++it;
      continue;
    }
    block* b = h.b;
    stream_state& owner = state_of(*b->seg->owner);
    detail::lock_guard<stream_lock> slk(owner.mu);
    b->free_held = false;
    b->uses.clear();
    free_same_stream_locked(owner, b);
    it = capture_.held_frees.erase(it);
  }
}

void* caching_allocator::impl::allocate_during_capture_locked(device_lock& dlk, std::size_t size,
                                                              std::size_t rounded, bool small,
                                                              stream_handle stream, tag_id tag) {
  stream_state* target = nullptr;
  stream_handle origin = 0;  // for a side stream joined into the capture: the capturing stream
  const detail::capture_record* c = join_capture_locked(stream);
  if (!c && stream_capturing(stream)) {
    // A stream the detection did not see (unknown to the allocator until now) that captures: a
    // capture of its own, detected here, as detect_captures_locked does for known streams (its
    // memory must not serve anyone else while its graph may replay).
    begin_capture_locked(stream, true);
    c = capture_.find(stream);
  }
  if (c) {
    target = graph_state_locked(c->pool);
    for (const auto& o : capture_.captures)
      if (c->joined && o.graph == c->graph && !o.joined) origin = o.stream;
    if (!c->joined) reclaim_joined_frees_locked(*c);
  } else {
    target = &get_or_create_stream_locked(stream);
  }
  const auto grow = [&](pool& p) STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
    // Growth is the one backend call allowed (capture-safe in the CUDA backends). A side stream
    // grows into a segment of its own in the graph's pool: a new cudaMalloc segment, or an
    // expandable range reserved for it (as PyTorch keeps one segment per pool and stream).
    return growth_hook_->new_memory_locked(*this, p, rounded, origin != 0 ? stream : 0);
  };
  detail::unique_lock<stream_lock> slk(target->mu);
  // Under a tag, the graph's private pool keeps the tag's memory apart (tagged pools of its
  // own), so that pause(tag) gives it back and resume maps it at the same addresses: the graph
  // stays valid. Throws tag_paused while the tag sleeps.
  pool& p = pool_for_locked(*target, small, tag, size);
  // A side stream gets new memory first: a block the capturing stream freed in the capture may
  // still be used by its work that the side stream is not ordered after. Failing that, a cached
  // block, behind a wait of the side stream on the capturing stream inside the capture (an
  // event recorded and waited on in the same capture: an edge of the graph).
  block* b = origin != 0 ? grow(p) : take_cached_fit_locked(p, rounded);
  if (!b && origin != 0) {
    order_after_locked(stream, origin);
    b = take_cached_fit_locked(p, rounded);
  }
  if (!b) b = grow(p);
  if (!b)
    throw_out_of_memory_locked(dlk, &slk, size, rounded, stream, target, capture_note_locked());
  void* ptr = finish_allocation(*target, b, rounded, size);
  if (origin != 0) add_use_locked(b, stream);  // its free waits for the side stream's work
  return ptr;
}

// For out-of-memory messages.
std::string caching_allocator::impl::capture_note_locked() const {
  std::string note = "; CUDA graph capture underway on";
  for (const auto& c : capture_.captures)
    note += " " + stream_name(c.stream) + " (graph " + std::to_string(c.graph) + ")";
  return note +
         ": cached memory is neither released nor moved between streams until the capture ends, "
         "and a capturing "
         "stream is served only from its graph's pool or new device memory";
}

namespace {

// A released pool's expandable segments with nothing mapped give their address ranges back:
// each graph's pool reserves a range as large as the memory limit (and one more per side
// stream that joined its capture), and a loop of graphs would otherwise exhaust the address
// space.
// Called before a capture, with mu_ held (release_released_pools_locked).
// (A template: impl is private to caching_allocator, as in introspection.cpp.)
template <class Impl>
void give_back_released_ranges(Impl& m) STREAMSAFE_REQUIRES(m.mu_) {
  std::vector<segment*> empty;
  for (auto& [base, seg] : m.streams_.segments) {
    detail::stream_state& st = state_of(*seg->owner);
    if (!seg->expandable || seg->paused || st.graph == 0 || !st.graph_released) continue;
    detail::lock_guard<stream_lock> slk(st.mu);
    if (seg->mapped_bytes == 0 && !seg->first->next && seg->first->state == block_state::free)
      empty.push_back(seg);
  }
  for (segment* seg : empty) {
    pool& p = *seg->owner;
    detail::stream_state& st = state_of(p);
    detail::lock_guard<stream_lock> slk(st.mu);
    try {
      m.backend_.release_address_range(reinterpret_cast<void*>(seg->base), seg->size);
    } catch (const std::exception& e) {  // opportunistic: the range stays, reusable by nobody
      detail::log().warn("device {}: giving back a released graph pool's address range failed: {}",
                         m.backend_.device(), e.what());
      continue;
    }
    p.unmapped.erase(seg->first);
    m.streams_.segments.erase(seg->base);
    m.recycle_block(st, seg->first);
    if (p.expandable == seg) {  // the pool's first range of its own: another, if it has one
      p.expandable = nullptr;
      for (auto& [base, other] : m.streams_.segments)
        if (other->owner == &p && other->expandable && other->side_stream == 0) {
          p.expandable = other;
          break;
        }
    }
    detail::sub_segment(m.stats_, seg->small);
    --st.segments;
    delete seg;
  }
}

}  // namespace

// ---- public interface ---------------------------------------------------------------------------

// Before a capture begins: the free memory of released graphs' pools goes back behind its fence.
void caching_allocator::impl::release_released_pools_locked(device_lock& lk, stream_handle stream) {
  // A capture cannot release memory (no fence, no free, no unmap until it ends) and is served
  // only from its graph's pool and new device memory; the free memory of released graphs'
  // pools would sit idle through it. It goes back now, behind its fence on every stream the
  // graph may have replayed on, in the configured empty_cache mode (wait: the host waits on
  // exactly those fence events, with no lock held; defer: what is safe now, the rest queued).
  // Nothing happens while another capture is underway or once the stream is capturing
  // (notify_capture_begin called after cudaStreamBeginCapture): no event may be recorded then.
  if (capturing() || stream_capturing(stream)) return;
  bool any = false;
  for (auto& [key, st] : streams_.states) any = any || (st->graph != 0 && st->graph_released);
  if (!any) return;
  for (auto& [key, st] : streams_.states) {
    if (st->graph == 0 || !st->graph_released) continue;
    detail::lock_guard<stream_lock> slk(st->mu);
    if (!st->pending.empty()) process_events_locked(*st);
    for_each_pool(*st, [&](pool& p) { flush_quick_locked(p); });  // tagged pools too
  }
  release_batch batch = collect_releasable_locked(true);
  if (!batch.blocks.empty()) {
    detail::log().debug(
        "device {}: before a capture on stream {:#x}: releasing {} bytes of released graphs' pools",
        backend_.device(), stream, batch.bytes);
    release_collected(lk, batch, opts_.empty_cache);
  }
  if (capturing()) return;  // a capture began while the fence wait had mu_ dropped
  give_back_released_ranges(*this);
}

std::uint64_t caching_allocator::notify_capture_begin(stream_handle stream) {
  return notify_capture_begin(stream, 0);
}

std::uint64_t caching_allocator::notify_capture_begin(stream_handle stream,
                                                      std::uint64_t share_pool_of_graph) {
  impl& m = *impl_;
  if (m.inherited()) m.throw_inherited("notify_capture_begin");
  stream = m.key_of(stream);  // cudaStreamPerThread: this thread's per-thread stream
  device_lock lk(m.mu_);
  m.release_released_pools_locked(lk, stream);
  const std::uint64_t graph = m.begin_capture_locked(stream, false, share_pool_of_graph);
  // A fence wait or release that started before the capture counted ends first.
  // (The predicate runs with mu_ held, which the analysis cannot see inside a lambda.)
  m.driver_calls_.done.wait(
      lk, [&]() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS { return m.driver_calls_.in_flight == 0; });
  return graph;
}

std::uint64_t caching_allocator::notify_capture_end(stream_handle stream) {
  if (impl_->inherited()) impl_->throw_inherited("notify_capture_end");
  stream = impl_->key_of(stream);
  device_lock lk(impl_->mu_);
  return impl_->end_capture_locked(lk, stream);
}

void caching_allocator::notify_graph_released(std::uint64_t graph) {
  if (impl_->inherited()) return;  // a forked child: the parent's graphs are not its own
  detail::lock_guard<detail::mutex> lk(impl_->mu_);
  impl_->release_graph_locked(graph);
}

bool caching_allocator::capture_underway() const noexcept { return impl_->capturing(); }

std::size_t caching_allocator::held_free_count() const {
  detail::lock_guard<detail::mutex> lk(impl_->mu_);
  return impl_->capture_.held_frees.size();
}

}  // namespace streamsafe
