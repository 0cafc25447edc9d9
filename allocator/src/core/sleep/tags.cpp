// streamsafe core: tags (core/sleep.hpp). The process-wide name registry, the calling thread's
// tag (tag_scope), and each stream's tagged pools: memory of a tag comes from pools of its own,
// so that every segment holds one tag's blocks and pause can give a tag's chunks back whole.
// Locks: the registry has its own mutex (a leaf); tagged pools are created under mu_ and the
// stream's lock, and read under the stream's lock.
#include "core/allocator_impl.hpp"
#include "core/common/format.hpp"

#include <streamsafe/core/errors.hpp>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <vector>

namespace streamsafe {

namespace {

struct tag_registry {
  std::mutex mu;
  std::vector<std::string> names{""};  // index = tag id; 0 is untagged
};

tag_registry& registry() {
  static tag_registry* r = new tag_registry;  // never destroyed: scopes may outlive statics
  return *r;
}

constexpr tag_id k_unset = ~tag_id{0};  // no tag_scope open on the thread
thread_local tag_id t_current_tag = k_unset;
std::atomic<tag_id> g_process_tag{0};

constexpr std::size_t k_max_tag_chars = 64;

}  // namespace

const char* to_string(tag_phase phase) noexcept {
  switch (phase) {
    case tag_phase::active: return "active";
    case tag_phase::pausing: return "pausing";
    case tag_phase::paused: return "paused";
    case tag_phase::resuming: return "resuming";
  }
  return "unknown";
}

tag_id tag_of(std::string_view name) {
  const bool printable = std::all_of(name.begin(), name.end(), [](char c) {
    return static_cast<unsigned char>(c) >= 0x20 && static_cast<unsigned char>(c) < 0x7f;
  });
  if (name.empty() || name.size() > k_max_tag_chars || !printable) {
    throw config_error("streamsafe: tag name '" + std::string(name) +
                       "' is invalid: a tag is 1 to 64 printable ASCII characters");
  }
  tag_registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  for (std::size_t i = 1; i < r.names.size(); ++i) {
    if (r.names[i] == name) return static_cast<tag_id>(i);
  }
  r.names.emplace_back(name);
  return static_cast<tag_id>(r.names.size() - 1);
}

std::string tag_name(tag_id id) {
  tag_registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  if (id >= r.names.size())
    throw std::invalid_argument("streamsafe: unknown tag id " + std::to_string(id));
  return r.names[id];
}

std::vector<tag_info> list_tags() {
  tag_registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  std::vector<tag_info> out;
  out.reserve(r.names.size() - 1);
  for (std::size_t i = 1; i < r.names.size(); ++i)
    out.push_back({static_cast<tag_id>(i), r.names[i]});
  return out;
}

tag_scope::tag_scope(std::string_view name) : previous_(t_current_tag) {
  t_current_tag = tag_of(name);
}

tag_scope::tag_scope(tag_id id) noexcept : previous_(t_current_tag) { t_current_tag = id; }

tag_scope::~tag_scope() { t_current_tag = previous_; }

tag_id tag_scope::current() noexcept {
  const tag_id t = t_current_tag;
  return t != k_unset ? t : g_process_tag.load(std::memory_order_relaxed);
}

process_tag_scope::process_tag_scope(std::string_view name)
    : previous_(g_process_tag.exchange(tag_of(name), std::memory_order_relaxed)) {}

process_tag_scope::~process_tag_scope() {
  g_process_tag.store(previous_, std::memory_order_relaxed);
}

caching_allocator::impl::tag_state& caching_allocator::impl::tag_state_locked(tag_id tag) {
  auto& slot = sleep_.tags[tag];
  if (!slot) {
    slot = std::make_unique<tag_state>();
    slot->id = tag;
    slot->name = tag_name(tag);
  }
  return *slot;
}

// The pool of st for (small, tag), created if missing; throws tag_paused while refused.
pool& caching_allocator::impl::pool_for_locked(stream_state& st, bool small, tag_id tag,
                                               std::size_t size) {
  if (tag == 0) return pool_of(st, small);
  tag_state& t = tag_state_locked(tag);
  if (t.refused.load(std::memory_order_acquire)) {
    throw tag_paused("streamsafe: allocate(" + std::to_string(size) + " bytes) on device " +
                     std::to_string(backend_.device()) + ", stream " + detail::hex(st.handle) +
                     " under tag '" + t.name + "', which is " + to_string(t.phase) +
                     ": resume the tag first");
  }
  for (auto& tp : st.tagged) {
    if (tp->tag == tag) return small ? tp->small_pool : tp->large_pool;
  }
  auto tp = std::make_unique<detail::tag_pools>();
  tp->tag = tag;
  tp->refused = &t.refused;
  for (pool* p : {&tp->small_pool, &tp->large_pool}) {
    p->stream = st.handle;
    p->tag = tag;
    p->state = &st;
  }
  tp->small_pool.small = true;
  st.tagged.push_back(std::move(tp));
  return small ? st.tagged.back()->small_pool : st.tagged.back()->large_pool;
}

}  // namespace streamsafe
