// streamsafe core: partial releases of the cache: one tag's free memory (empty_cache(tag)) and
// everything above a number of free bytes to keep (trim). Both collect what empty_cache would
// (release.cpp) and release it the same way (fenced; wait, defer or the release worker), only
// less of it; what is not chosen goes straight back to its pool.
#include "core/allocator_impl.hpp"
#include "core/common/logging.hpp"

#include <algorithm>

namespace streamsafe {

std::size_t caching_allocator::empty_cache(std::string_view tag) {
  return empty_cache_of_tag(tag_of(tag));  // config_error for a bad name
}

std::size_t caching_allocator::empty_cache_untagged() { return empty_cache_of_tag(0); }

std::size_t caching_allocator::empty_cache_of_tag(tag_id id) {
  impl& m = *impl_;
  if (m.inherited() || callback_scope::active()) return 0;  // as empty_cache()
  device_lock lk(m.mu_);
  m.detect_captures_locked(lk);
  if (m.capturing()) return 0;  // nothing is released during a capture
  m.prepare_release_locked();
  impl::release_batch batch = m.collect_releasable_locked(false, &id);
  return m.release_collected(lk, batch, m.opts_.empty_cache);
}

std::size_t caching_allocator::trim(std::size_t bytes_to_keep) {
  impl& m = *impl_;
  if (m.inherited() || callback_scope::active()) return 0;
  device_lock lk(m.mu_);
  m.detect_captures_locked(lk);
  if (m.capturing()) return 0;
  m.prepare_release_locked();
  std::int64_t allocated = 0;
  for (auto& [s, st] : m.streams_.states) {
    allocated += st->mirror.allocated_total() + st->mirror.pending_total();
  }
  const std::int64_t cached = m.stats_.reserved_bytes.current - allocated -
                              static_cast<std::int64_t>(m.releases_.deferred_bytes);
  if (cached <= static_cast<std::int64_t>(bytes_to_keep)) return 0;
  auto need = static_cast<std::size_t>(cached) - bytes_to_keep;
  impl::release_batch all = m.collect_releasable_locked();
  // Largest first: the fewest driver calls for the bytes, and the small blocks (most likely
  // reused soon) stay.
  std::sort(all.blocks.begin(), all.blocks.end(),
            [](const block* a, const block* b) { return a->size > b->size; });
  impl::release_batch chosen, rest;
  for (block* b : all.blocks) {
    impl::release_batch& into = need != 0 ? chosen : rest;
    into.blocks.push_back(b);
    into.bytes += b->size;
    need -= std::min(need, b->size);
  }
  for (block* b : chosen.blocks) m.add_fence_streams_locked(chosen, b->seg);
  m.restore_batch_locked(rest);
  detail::log().debug("device {}: trim({} bytes kept): releasing {} bytes", m.backend_.device(),
                      bytes_to_keep, chosen.bytes);
  return m.release_collected(lk, chosen, m.opts_.empty_cache);
}

}  // namespace streamsafe
