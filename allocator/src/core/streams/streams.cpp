// streamsafe core: the stream states (one per stream the allocator has seen, and one per CUDA
// graph's private pool) and each thread's cache of them (stream_cache.hpp).
//
// Invariants: streams_.states maps each known stream handle (or graph_key(graph)) to its state,
// which is never freed before the allocator; sampling_.table[0, sampling_.count) lists the first
// k_sampled_streams states in creation order, written under mu_ and read without it. A state
// whose alive flag is false belongs to a destroyed stream (streams_.dead); a recycled handle
// revives it. Once the tombstone is seen complete, a destroyed stream owning no block leaves
// streams_.states for streams_.spare (cache_key k_tombstone_stream), reused by a later new stream;
// a thread's cached pointer to it stays valid and is used only while cache_key names its stream.
// Locks: new_state_locked, get_or_create_stream_locked and owner_locked need the device lock
// (mu_); state_for takes it on a miss of the thread's cache; peak_sampler::sample takes no lock
// (atomics).
#include "core/allocator_impl.hpp"
#include "core/common/format.hpp"
#include "core/streams/per_thread_stream.hpp"
#include "core/streams/stream_cache.hpp"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>

namespace streamsafe {

using detail::t_cache;
using detail::thread_cache;

thread_local detail::thread_cache detail::t_cache __attribute__((tls_model("initial-exec")));

std::uint64_t detail::this_thread_number() noexcept {
  static std::atomic<std::uint64_t> next{1};
  thread_local const std::uint64_t me = next.fetch_add(1, std::memory_order_relaxed);
  return me;
}

// Every stream the core keeps state for, uses, fences and events is named by a key: the handle
// itself, or for a handle the backend marks as per-thread (a different stream in every host
// thread) the calling thread's per-thread key. The public calls translate their stream argument
// with key_of; st.handle, pool::stream, segment::stream and block uses hold keys. Throws
// std::invalid_argument for a per-thread handle above k_per_thread_max_handle.
stream_handle detail::stream_layer::key_of(stream_handle stream) const {
  if (!backend_.stream_is_per_thread(stream)) return stream;
  if (stream > detail::k_per_thread_max_handle) {
    throw std::invalid_argument(
        "streamsafe: device " + std::to_string(backend_.device()) + ": the backend marks stream " +
        detail::hex(stream) + " as per-thread; per-thread handles above " +
        detail::hex(detail::k_per_thread_max_handle) + " are not supported");
  }
  return detail::per_thread_key(stream);
}

// The backend calls on a key. A per-thread key is named to the backend by its handle on its own
// thread only; from another thread (which cannot name that stream) the legacy default stream (0)
// stands in: the legacy stream is ordered both ways with every blocking stream, and every
// per-thread default stream is one (CUDA Driver API, "Stream synchronization behavior": an action
// in the legacy stream first waits on all blocking streams, then they wait on it). So an event
// recorded on 0 completes after all the work enqueued so far on every per-thread stream, and a
// wait of 0 orders their later work behind it. record_event_on returns the stream the event was
// recorded on (the key, or 0): the stream under which process_events_locked may use stream order
// to prove it.
stream_handle detail::stream_layer::record_event_on(event_handle e, stream_handle key) {
  if (!detail::is_per_thread_key(key)) {
    backend_.record_event(e, key);
    return key;
  }
  if (detail::own_per_thread_key(key)) {
    backend_.record_event(e, detail::per_thread_handle_of(key));
    return key;
  }
  backend_.record_event(e, 0);  // after every blocking stream's work so far (see the header)
  return 0;
}

void detail::stream_layer::stream_wait_on(stream_handle key, event_handle e) {
  if (!detail::is_per_thread_key(key)) backend_.stream_wait_event(key, e);
  else if (detail::own_per_thread_key(key))
    backend_.stream_wait_event(detail::per_thread_handle_of(key), e);
  else backend_.stream_wait_event(0, e);  // the per-thread stream's later work waits behind 0
}

// Another thread's per-thread stream: an event recorded on 0, queried.
bool detail::stream_layer::query_stream_of(stream_handle key) {
  if (!detail::is_per_thread_key(key)) return backend_.query_stream(key);
  if (detail::own_per_thread_key(key))
    return backend_.query_stream(detail::per_thread_handle_of(key));
  // An event recorded on the legacy stream: idle once every blocking stream's work so far is.
  return backend_.device_backend::query_stream(0);
}

// Another thread's per-thread stream: false.
bool detail::stream_layer::stream_capturing(stream_handle key) noexcept {
  if (!detail::is_per_thread_key(key)) return backend_.stream_is_capturing(key);
  // Another thread's per-thread stream cannot be asked about; its capture is seen when that
  // thread announces it or allocates.
  return detail::own_per_thread_key(key) &&
         backend_.stream_is_capturing(detail::per_thread_handle_of(key));
}

// cache_key: the handle the threads' stream caches look the state up by (0: `key`).
detail::stream_state& detail::stream_layer::new_state_locked(stream_handle key,
                                                             stream_handle handle,
                                                             stream_handle cache_key) {
  if (cache_key == 0) cache_key = key;
  // A per-thread stream's state (cache_key, its handle, differs from its key) is always new: a
  // recycled one may still sit in its old thread's stream cache under the same handle.
  if (!streams_.spare.empty() && cache_key == key) {
    // A retired state (retire_dead_streams_locked): empty, its counters folded into stats_.
    std::unique_ptr<stream_state> state = std::move(streams_.spare.back());
    streams_.spare.pop_back();
    stream_state& st = *state;
    {
      detail::lock_guard<stream_lock> slk(st.mu);  // a stale stream cache entry may lock it
      st.handle = handle;
      st.small_pool.stream = st.large_pool.stream = handle;
      st.tagged.clear();  // retired: its tagged pools hold nothing
      st.process_at = detail::k_pending_batch;
      st.graph = 0;
      st.graph_released = false;
      st.alive.store(true, std::memory_order_release);
      st.cache_key.store(cache_key, std::memory_order_release);
    }
    return *streams_.states.emplace(key, std::move(state)).first->second;
  }
  auto state = std::make_unique<stream_state>();
  state->event_cache.reserve(detail::k_event_cache);
  state->handle = handle;
  state->cache_key.store(cache_key, std::memory_order_relaxed);
  state->small_pool.stream = state->large_pool.stream = handle;
  state->small_pool.small = true;
  state->small_pool.state = state->large_pool.state = state.get();
  sampling_.add(state.get());
  return *streams_.states.emplace(key, std::move(state)).first->second;
}

// A tombstone back to the event pool, unless a pending block or an unlocked wait refers to one.
void detail::stream_layer::drop_tombstone_locked(event_handle e) {
  if (tombstone_refs_.load(std::memory_order_acquire) == 0) put_event(e);
  else streams_.superseded_tombstones.push_back(e);
}

// Queries the tombstone; once complete, retires it and every destroyed stream owning nothing.
void caching_allocator::impl::retire_dead_streams_locked() {
  if (capturing()) return;  // no event query during a graph capture
  if (!streams_.tombstones.empty()) {
    if (!backend_.query_event(streams_.tombstones.front().event)) return;
    drop_tombstone_locked(
        streams_.tombstones.front().event);  // every destroyed stream's work is done
    streams_.tombstones.clear();
  }
  if (!streams_.superseded_tombstones.empty() &&
      tombstone_refs_.load(std::memory_order_acquire) == 0) {
    for (event_handle e : streams_.superseded_tombstones) put_event(e);
    streams_.superseded_tombstones.clear();
  }
  // A destroyed stream owning no segment goes: its handle is forgotten (a recycled one starts
  // afresh, with nothing to inherit) and its state waits in streams_.spare for reuse.
  std::size_t kept = 0;
  for (stream_state* st : streams_.dead) {
    bool empty = false;
    {
      detail::lock_guard<stream_lock> slk(st->mu);
      empty = st->segments == 0 && st->stats.by[detail::k_all].allocation.current == 0 &&
              st->pending.empty();
      if (empty) {
        st->cache_key.store(detail::k_tombstone_stream, std::memory_order_release);
        // Its totals stay in stats() (which sums streams_.states and stats_); its peaks are in the
        // device-wide sampled peaks already (peak_sampler::sample runs whenever it passed its own).
        auto fold = [](stat& to, const detail::fast_stat& from) {
          to.allocated += from.total;
          to.freed += from.total - from.current;
        };
        const detail::stream_stats& x = st->stats;
        for (std::size_t k = 0; k < detail::k_kinds; ++k) {
          pool_statistics& to = detail::kind_stats(stats_, k);
          const detail::stream_kind_stats& from = x.by[k];
          fold(to.allocated_bytes, from.allocated_bytes);
          fold(to.requested_bytes, from.requested_bytes);
          fold(to.allocation, from.allocation);
          fold(to.active_bytes, from.allocated_bytes);
          fold(to.active, from.allocation);
        }
        stats_.events_recorded += x.events_recorded;
        stats_.stream_waits += x.stream_waits;
        st->stats = detail::stream_stats{};
        for (event_handle e : st->event_cache)
          put_event(e);  // only streams_.states' caches are destroyed at the end
        st->event_cache.clear();
        drop_idle_fence_locked(*st);
      }
    }
    if (!empty) {
      streams_.dead[kept++] = st;
      continue;
    }
    auto it = streams_.states.find(st->handle);
    streams_.spare.push_back(std::move(it->second));
    streams_.states.erase(it);
  }
  streams_.dead.resize(kept);
}

// `stream` is a key (key_of): a handle, or a per-thread stream's key.
detail::stream_state& detail::stream_layer::get_or_create_stream_locked(stream_handle stream) {
  auto it = streams_.states.find(stream);
  if (it == streams_.states.end()) {
    return new_state_locked(
        stream, stream,
        detail::is_per_thread_key(stream) ? detail::per_thread_handle_of(stream) : stream);
  } else if (!it->second->alive.load(std::memory_order_acquire)) {
    // A handle value recycled by the driver before the destroyed stream's state went: the new
    // stream inherits the old one's cached blocks, so it waits, on the device, for the old
    // stream's last work (the tombstone, which proves every destroyed stream's work) and, as
    // for a segment moved between streams, for every stream the fence scope covers (uses that
    // were legal without a record, FSDP2-style).
    const bool every_stream = opts_.release_fence != fence_scope::allocation_stream;
    for (auto& t : streams_.tombstones) {
      stream_wait_on(stream, t.event);
      ++stats_.stream_waits;
    }
    if (every_stream) {
      for (auto& [other, state] : streams_.states) {
        if (other == stream || state->graph != 0 || !state->alive.load(std::memory_order_acquire))
          continue;
        order_after_locked(stream, other);
      }
    }
    streams_.dead.erase(std::find(streams_.dead.begin(), streams_.dead.end(), it->second.get()));
    it->second->alive.store(true, std::memory_order_release);
  }
  return *it->second;
}

detail::stream_state& detail::stream_layer::state_for(stream_handle stream) {
  // Looked up by handle in this thread's cache: a per-thread handle's entry is this thread's
  // per-thread stream (its state's cache_key is the handle). This thread's own per-thread key
  // is looked up by its handle too.
  stream_handle lookup = stream;
  if (detail::is_per_thread_key(stream) && detail::own_per_thread_key(stream))
    lookup = detail::per_thread_handle_of(stream);
  thread_cache& tc = t_cache;
  for (auto& e : tc.streams) {
    if (e.owner == id_ && e.stream == lookup) {
      auto* st = static_cast<stream_state*>(e.state);
      if (st->alive.load(std::memory_order_acquire) &&
          st->cache_key.load(std::memory_order_acquire) == lookup)
        return *st;
      break;
    }
  }
  const stream_handle key = key_of(stream);  // a key stays itself
  detail::lock_guard<detail::mutex> dlk(mu_);
  stream_state& st = get_or_create_stream_locked(key);
  if (st.cache_key.load(std::memory_order_relaxed) == lookup)
    tc.streams[tc.next++ % thread_cache::k_streams] = {id_, lookup, &st};
  return st;
}

// The stream state owning the segment that holds ptr, or null (mu_ held).
detail::stream_state* detail::stream_layer::owner_locked(const void* ptr) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = streams_.segments.upper_bound(addr);
  if (it == streams_.segments.begin()) return nullptr;
  const segment* seg = std::prev(it)->second;
  if (addr >= seg->base + seg->size) return nullptr;
  return &state_of(*seg->owner);
}

