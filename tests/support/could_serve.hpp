// Test support: the reference "could serve", the oracle of the promise that an allocation fails
// with out_of_memory only when nothing cached, pending or queued could serve it.
//
// Definition. The memory limit's scope is everything the allocator holds from the device (every
// pool, stream, tag and graph pool; reserved bytes). Memory that must stay is the memory that
// holds a live byte; everything else (cached, pending other streams' work, queued for release,
// being released) can go back to the driver, behind fences that complete within the allocator's
// bounded wait as long as no stream is held longer than that. A request of `size` bytes
// could be served when
//   * cuda_malloc: the segments that hold a live block, plus the segment a growth would take for
//     the request, fit the limit. The new segment is the request rounded as the core rounds it
//     (PyTorch's thresholds: 512 B; up to 1 MiB a 2 MiB small segment; below 10 MiB a 20 MiB
//     segment; above, rounded up to 2 MiB);
//   * expandable: the mapped bytes that hold a live byte (live blocks rounded out to the mapping
//     granularity, 2 MiB: the granules they touch; or, seen from the device, the whole physical
//     chunks they touch), plus the request rounded up to the granularity (what a growth maps),
//     fit the limit;
//   * either backend, also: a free block of the request's own pool (its stream, its pool kind
//     small or large, its tag, no graph pool), cached or pending other streams' work, is at
//     least the rounded request (reused in place, behind a stream wait when pending).
// "Live" is a block handed out and not yet freed by the host, or freed but held (a free held by
// an IPC export): the snapshot's state `active`. A paused tag's unmapped chunks hold nothing.
// Resuming a tag could be served when the bytes holding a live byte plus the tag's paused bytes
// (mapped again at the same addresses) fit the limit.
//
// Two views of the same definition, compared by the schedule checker:
//   * oracle_from_snapshot: from the allocator's own report (memory_snapshot), granules of 2 MiB;
//   * recording_device: a backend wrapper that records every segment, chunk map, alias and
//     unmap the simulated device served, so the physical memory that holds a live range is known
//     without asking the allocator (the device's own bytes; its peak too).
// The snapshot view cannot see chunk boundaries: with chunks larger than the granularity it
// counts less than the device view (never more); with 2 MiB chunks, and outside a pause in
// progress, the two agree. Conservative where it matters: what the oracle calls servable, a
// correct allocator can serve; roundup_power2_divisions must be off (the checker's options).
#pragma once

#include "support/forwarding_device.hpp"

#include <streamsafe/core/options.hpp>
#include <streamsafe/core/snapshot.hpp>
#include <streamsafe/sim/simulated_device.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace streamsafe::test {

// The core's thresholds, written out here rather than taken from the core's size_classes.hpp
// (allocator/src/core/blocks/), so that the oracle is a statement of its own about the code
// under test.
namespace oracle_sizes {
inline constexpr std::size_t k_block = 512;
inline constexpr std::size_t k_small_request = std::size_t{1} << 20;
inline constexpr std::size_t k_small_segment = std::size_t{2} << 20;
inline constexpr std::size_t k_large_segment = std::size_t{20} << 20;
inline constexpr std::size_t k_min_large_alloc = std::size_t{10} << 20;
inline constexpr std::size_t k_round_large = std::size_t{2} << 20;
inline constexpr std::size_t k_granularity = std::size_t{2} << 20;
inline constexpr std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }
}  // namespace oracle_sizes

// The block size the core makes of a request (roundup_power2_divisions off).
inline std::size_t oracle_rounded(std::size_t size_bytes) {
  using namespace oracle_sizes;
  return size_bytes < k_block ? k_block : round_up(size_bytes, k_block);
}

inline bool oracle_is_small(std::size_t size_bytes) {
  return oracle_rounded(size_bytes) <= oracle_sizes::k_small_request;
}

