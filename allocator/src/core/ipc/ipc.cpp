// streamsafe core: interprocess export and import of blocks (core/ipc.hpp has the protocol).
//
// The policy: an exported block carries a count of the exports not yet ended (block::ipc_exports).
// An export ends only when the consumer's release has arrived (notify_import_released) AND the
// interprocess event the consumer recorded at that release has been seen complete; until then a
// producer free of the block is held (block::ipc_held, ipc_.held): the block stays active and
// allocated, so no allocation reuses it and no release (empty_cache, the out-of-memory path,
// destruction) unmaps or frees its memory, whatever the fence scope. Events are polled, never
// waited on, except by empty_cache in wait mode (no lock held), as for the release fences; no
// query runs while a graph capture is underway.
// The consumer side keeps each import's mapping until its own release event has completed
// (closing it earlier would unmap under the consumer's pending reads).
// Every function here runs with the device lock (mu_) held unless it is a public entry point.
#include "core/allocator_impl.hpp"
#include "core/common/format.hpp"
#include "core/common/logging.hpp"
#include "core/ipc/ipc_fd.hpp"
#include "core/ipc/ipc_wire.hpp"

#include <unistd.h>

#include <algorithm>
#include <string>

namespace streamsafe {
namespace {

std::string dev_text(const device_backend& b) { return " on device " + std::to_string(b.device()); }

}  // namespace

// A producer free of an exported block (b->ipc_exports != 0): held, b stays active and
// allocated, until its last export ends (owner's lock held).
void caching_allocator::impl::hold_exported_free_locked(stream_state& owner, block* b,
                                                        const stream_handle* stream) {
  (void)owner;
  ipc_.held.push_back({b, stream != nullptr, stream ? *stream : 0});
  b->ipc_held = true;
  detail::log().debug(
      "device {}: free of exported block {:#x} ({} bytes) held until its {} export(s) end",
      backend_.device(), b->addr, b->size, b->ipc_exports);
}

void caching_allocator::impl::end_export_locked(
    std::map<std::uint64_t, detail::ipc_export_record>::iterator it, bool owner_locked) {
  detail::ipc_export_record& rec = it->second;
  backend_.destroy_event(rec.event);  // safe after a stream wait on it is queued, as in CUDA
  detail::close_fds(rec.fds);
  if (owner_locked) {
    --rec.b->ipc_exports;
  } else {
    detail::lock_guard<stream_lock> slk(state_of(*rec.b->seg->owner).mu);
    --rec.b->ipc_exports;
  }
  ipc_.exports.erase(it);
}

// The serve path, no host wait (serve_path.cpp): a held free whose every export the consumer has
// released only waits for the consumer's release events. The block's own stream waits on them on
// the device, the exports end, and the free completes into its pool, ordered after the consumer's
// reads for any reuse (take_from_other_pools_locked orders other streams after that stream).
// `held` is the request's stream, whose lock the caller holds. Returns the bytes freed.
std::size_t caching_allocator::impl::retire_ipc_held_behind_waits_locked(const stream_state* held)
    STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS {
  // A capture: no stream wait on an outside event; an empty_cache(wait) on these events: they
  // must stay alive until it returns.
  if (ipc_.held.empty() || capturing() || ipc_.waits_in_flight != 0) return 0;
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < ipc_.held.size();) {
    const detail::ipc_held_free h = ipc_.held[i];
    block* b = h.b;
    stream_state& owner = state_of(*b->seg->owner);
    bool all_released = owner.alive.load(std::memory_order_acquire);  // a dead stream waits not
    for (const auto& [id, rec] : ipc_.exports) {
      if (rec.b == b && !rec.released) all_released = false;
    }
    if (!all_released) {
      ++i;
      continue;
    }
    std::unique_lock<stream_lock> olk(owner.mu, std::defer_lock);
    if (&owner != held) olk.lock();
    // Every wait first: a failed one changes nothing but queued waits.
    for (const auto& [id, rec] : ipc_.exports) {
      if (rec.b != b) continue;
      stream_wait_on(b->seg->owner->stream, rec.event);
      ++owner.stats.stream_waits;
    }
    for (auto it = ipc_.exports.begin(); it != ipc_.exports.end();) {
      auto next = std::next(it);
      if (it->second.b == b) end_export_locked(it, true);
      it = next;
    }
    ipc_.held.erase(ipc_.held.begin() + static_cast<std::ptrdiff_t>(i));
    b->ipc_held = false;
    const std::size_t size = b->size;
    try {
      free_found_locked(owner, b, h.has_stream ? &h.stream : nullptr);
    } catch (...) {
      b->ipc_held = true;  // still held, its exports ended: the next poll completes it
      ipc_.held.push_back(h);
      throw;
    }
    bytes += size;
    detail::log().debug(
        "device {}: held free of exported block {:#x} completed behind a stream wait on the "
        "consumer's release to serve a request",
        backend_.device(), b->addr);
  }
  return bytes;
}