void detail::peak_sampler::sample() noexcept {
  // Called after an allocation that may set a device-wide peak (allocate.cpp).
  // sum[q][kind]: the device-wide value of quantity q in the small (0) and large (1) pools.
  std::int64_t sum[k_sampled][2] = {};
  const std::size_t n = count.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < n; ++i) {
    const stat_mirror& m = table[i].load(std::memory_order_acquire)->mirror;
    for (std::size_t j = 0; j < 2; ++j) {
      const std::int64_t allocated = m.allocated_bytes[j].load(std::memory_order_relaxed);
      const std::int64_t allocation = m.allocation[j].load(std::memory_order_relaxed);
      sum[s_allocated_bytes][j] += allocated;
      sum[s_requested_bytes][j] += m.requested_bytes[j].load(std::memory_order_relaxed);
      sum[s_allocation][j] += allocation;
      sum[s_active_bytes][j] += allocated + m.pending_bytes[j].load(std::memory_order_relaxed);
      sum[s_active][j] += allocation + m.pending[j].load(std::memory_order_relaxed);
    }
  }
  for (std::size_t q = 0; q < k_sampled; ++q) {
    raise(peak[q][k_all], sum[q][0] + sum[q][1]);
    raise(peak[q][kind_of(true)], sum[q][0]);
    raise(peak[q][kind_of(false)], sum[q][1]);
  }
}

detail::stream_state* detail::stream_layer::cached_live_state(stream_handle stream) const {
  if (detail::is_per_thread_key(stream)) {  // cached under its handle, by its own thread only
    if (!detail::own_per_thread_key(stream)) return nullptr;
    stream = detail::per_thread_handle_of(stream);
  }
  for (const auto& e : t_cache.streams) {
    if (e.owner == id_ && e.stream == stream) {
      auto* st = static_cast<stream_state*>(e.state);
      const bool live = st->alive.load(std::memory_order_acquire) &&
                        st->cache_key.load(std::memory_order_acquire) == stream;
      return live ? st : nullptr;
    }
  }
  return nullptr;
}

}  // namespace streamsafe