// The new memory a growth takes for the request: a cudaMalloc segment, or the granules a map adds.
inline std::size_t oracle_new_bytes(backend_kind backend, std::size_t size_bytes,
                                    std::size_t granularity_bytes = oracle_sizes::k_granularity) {
  using namespace oracle_sizes;
  const std::size_t r = oracle_rounded(size_bytes);
  if (backend == backend_kind::expandable) return round_up(r, granularity_bytes);
  if (r <= k_small_request) return k_small_segment;
  if (r < k_min_large_alloc) return k_large_segment;
  return round_up(r, k_round_large);
}

struct oracle_request {
  std::size_t size_bytes = 0;
  stream_handle stream = 0;
  std::string tag;                       // "" untagged
  std::size_t max_split_size_bytes = 0;  // options::max_split_size_bytes (0: off)
};

struct oracle_verdict {
  bool could_serve = false;
  std::size_t kept_bytes = 0;  // memory that holds a live byte (must stay)
  std::size_t new_bytes = 0;   // what a growth for the request adds
  std::size_t limit_bytes = 0;
  bool fits_free_block = false;  // a free block of the request's own pool fits it
  std::size_t fitting_block_bytes = 0;

  bool fits_growth() const { return kept_bytes + new_bytes <= limit_bytes; }
  std::string to_string() const {
    std::ostringstream os;
    os << "kept " << kept_bytes << " + new " << new_bytes << " vs limit " << limit_bytes;
    if (fits_free_block) os << "; a free block of its pool fits (" << fitting_block_bytes << " B)";
    return os.str();
  }
};

// Bytes of the granules [begin, end) touches, counted once per granule, relative to `base`.
inline void oracle_add_granules(std::set<std::uintptr_t>& granules, std::uintptr_t base,
                                std::uintptr_t begin, std::size_t size_bytes,
                                std::size_t granularity_bytes) {
  if (size_bytes == 0) return;
  const std::uintptr_t first = (begin - base) / granularity_bytes;
  const std::uintptr_t last = (begin + size_bytes - 1 - base) / granularity_bytes;
  for (std::uintptr_t g = first; g <= last; ++g) granules.insert(base + g * granularity_bytes);
}

// The bytes that hold a live byte, from the allocator's snapshot.
inline std::size_t oracle_kept_bytes(const memory_snapshot& snap,
                                     std::size_t granularity_bytes = oracle_sizes::k_granularity) {
  std::size_t kept = 0;
  for (const segment_snapshot& seg : snap.segments) {
    bool live = false;
    std::set<std::uintptr_t> granules;
    for (const block_snapshot& b : seg.blocks) {
      if (b.state != snapshot_block_state::active) continue;
      live = true;
      if (seg.expandable)
        oracle_add_granules(granules, seg.address, b.address, b.size_bytes, granularity_bytes);
    }
    if (!live) continue;
    if (!seg.expandable) {
      kept += seg.mapped_bytes;
      continue;
    }
    // A pause in progress leaves live blocks unmapped: never more than the segment maps.
    kept += std::min(granules.size() * granularity_bytes, seg.mapped_bytes);
  }
  return kept;
}

// A free block of the request's own pool that fits it (cached, or pending other streams' work).
inline std::size_t oracle_fitting_free_block(const memory_snapshot& snap, const oracle_request& r) {
  const std::size_t rounded = oracle_rounded(r.size_bytes);
  const bool small = rounded <= oracle_sizes::k_small_request;
  std::size_t best = 0;
  for (const segment_snapshot& seg : snap.segments) {
    if (seg.stream != r.stream || seg.tag != r.tag || seg.graph_pool != 0 ||
        (seg.pool == snapshot_pool::small) != small)
      continue;
    for (const block_snapshot& b : seg.blocks) {
      if (b.state != snapshot_block_state::inactive &&
          b.state != snapshot_block_state::pending_free)
        continue;
      if (b.size_bytes < rounded) continue;
      // max_split_size_mb: an oversize block serves only requests close to its size (PyTorch).
      const std::size_t ms = r.max_split_size_bytes;
      if (ms != 0 && !small &&
          ((rounded < ms && b.size_bytes >= ms) ||
           (rounded >= ms && b.size_bytes >= rounded + (std::size_t{20} << 20))))
        continue;
      if (best == 0 || b.size_bytes < best) best = b.size_bytes;
    }
  }
  return best;
}

