// streamsafe core: the error messages of out-of-memory and invalid pointers.
//
// Nothing here changes the allocator's state beyond the out-of-memory counters. Locks: the
// device lock (mu_) is held by every function here; largest_free_locked takes each stream lock
// but that of `held`, which its caller holds.
#include "core/common/format.hpp"
#include "core/common/logging.hpp"
#include "core/stats/diagnostics_layer.hpp"

#include <algorithm>
#include <sstream>
#include <utility>
#include <vector>

namespace streamsafe {

using detail::hex;

namespace {

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

}  // namespace

std::size_t detail::diagnostics_layer::largest_free_locked(const stream_state* held) const {
  std::size_t largest = 0;
  std::vector<tag_id> refused;
  for (const auto& [id, t] : sleep_.tags) {
    if (t->refused.load(std::memory_order_acquire)) refused.push_back(id);
  }
  for (auto& [s, state] : streams_.states) {
    std::unique_lock<stream_lock> slk(state->mu, std::defer_lock);
    if (state.get() != held) slk.lock();
    for_each_pool(std::as_const(*state), [&](const pool& p) {
      // A paused tag's free blocks serve nobody until resume.
      if (std::find(refused.begin(), refused.end(), p.tag) != refused.end()) return;
      if (const block* b = p.mapped.largest()) largest = std::max(largest, b->size);
    });
  }
  return largest;
}

detail::ledger_view detail::diagnostics_layer::ledger_view_locked() const {
  detail::ledger_view v;
  std::int64_t live = 0;
  std::int64_t pending = 0;  // freed by the host, waiting for other streams' uses
  for (auto& [s, state] : streams_.states) {
    live += state->mirror.allocated_total();
    pending += state->mirror.pending_total();
  }
  v.live = static_cast<std::size_t>(std::max<std::int64_t>(live, 0));
  v.pending = static_cast<std::size_t>(std::max<std::int64_t>(pending, 0));
  for (const auto& [base, seg] : streams_.segments) {
    const stream_state& owner = state_of(*seg->owner);
    if (owner.graph != 0 && !owner.graph_released) v.graph += seg->mapped_bytes;
    v.paused += seg->paused_bytes;
  }
  for (const auto& [id, t] : sleep_.tags) v.offloaded_host += t->offloaded_host_bytes;
  std::vector<const block*> exported;  // a block exported twice counts once
  for (const auto& [id, e] : ipc_.exports) {
    if (e.b && std::find(exported.begin(), exported.end(), e.b) == exported.end()) {
      exported.push_back(e.b);
      v.exported += e.b->size;
    }
  }
  for (const auto& [addr, imp] : ipc_.imports) v.imported += imp.size;
  v.reserved = static_cast<std::size_t>(stats_.reserved_bytes.current);
  v.queued = releases_.bytes() + ledger_.fencing_bytes();
  v.releasing = ledger_.releasing_bytes();
  const std::size_t held = v.live + v.pending + v.queued + v.releasing;
  v.cached = v.reserved > held ? v.reserved - held : 0;
  v.limit = limits_.limit_bytes;
  return v;
}

// long: one message in one stream: PyTorch's form first, then streamsafe's account
std::string detail::diagnostics_layer::oom_message_locked(std::size_t size, std::size_t rounded,
                                                          stream_handle stream,
                                                          const stream_state* held) {
  std::size_t free_bytes = 0, total_bytes = 0;
  try {
    backend_.memory_info(free_bytes, total_bytes);
  } catch (const std::exception&) {
  }
  const detail::ledger_view v = ledger_view_locked();
  std::ostringstream os;
  // PyTorch's form first (torch.OutOfMemoryError), then streamsafe's account: the ledger's states.
  os << "CUDA out of memory. Tried to allocate "
     << detail::human_bytes(static_cast<std::int64_t>(size)) << ". GPU " << backend_.device()
     << " has a total capacity of " << detail::human_bytes(static_cast<std::int64_t>(total_bytes))
     << " of which " << detail::human_bytes(static_cast<std::int64_t>(free_bytes)) << " is free. ";
  os << "streamsafe: out of memory on device " << backend_.device() << ": tried to allocate "
     << detail::bytes_with_count(size);
  if (rounded != size) os << " (rounded to " << detail::bytes_with_count(rounded) << ")";
  os << " on stream " << hex(stream) << "; device total " << detail::bytes_with_count(total_bytes)
     << ", free " << detail::bytes_with_count(free_bytes) << "; allocated "
     << detail::bytes_with_count(v.live) << ", " << detail::describe(v) << "; largest free block "
     << detail::bytes_with_count(largest_free_locked(held));
  if (releases_.bytes() != 0) {
    // Which streams the queued releases still wait for (polled; a failing query names none).
    std::vector<stream_handle> busy;
    bool device_wide = false;
    for (const release_batch& batch : releases_.deferred) {
      device_wide = device_wide || batch.device_sync;
      for (const auto& e : batch.fence) {
        bool done = true;
        try {
          done = capturing() ||
                 backend_.query_event(e.event);  // no query during a capture (capture.cpp)
        } catch (const std::exception&) {
        }
        if (!done && std::find(busy.begin(), busy.end(), e.stream) == busy.end())
          busy.push_back(e.stream);
      }
    }
    os << "; " << detail::bytes_with_count(releases_.bytes()) << " waiting behind release fences";
    if (device_wide) {
      os << " (a device-wide fence)";
    } else if (!busy.empty()) {
      os << " (streams still busy:";
      for (stream_handle s : busy) os << " " << hex(s);
      os << ")";
    }
    os << ": call reclaim() once that work has completed, or set empty_cache:wait to let the "
          "allocator wait "
          "on the fences";
  }
  return os.str();
}

// Counts the out-of-memory, drops both locks (slk may be null), logs and throws; `note` ends the
// message. `held`: the stream state whose lock the caller holds, as for oom_message_locked.
void detail::diagnostics_layer::throw_out_of_memory_locked(
    device_lock& dlk, detail::unique_lock<stream_lock>* slk, std::size_t size, std::size_t rounded,
    stream_handle stream, const stream_state* held, const std::string& note)
    STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {  // drops the caller's locks, which the analysis cannot
                                            // follow
  ++stats_.num_ooms;
  trace(trace_action::oom, 0, size, stream);
  std::string msg = oom_message_locked(size, rounded, stream, held) + note;
  if (slk) slk->unlock();
  dlk.unlock();  // the message is logged and thrown with no lock held
  detail::log().error("{}", msg);
  throw out_of_memory(msg);
}

void detail::diagnostics_layer::throw_invalid_pointer_locked(const void* ptr,
                                                             const char* what) const {
  // mu_ and the owning stream's lock (if any) are held.
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  std::ostringstream os;
  os << "streamsafe: " << what << "(" << hex(addr) << ") on device " << backend_.device() << ": ";
  auto it = streams_.segments.upper_bound(addr);
  if (it != streams_.segments.begin()) {
    const segment* seg = std::prev(it)->second;
    if (addr < seg->base + seg->size) {
      for (const block* b = seg->first; b; b = b->next) {
        if (addr < b->addr || addr >= b->addr + b->size) continue;
        if (b->addr == addr && b->free_held) {
          os << "double free: the block at this address (" << b->size
             << " bytes) was already freed during a CUDA graph capture (the free completes after "
                "the capture, "
                "or when its graph is released)";
        } else if (b->addr == addr && b->ipc_held) {
          os << "double free: the block at this address (" << b->size
             << " bytes) was already freed while exported to another process (the free "
                "completes when every export of it has ended)";
        } else if (b->addr == addr) {
          os << "double free: the block at this address (" << b->size << " bytes) is "
             << state_name(b->state);
        } else {
          os << "interior pointer: it lies " << (addr - b->addr) << " bytes into the block at "
             << hex(b->addr) << " (" << b->size << " bytes, " << state_name(b->state)
             << "); pass the pointer that allocate returned";
        }
        throw invalid_pointer(os.str());
      }
    }
  }
  os << "unknown pointer: not allocated by this allocator (a foreign pointer, e.g. from "
        "cudaMalloc, or "
        "one owned by another device)";
  throw invalid_pointer(os.str());
}

}  // namespace streamsafe
