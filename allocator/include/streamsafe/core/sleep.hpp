// streamsafe: tags and sleep/wake, the types (caching_allocator.hpp has the calls).
//
// A tag names a group of memory (weights, optimizer state, a KV cache). Memory allocated while
// a tag_scope is open on the calling thread belongs to that tag: it comes from pools of its own
// (per stream, small and large, as untagged memory), so that its segments hold nothing else.
// caching_allocator::pause(tag) gives every physical chunk of the tag back to the driver and
// keeps the virtual address ranges reserved; resume(tag) maps new memory at the same addresses
// (restoring the contents in offload mode). Only the expandable backend can keep addresses
// (backend_kind::expandable, expandable_segments:True); untagged memory is never paused.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace streamsafe {

using tag_id = std::uint32_t;  // 0: untagged

// The id of a tag name, the same in every allocator of the process (interned once, never
// forgotten). Names are 1 to 64 printable characters; anything else throws config_error.
tag_id tag_of(std::string_view name);
// The name of a tag id ("" for 0); throws std::invalid_argument for an id tag_of never returned.
std::string tag_name(tag_id id);

// A tag the process has named.
struct tag_info {
  tag_id id = 0;
  std::string name;
};
// Every tag named so far in the process (by tag_of, tag_scope or process_tag_scope), in id
// order, ids 1, 2, ...; untagged (0) is not listed. A copy: a tag named later is not in it.
std::vector<tag_info> list_tags();

// While alive, allocations made on the calling thread belong to the tag (any allocator, any
// device). Scopes nest; the innermost wins; tag_scope(0) makes allocations untagged again.
// Thread-local: a scope opened on one thread does not tag another thread's allocations.
class tag_scope {
 public:
  explicit tag_scope(std::string_view name);
  explicit tag_scope(tag_id id) noexcept;
  ~tag_scope();
  tag_scope(const tag_scope&) = delete;
  tag_scope& operator=(const tag_scope&) = delete;
  // The tag of the calling thread's allocations: its innermost tag_scope, else the process
  // default (process_tag_scope), else 0.
  static tag_id current() noexcept;

 private:
  tag_id previous_;
};

// While alive, the tag of allocations on threads with no tag_scope open: the process default
// (for work the caller does not run on its own thread, such as PyTorch's autograd backward).
// Scopes nest and must end in the reverse order of their start (one thread driving them).
class process_tag_scope {
 public:
  explicit process_tag_scope(std::string_view name);
  ~process_tag_scope();
  process_tag_scope(const process_tag_scope&) = delete;
  process_tag_scope& operator=(const process_tag_scope&) = delete;

 private:
  tag_id previous_;
};

enum class pause_mode {
  discard,  // the contents are lost (a KV cache): nothing is copied
  offload,  // the live blocks' contents go to pinned host memory first (stream-ordered) and
            // come back at resume
};

enum class tag_phase {
  active,    // mapped and usable
  pausing,   // pause called; some chunks still mapped, behind their fence (or offload copy)
  paused,    // every chunk of the tag is back with the driver
  resuming,  // resume_async: the release worker maps it again; allocation still refused
};

const char* to_string(tag_phase phase) noexcept;

// What pause, resume and tag_status report. Bytes are device bytes unless named host.
struct pause_status {
  std::string tag;
  tag_phase phase = tag_phase::active;
  std::size_t released_bytes = 0;        // given back to the driver by the tag's pause so far
  std::size_t pending_bytes = 0;         // still mapped, waiting for a fence or an offload copy
  std::size_t offloaded_host_bytes = 0;  // pinned host bytes holding the tag's contents
  std::size_t allocated_bytes = 0;       // the tag's live blocks (valid pointers throughout)
  std::size_t reserved_bytes = 0;        // the tag's mapped bytes now
  std::string error;  // why the last resume_async left the tag paused (out of memory), else ""
};

// The hook's view of one range: called before each unmap and after each map that pause and
// resume make, on the thread that makes the driver call (the caller's, or the release
// worker's), with no allocator lock held. It may not call the allocator; it must not throw
// (an exception is logged and ignored). Use it to drop and make again NCCL or RDMA
// registrations of the memory.
struct sleep_hook_event {
  enum class kind { before_unmap, after_map };
  kind what = kind::before_unmap;
  std::string tag;
  int device = 0;
  std::uintptr_t address = 0;
  std::size_t size_bytes = 0;
};
using sleep_hook = std::function<void(const sleep_hook_event&)>;

}  // namespace streamsafe