// The oracle from what the allocator reports.
inline oracle_verdict oracle_from_snapshot(
    const memory_snapshot& snap, backend_kind backend, std::size_t limit_bytes,
    const oracle_request& r, std::size_t granularity_bytes = oracle_sizes::k_granularity) {
  oracle_verdict v;
  v.limit_bytes = limit_bytes;
  v.kept_bytes = oracle_kept_bytes(snap, granularity_bytes);
  v.new_bytes = oracle_new_bytes(backend, r.size_bytes, granularity_bytes);
  v.fitting_block_bytes = oracle_fitting_free_block(snap, r);
  v.fits_free_block = v.fitting_block_bytes != 0;
  v.could_serve = r.size_bytes != 0 && (v.fits_growth() || v.fits_free_block);
  return v;
}

// Resuming `tag`: the bytes holding a live byte plus the tag's paused bytes fit the limit.
inline oracle_verdict oracle_resume_from_snapshot(
    const memory_snapshot& snap, std::size_t limit_bytes, const std::string& tag,
    std::size_t granularity_bytes = oracle_sizes::k_granularity) {
  oracle_verdict v;
  v.limit_bytes = limit_bytes;
  v.kept_bytes = oracle_kept_bytes(snap, granularity_bytes);
  for (const segment_snapshot& seg : snap.segments) {
    if (seg.tag == tag) v.new_bytes += seg.paused_bytes;
  }
  v.could_serve = v.fits_growth();
  return v;
}

// Where a debugger stops when the device passes recording_device::set_trap_bytes.
[[gnu::noinline]] inline void recording_device_over_limit(std::size_t bytes) {
  asm volatile("" ::"r"(bytes) : "memory");
}

// The device's own view: a backend over the simulated device that records the physical memory
// it served (segments, mapped chunks, aliases of them) and where each is mapped. Thread-safe.
class recording_device : public forwarding_device {
 public:
  explicit recording_device(sim::simulated_device& dev) : forwarding_device(dev) {}

  void* allocate_segment(std::size_t size_bytes) override {
    std::lock_guard<std::mutex> lk(mu_);
    void* p = forwarding_device::allocate_segment(size_bytes);
    if (p != nullptr) add_physical(reinterpret_cast<std::uintptr_t>(p), size_bytes);
    return p;
  }
  void free_segment(void* base, std::size_t size_bytes) override {
    std::lock_guard<std::mutex> lk(mu_);
    forwarding_device::free_segment(base, size_bytes);
    remove_mappings(reinterpret_cast<std::uintptr_t>(base), size_bytes);
  }
  bool map(void* addr, std::size_t size_bytes) override {
    std::lock_guard<std::mutex> lk(mu_);
    const bool ok = forwarding_device::map(addr, size_bytes);
    if (ok) add_physical(reinterpret_cast<std::uintptr_t>(addr), size_bytes);
    return ok;
  }
  void unmap(void* addr, std::size_t size_bytes) override {
    std::lock_guard<std::mutex> lk(mu_);
    forwarding_device::unmap(addr, size_bytes);
    remove_mappings(reinterpret_cast<std::uintptr_t>(addr), size_bytes);
  }
  bool map_alias(void* addr, const void* from, std::size_t size_bytes) override {
    std::lock_guard<std::mutex> lk(mu_);
    const bool ok = forwarding_device::map_alias(addr, from, size_bytes);
    if (!ok) return false;
    const auto to = reinterpret_cast<std::uintptr_t>(addr);
    const auto src = reinterpret_cast<std::uintptr_t>(from);
    std::vector<std::pair<std::uintptr_t, mapping>> added;
    for (auto it = first_overlap(src); it != mappings_.end() && it->first < src + size_bytes;
         ++it) {
      if (it->first + it->second.size_bytes <= src) continue;
      added.emplace_back(to + (it->first - src), it->second);
    }
    for (auto& [a, m] : added) {
      mappings_.emplace(a, m);
      ++physical_.at(m.physical).mappings;
    }
    return true;
  }