// Polls (never waits on) the released exports' and closing imports' events; ends the exports
// whose consumer event completed and completes the held frees whose last export ended; closes
// consumer mappings whose event completed. Nothing while a capture is underway.
void caching_allocator::impl::poll_ipc_locked() {
  if (capturing()) return;  // no event query during a capture
  if (ipc_.waits_in_flight == 0) {
    for (auto it = ipc_.exports.begin(); it != ipc_.exports.end();) {
      auto next = std::next(it);
      if (it->second.released && backend_.query_event(it->second.event)) end_export_locked(it);
      it = next;
    }
  }
  for (std::size_t i = 0; i < ipc_.closing.size();) {
    detail::ipc_import_record& rec = ipc_.closing[i];
    if (!backend_.query_event(rec.event)) {
      ++i;
      continue;
    }
    backend_.close_imported_memory(rec.addr);
    backend_.close_ipc_event(rec.event);
    ipc_.closing.erase(ipc_.closing.begin() + static_cast<std::ptrdiff_t>(i));
  }
  if (ipc_.held.empty()) return;
  std::vector<detail::ipc_held_free> held;
  held.swap(ipc_.held);
  std::exception_ptr error;
  for (detail::ipc_held_free& h : held) {
    block* b = h.b;
    stream_state& owner = state_of(*b->seg->owner);
    detail::lock_guard<stream_lock> slk(owner.mu);
    if (b->ipc_exports != 0 || error) {
      ipc_.held.push_back(h);
      continue;
    }
    b->ipc_held = false;
    try {
      free_found_locked(owner, b, h.has_stream ? &h.stream : nullptr);
      detail::log().debug("device {}: held free of exported block {:#x} completed",
                          backend_.device(), b->addr);
    } catch (...) {
      b->ipc_held = true;  // still held: the next poll retries
      ipc_.held.push_back(h);
      error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

// pause gave [addr, addr + bytes) back to the driver (sleep.cpp). The exports of blocks in it
// named that physical memory, and their descriptors would keep it alive (the driver frees it
// once every descriptor is closed): a pause after each hand-over would leak a copy per step.
// Their descriptors are retired; the exports themselves end by the protocol (a consumer that
// imported keeps its own mapping until its release; a late import of the handle fails).
void caching_allocator::impl::retire_exports_in_locked(std::uintptr_t addr, std::size_t bytes) {
  for (auto& [id, rec] : ipc_.exports) {
    if (rec.retired || rec.b->addr >= addr + bytes || rec.b->addr + rec.b->size <= addr) continue;
    detail::retire_fds(rec.fds);
    rec.retired = true;
  }
}

// empty_cache wait mode: waits (mu_ dropped) on the consumer events of released exports of held
// blocks, then polls.
void caching_allocator::impl::wait_ipc_locked(device_lock& lk) {
  if (capturing()) return;
  std::vector<event_handle> waits;
  for (auto& [id, rec] : ipc_.exports) {
    if (rec.released && rec.b->ipc_held) waits.push_back(rec.event);
  }
  if (!waits.empty()) {
    // The events stay alive meanwhile: poll_ipc_locked ends no export and revoke_exports waits
    // while waits_in_flight is non-zero.
    ++ipc_.waits_in_flight;
    {
      driver_call_scope in_flight(driver_calls_, lk);
      try {
        for (event_handle e : waits) backend_.synchronize_event(e);
      } catch (...) {
        in_flight.relock();
        --ipc_.waits_in_flight;
        throw;
      }
    }
    --ipc_.waits_in_flight;
  }
  poll_ipc_locked();
}

// At destruction (destruction.cpp).
void caching_allocator::impl::destroy_ipc_locked(device_lock& lk) {
  // Consumer: released imports close behind their events (waited for, no lock held); imports
  // never released are closed after a device-wide synchronisation (nothing else orders them).
  if (!ipc_.closing.empty()) {
    std::vector<event_handle> waits;
    for (auto& rec : ipc_.closing) waits.push_back(rec.event);
    driver_call_scope in_flight(driver_calls_, lk);
    for (event_handle e : waits) backend_.synchronize_event(e);
  }
  for (auto& rec : ipc_.closing) {
    backend_.close_imported_memory(rec.addr);
    backend_.close_ipc_event(rec.event);
  }
  ipc_.closing.clear();
  if (!ipc_.imports.empty()) {
    detail::log().warn(
        "device {}: allocator destroyed with {} import(s) never released; closing them after a "
        "device synchronisation",
        backend_.device(), ipc_.imports.size());
    {
      driver_call_scope in_flight(driver_calls_, lk);
      backend_.synchronize_device();
    }
    for (auto& [addr, rec] : ipc_.imports) {
      backend_.close_imported_memory(rec.addr);
      backend_.close_ipc_event(rec.event);
    }
    ipc_.imports.clear();
  }
  // Producer: exports not ended keep their blocks allocated (leaked with the live blocks).
  if (!ipc_.exports.empty()) {
    detail::log().warn(
        "device {}: allocator destroyed with {} export(s) not ended; their blocks' memory is kept",
        backend_.device(), ipc_.exports.size());
  }
  for (auto& [id, rec] : ipc_.exports) {
    backend_.destroy_event(rec.event);
    detail::close_fds(rec.fds);
  }
  ipc_.exports.clear();
  ipc_.held.clear();
}

// For check_invariants (invariants.cpp).
void detail::diagnostics_layer::check_ipc_locked() const {
  auto fail = [](const char* what) {
    throw std::logic_error(std::string("streamsafe: invariant violated: ") + what);
  };
  std::map<const block*, std::uint32_t> counts;
  for (const auto& [id, rec] : ipc_.exports) {
    if (rec.b->state != block_state::active) fail("an exported block is not active");
    ++counts[rec.b];
  }
  for (const auto& [b, n] : counts) {
    if (b->ipc_exports != n) fail("a block's export count disagrees with its export records");
  }
  for (const auto& h : ipc_.held) {
    if (h.b->state != block_state::active || !h.b->ipc_held)
      fail("a held free of an exported block is not an active held block");
  }
}

// ---- public interface ---------------------------------------------------------------------------

namespace {

std::uint64_t ipc_key(std::uint64_t allocator_id) {
  return (static_cast<std::uint64_t>(::getpid()) << 32) ^ allocator_id;
}

}  // namespace

ipc_handle caching_allocator::export_block(void* ptr) {
  impl& m = *impl_;
  if (m.inherited()) m.throw_inherited("export_block");
  device_lock lk(m.mu_);
  if (m.capturing()) {
    throw ipc_error("streamsafe: export_block" + dev_text(m.backend_) +
                    ": a CUDA graph capture is underway (export before or after the capture)");
  }
  m.poll_ipc_locked();
  impl::stream_state* owner = m.owner_locked(ptr);
  if (!owner) m.throw_invalid_pointer_locked(ptr, "export_block");
  detail::lock_guard<stream_lock> slk(owner->mu);
  block* b = owner->active.find_active(reinterpret_cast<std::uintptr_t>(ptr));
  if (!b || b->free_held || b->ipc_held) m.throw_invalid_pointer_locked(ptr, "export_block");
  device_backend& be = m.backend_;
  const event_handle e = be.create_ipc_event();
  device_backend::ipc_memory mem;
  detail::ipc_handle_parts parts;
  try {
    mem = be.export_memory(b->seg->base, b->seg->size, b->addr, b->size);
    parts.event = be.export_event(e);
    parts.memory = mem.bytes;
    parts.fds = mem.fds;
    m.ipc_.exports.emplace(m.ipc_.next_export_id, detail::ipc_export_record{b, e, mem.fds, false});
  } catch (...) {
    detail::close_fds(mem.fds);
    be.destroy_event(e);
    throw;
  }
  if (m.ipc_.key == 0) m.ipc_.key = ipc_key(m.id_);
  const std::uint64_t id = m.ipc_.next_export_id++;
  ++b->ipc_exports;
  parts.header.producer = m.ipc_.key;
  parts.header.producer_pid = static_cast<std::int64_t>(::getpid());
  parts.header.export_id = id;
  parts.header.size_bytes = b->size;
  parts.header.device = be.device();
  parts.header.fd_count = static_cast<std::uint32_t>(parts.fds.size());
  parts.header.event_bytes = static_cast<std::uint32_t>(parts.event.size());
  parts.header.memory_bytes = static_cast<std::uint32_t>(parts.memory.size());
  detail::log().debug("device {}: export {} of block {:#x} ({} bytes, {} descriptor(s))",
                      be.device(), id, b->addr, b->size, parts.fds.size());
  return detail::make_ipc_handle(parts);
}

void caching_allocator::notify_import_released(const ipc_release& release) {
  impl& m = *impl_;
  const detail::ipc_release_header r = detail::parse_ipc_release(release, "notify_import_released");
  device_lock lk(m.mu_);
  if (m.ipc_.key == 0 || r.producer != m.ipc_.key) {
    throw ipc_error("streamsafe: notify_import_released" + dev_text(m.backend_) +
                    ": the message releases export " + std::to_string(r.export_id) +
                    " of another allocator or process (unknown handle)");
  }
  auto it = m.ipc_.exports.find(r.export_id);
  if (it == m.ipc_.exports.end()) {
    throw ipc_error("streamsafe: notify_import_released" + dev_text(m.backend_) + ": export " +
                    std::to_string(r.export_id) +
                    (r.export_id < m.ipc_.next_export_id
                         ? " has already ended (released twice, or revoked)"
                         : " was never made by this allocator (unknown handle)"));
  }
  if (it->second.released) {
    throw ipc_error("streamsafe: notify_import_released" + dev_text(m.backend_) + ": export " +
                    std::to_string(r.export_id) + " released twice");
  }
  it->second.released = true;
  m.poll_ipc_locked();
}

std::size_t caching_allocator::revoke_exports(void* ptr) {
  impl& m = *impl_;
  if (m.inherited()) return 0;
  device_lock lk(m.mu_);
  // An empty_cache waiting on these events with the lock dropped finishes first.
  m.driver_calls_.done.wait(
      lk, [&]() STREAMSAFE_NO_THREAD_SAFETY_ANALYSIS { return m.ipc_.waits_in_flight == 0; });
  impl::stream_state* owner = m.owner_locked(ptr);
  if (!owner) m.throw_invalid_pointer_locked(ptr, "revoke_exports");
  block* b = nullptr;
  {
    detail::lock_guard<stream_lock> slk(owner->mu);
    b = owner->active.find_active(reinterpret_cast<std::uintptr_t>(ptr));
    if (!b || b->free_held) m.throw_invalid_pointer_locked(ptr, "revoke_exports");
  }
  std::size_t n = 0;
  for (auto it = m.ipc_.exports.begin(); it != m.ipc_.exports.end();) {
    auto next = std::next(it);
    if (it->second.b == b) {
      m.end_export_locked(it);
      ++n;
    }
    it = next;
  }
  if (n != 0) {
    detail::log().info("device {}: {} export(s) of block {:#x} revoked", m.backend_.device(), n,
                       reinterpret_cast<std::uintptr_t>(ptr));
  }
  m.poll_ipc_locked();
  return n;
}

// long: an import opens three resources in order and closes them in reverse on any failure
imported_block caching_allocator::import_block(const ipc_handle& handle) {
  impl& m = *impl_;
  if (m.inherited()) m.throw_inherited("import_block");
  const detail::ipc_handle_parts parts = detail::parse_ipc_handle(handle, "import_block");
  device_lock lk(m.mu_);
  if (m.capturing()) {
    throw ipc_error("streamsafe: import_block" + dev_text(m.backend_) +
                    ": a CUDA graph capture is underway");
  }
  m.poll_ipc_locked();
  // An export imported here before, open, closing or closed, is refused: the producer ends the
  // export at the first import's release and may hand the block out again, so a second import
  // would read memory that is no longer the export's.
  const std::pair<std::uint64_t, std::uint64_t> key{parts.header.producer, parts.header.export_id};
  if (m.ipc_.imported.count(key) != 0) {
    throw ipc_error("streamsafe: import_block" + dev_text(m.backend_) + ": export " +
                    std::to_string(parts.header.export_id) +
                    " is imported here already (each export has one consumer and one import, "
                    "also after its release: export again)");
  }
  device_backend::ipc_memory mem;
  mem.bytes = parts.memory;
  mem.fds = (parts.header.flags & detail::k_ipc_fds_local) != 0
                ? parts.fds
                : detail::fetch_ipc_fds(parts.header.producer_pid, parts.fds);
  const std::uintptr_t addr = m.backend_.import_memory(mem);  // closes mem.fds
  if (m.ipc_.imports.count(addr) != 0) {  // another export of the same block, open here
    m.backend_.close_imported_memory(addr);
    throw ipc_error("streamsafe: import_block" + dev_text(m.backend_) + ": export " +
                    std::to_string(parts.header.export_id) + " maps at " + detail::hex(addr) +
                    ", where another export of the same block is imported here already (release "
                    "it first, or import in another allocator)");
  }
  event_handle e = 0;
  try {
    e = m.backend_.open_ipc_event(parts.event);
  } catch (...) {
    m.backend_.close_imported_memory(addr);
    throw;
  }
  detail::ipc_import_record rec;
  rec.addr = addr;
  rec.size = static_cast<std::size_t>(parts.header.size_bytes);
  rec.producer = parts.header.producer;
  rec.export_id = parts.header.export_id;
  rec.producer_device = parts.header.device;
  rec.event = e;
  try {
    m.ipc_.imported.insert(key);
    m.ipc_.imports[addr] = rec;
  } catch (...) {
    m.ipc_.imported.erase(key);
    m.backend_.close_ipc_event(e);
    m.backend_.close_imported_memory(addr);
    throw;
  }
  detail::log().debug("device {}: imported export {} of process {} at {:#x} ({} bytes)",
                      m.backend_.device(), rec.export_id, parts.header.producer_pid, addr,
                      rec.size);
  return imported_block{reinterpret_cast<void*>(addr), rec.size, rec.export_id};
}

ipc_release caching_allocator::release_import(void* ptr, stream_handle stream) {
  impl& m = *impl_;
  if (m.inherited()) m.throw_inherited("release_import");
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  device_lock lk(m.mu_);
  if (m.capturing()) {
    throw ipc_error("streamsafe: release_import" + dev_text(m.backend_) +
                    ": a CUDA graph capture is underway (the event would be captured)");
  }
  auto it = m.ipc_.imports.find(addr);
  if (it == m.ipc_.imports.end()) {
    const bool closing = std::any_of(
        m.ipc_.closing.begin(), m.ipc_.closing.end(),
        [&](const detail::ipc_import_record& rec) { return rec.addr == addr; });
    throw ipc_error("streamsafe: release_import(" + detail::hex(addr) + ")" + dev_text(m.backend_) +
                    (closing ? ": released twice (the import is already released)"
                             : ": not an open import of this allocator (unknown pointer, or "
                               "released already)"));
  }
  detail::ipc_import_record rec = it->second;
  m.ipc_.closing.reserve(m.ipc_.closing.size() + 1);  // throws before anything changes
  m.backend_.record_event(rec.event, stream);         // throws: the import stays open
  rec.released = true;
  m.ipc_.imports.erase(it);
  m.ipc_.closing.push_back(rec);
  detail::ipc_release_header r;
  r.producer = rec.producer;
  r.export_id = rec.export_id;
  r.device = rec.producer_device;
  return detail::make_ipc_release(r);
}

bool caching_allocator::is_import(const void* ptr) const {
  detail::lock_guard<detail::mutex> lk(impl_->mu_);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  if (impl_->ipc_.imports.count(addr) != 0) return true;
  return std::any_of(impl_->ipc_.closing.begin(), impl_->ipc_.closing.end(),
                     [&](const detail::ipc_import_record& rec) { return rec.addr == addr; });
}

int ipc_handle_device(const ipc_handle& handle) {
  return detail::parse_ipc_handle(handle, "ipc_handle_device").header.device;
}

int ipc_release_device(const ipc_release& release) {
  return detail::parse_ipc_release(release, "ipc_release_device").device;
}

ipc_release ipc_release_of(const ipc_handle& handle) {
  const detail::ipc_handle_parts parts = detail::parse_ipc_handle(handle, "ipc_release_of");
  detail::ipc_release_header r;
  r.producer = parts.header.producer;
  r.export_id = parts.header.export_id;
  r.device = parts.header.device;
  return detail::make_ipc_release(r);
}

caching_allocator::ipc_counts caching_allocator::ipc_status() const {
  detail::lock_guard<detail::mutex> lk(impl_->mu_);
  ipc_counts c;
  c.exports = impl_->ipc_.exports.size();
  c.held_frees = impl_->ipc_.held.size();
  c.imports = impl_->ipc_.imports.size();
  c.closing = impl_->ipc_.closing.size();
  return c;
}

}  // namespace streamsafe