  // Physical bytes held now, and the most ever held at once.
  std::size_t bytes() const {
    std::lock_guard<std::mutex> lk(mu_);
    return bytes_;
  }
  std::size_t peak_bytes() const {
    std::lock_guard<std::mutex> lk(mu_);
    return peak_bytes_;
  }
  // Past this many bytes each map calls recording_device_over_limit (a breakpoint for gdb).
  void set_trap_bytes(std::size_t n) {
    std::lock_guard<std::mutex> lk(mu_);
    trap_bytes_ = n;
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lk(mu_);
    peak_bytes_ = bytes_;
  }
  // The physical memory (segments, whole chunks) mapped under any of the live ranges
  // {address, size}, each counted once.
  std::size_t kept_bytes(const std::vector<std::pair<std::uintptr_t, std::size_t>>& live) const {
    std::lock_guard<std::mutex> lk(mu_);
    std::set<std::uint64_t> held;
    for (const auto& [a, n] : live) {
      for (auto it = first_overlap(a); it != mappings_.end() && it->first < a + n; ++it) {
        if (it->first + it->second.size_bytes <= a) continue;
        held.insert(it->second.physical);
      }
    }
    std::size_t kept = 0;
    for (std::uint64_t id : held) kept += physical_.at(id).size_bytes;
    return kept;
  }
  // The largest physical allocation (segment, chunk or handle) held now: a resume maps a tag in
  // handles sized to it, which go back only whole, so the device then keeps more than granules.
  std::size_t largest_physical_bytes() const {
    std::lock_guard<std::mutex> lk(mu_);
    std::size_t largest = 0;
    for (const auto& [id, ph] : physical_) largest = std::max(largest, ph.size_bytes);
    return largest;
  }
  // The oracle's growth clause from the device's view.
  oracle_verdict verdict(const std::vector<std::pair<std::uintptr_t, std::size_t>>& live,
                         backend_kind backend, std::size_t limit_bytes,
                         std::size_t new_bytes) const {
    oracle_verdict v;
    v.limit_bytes = limit_bytes;
    v.kept_bytes = kept_bytes(live);
    v.new_bytes = new_bytes;
    (void)backend;
    v.could_serve = v.fits_growth();
    return v;
  }

 private:
  struct mapping {
    std::size_t size_bytes;
    std::uint64_t physical;
  };
  struct physical {
    std::size_t size_bytes;
    int mappings;
  };

  std::map<std::uintptr_t, mapping>::const_iterator first_overlap(std::uintptr_t a) const {
    auto it = mappings_.upper_bound(a);
    if (it != mappings_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second.size_bytes > a) return prev;
    }
    return it;
  }
  void add_physical(std::uintptr_t a, std::size_t n) {
    const std::uint64_t id = next_id_++;
    physical_.emplace(id, physical{n, 1});
    mappings_.emplace(a, mapping{n, id});
    bytes_ += n;
    peak_bytes_ = std::max(peak_bytes_, bytes_);
    if (trap_bytes_ != 0 && bytes_ > trap_bytes_) recording_device_over_limit(bytes_);
  }
  // unmap / free_segment cover whole mappings (a union of ranges map() mapped).
  void remove_mappings(std::uintptr_t a, std::size_t n) {
    auto it = mappings_.lower_bound(a);
    while (it != mappings_.end() && it->first < a + n) {
      physical& p = physical_.at(it->second.physical);
      if (--p.mappings == 0) {
        bytes_ -= p.size_bytes;
        physical_.erase(it->second.physical);
      }
      it = mappings_.erase(it);
    }
  }

  mutable std::mutex mu_;
  std::map<std::uintptr_t, mapping> mappings_;  // address -> a physical allocation mapped there
  std::map<std::uint64_t, physical> physical_;
  std::uint64_t next_id_ = 1;
  std::size_t bytes_ = 0;
  std::size_t peak_bytes_ = 0;
  std::size_t trap_bytes_ = 0;
};

}  // namespace streamsafe::test
