// streamsafe core: memory_snapshot checks and JSON, statistics JSON, and memory_summary().
//
// Pure functions of their arguments: no allocator state, no lock. JSON is written by hand
// (integers, booleans and fixed names only, so nothing needs escaping); key names follow
// torch.cuda.memory_snapshot() and torch.cuda.memory_stats() where PyTorch has the notion.
#include <streamsafe/core/snapshot.hpp>

#include "core/common/format.hpp"

#include <cinttypes>
#include <cstdio>
#include <ostream>
#include <sstream>
#include <stdexcept>

namespace streamsafe {

using detail::hex;
using detail::human_bytes;

namespace {

// PyTorch's block state names where PyTorch has the state, streamsafe's otherwise.
const char* json_state(snapshot_block_state s) noexcept {
  switch (s) {
    case snapshot_block_state::active: return "active_allocated";
    case snapshot_block_state::pending_free: return "active_pending_free";
    case snapshot_block_state::inactive: return "inactive";
    case snapshot_block_state::unmapped: return "unmapped";
    case snapshot_block_state::releasing: return "releasing";
  }
  return "?";
}

}  // namespace

const char* to_string(snapshot_block_state state) noexcept {
  switch (state) {
    case snapshot_block_state::active: return "active";
    case snapshot_block_state::pending_free: return "pending_free";
    case snapshot_block_state::inactive: return "inactive";
    case snapshot_block_state::unmapped: return "unmapped";
    case snapshot_block_state::releasing: return "releasing";
  }
  return "?";
}

const char* to_string(snapshot_pool pool) noexcept {
  return pool == snapshot_pool::small ? "small" : "large";
}

std::size_t segment_snapshot::bytes_in(snapshot_block_state state) const noexcept {
  std::size_t n = 0;
  for (const block_snapshot& b : blocks) {
    if (b.state == state) n += b.size_bytes;
  }
  return n;
}

void memory_snapshot::check_consistency() const {
  auto fail = [](const std::string& what) {
    throw std::logic_error("streamsafe snapshot: " + what);
  };
  std::uintptr_t previous_end = 0;
  for (const segment_snapshot& seg : segments) {
    const std::string where = "segment " + hex(seg.address);
    if (seg.address < previous_end) fail(where + " overlaps or precedes the segment before it");
    previous_end = seg.address + seg.size_bytes;
    std::uintptr_t expect = seg.address;
    std::size_t mapped = 0;
    for (const block_snapshot& b : seg.blocks) {
      if (b.address != expect)
        fail(where + ": blocks do not tile it at " + hex(b.address) + " (expected " + hex(expect) +
             ")");
      if (b.size_bytes == 0) fail(where + ": empty block at " + hex(b.address));
      if (b.state == snapshot_block_state::unmapped) {
        if (!seg.expandable)
          fail(where + ": unmapped block " + hex(b.address) +
               " in a segment that is not expandable");
      } else {
        mapped += b.size_bytes;
      }
      if (!b.waiting_on.empty() && b.state != snapshot_block_state::pending_free) {
        fail(where + ": block " + hex(b.address) + " waits on streams but is " +
             to_string(b.state));
      }
      expect += b.size_bytes;
    }
    if (expect != seg.address + seg.size_bytes)
      fail(where + ": blocks cover " + std::to_string(expect - seg.address) + " of its " +
           std::to_string(seg.size_bytes) + " bytes");
    if (mapped != seg.mapped_bytes + seg.paused_bytes + seg.aliased_bytes)
      fail(where + ": mapped_bytes " + std::to_string(seg.mapped_bytes) + ", paused_bytes " +
           std::to_string(seg.paused_bytes) + " and aliased_bytes " +
           std::to_string(seg.aliased_bytes) + " but its mapped blocks hold " +
           std::to_string(mapped));
  }
}

void write_statistics_json(std::ostream& os, const statistics& s) {
  os << '{';
  bool first = true;
  auto key = [&](const std::string& name) -> std::ostream& {
    os << (first ? "" : ",") << '"' << name << "\":";
    first = false;
    return os;
  };
  for_each_counter(s, [&](const std::string& name, std::int64_t value) { key(name) << value; });
  key("num_alloc_retries") << s.num_alloc_retries;
  key("num_ooms") << s.num_ooms;
  key("num_device_alloc") << s.num_device_alloc;
  key("num_device_free") << s.num_device_free;
  key("num_sync_all_streams") << s.num_sync_all_streams;
  key("events_recorded") << s.events_recorded;
  key("stream_waits") << s.stream_waits;
  key("fence_waits") << s.fence_waits;
  key("fence_wait_ns") << s.fence_wait_ns;
  key("releases_deferred") << s.releases_deferred;
  key("bytes_released") << s.bytes_released;
  key("segments_moved") << s.segments_moved;
  key("release_reclaimed_bytes") << s.release_reclaimed_bytes;
  key("release_queued_bytes") << s.release_queued_bytes;
  key("release_worker_bytes") << s.release_worker_bytes;
  key("release_worker_releases") << s.release_worker_releases;
  os << '}';
}

void memory_snapshot::to_json(std::ostream& os) const {
  os << "{\"device\":" << device << ",\"time_us\":" << time_us << ",\"stats\":";
  write_statistics_json(os, stats);
  os << ",\"segments\":[";
  bool first_seg = true;
  for (const segment_snapshot& seg : segments) {
    std::size_t allocated = 0, active = 0, requested = 0;
    for (const block_snapshot& b : seg.blocks) {
      if (b.state == snapshot_block_state::active) allocated += b.size_bytes;
      if (b.state == snapshot_block_state::active ||
          b.state == snapshot_block_state::pending_free) {
        active += b.size_bytes;
        requested += b.requested_bytes;
      }
    }
    os << (first_seg ? "\n" : ",\n") << "{\"device\":" << device << ",\"address\":" << seg.address
       << ",\"total_size\":" << seg.size_bytes << ",\"mapped_size\":" << seg.mapped_bytes
       << ",\"allocated_size\":" << allocated << ",\"active_size\":" << active
       << ",\"requested_size\":" << requested << ",\"stream\":" << seg.stream
       << ",\"segment_type\":\"" << to_string(seg.pool)
       << "\",\"is_expandable\":" << (seg.expandable ? "true" : "false") << ",\"tag\":\"";
    for (char c : seg.tag) os << (c == '"' || c == '\\' ? "\\" : "") << c;
    os << "\",\"paused_size\":" << seg.paused_bytes << ",\"aliased_size\":" << seg.aliased_bytes
       << ",\"graph_pool\":" << seg.graph_pool << ",\"blocks\":[";
    first_seg = false;
    bool first_block = true;
    for (const block_snapshot& b : seg.blocks) {
      os << (first_block ? "" : ",") << "\n {\"address\":" << b.address
         << ",\"size\":" << b.size_bytes << ",\"requested_size\":" << b.requested_bytes
         << ",\"state\":\"" << json_state(b.state) << "\",\"stream\":" << b.stream
         << ",\"waiting_on\":[";
      for (std::size_t i = 0; i < b.waiting_on.size(); ++i) os << (i ? "," : "") << b.waiting_on[i];
      os << "]}";
      first_block = false;
    }
    os << "]}";
  }
  os << "\n]}\n";
}

namespace {

// The table memory_summary writes: 85 characters between the outer bars.
class summary_table {
 public:
  static constexpr int k_width = 85;
  void heavy_rule() { os_ << '|' << std::string(k_width, '=') << "|\n"; }
  void rule() { os_ << '|' << std::string(k_width, '-') << "|\n"; }
  void centred(const std::string& text) {
    const int pad = k_width - static_cast<int>(text.size());
    const int left = pad > 0 ? pad / 2 : 0;
    os_ << '|' << std::string(static_cast<std::size_t>(left), ' ') << text
        << std::string(static_cast<std::size_t>(pad > 0 ? pad - left : 0), ' ') << "|\n";
  }
  void row(const char* metric, const std::string& a, const std::string& b, const std::string& c,
           const std::string& d) {
    std::snprintf(line_, sizeof line_, "| %-24s| %12s | %12s | %12s | %12s |\n", metric, a.c_str(),
                  b.c_str(), c.c_str(), d.c_str());
    os_ << line_;
  }
  void bytes_row(const char* metric, const stat& st) {
    row(metric, human_bytes(st.current), human_bytes(st.peak), human_bytes(st.allocated),
        human_bytes(st.freed));
  }
  void count_row(const char* metric, const stat& st) {
    row(metric, std::to_string(st.current), std::to_string(st.peak), std::to_string(st.allocated),
        std::to_string(st.freed));
  }
  void counters(const char* k1, const std::string& v1, const char* k2, const std::string& v2) {
    std::snprintf(line_, sizeof line_, "| %-27s %12s | %-27s %12s |\n", k1, v1.c_str(), k2,
                  v2.c_str());
    os_ << line_;
  }
  std::string str() const { return os_.str(); }

 private:
  std::ostringstream os_;
  char line_[256] = {};
};

void summary_counters(summary_table& t, const statistics& s) {
  const double ratio = s.allocated_bytes.peak > 0 ? static_cast<double>(s.reserved_bytes.peak) /
                                                        static_cast<double>(s.allocated_bytes.peak)
                                                  : 0.0;
  char ratio_text[32];
  std::snprintf(ratio_text, sizeof ratio_text, "%.4f", ratio);
  char wait_text[32];
  std::snprintf(wait_text, sizeof wait_text, "%.3f ms", static_cast<double>(s.fence_wait_ns) / 1e6);
  t.counters("Alloc retries", std::to_string(s.num_alloc_retries), "OOMs",
             std::to_string(s.num_ooms));
  t.counters("Device allocs (+maps)", std::to_string(s.num_device_alloc), "Device frees (+unmaps)",
             std::to_string(s.num_device_free));
  t.counters("Syncs of all streams", std::to_string(s.num_sync_all_streams), "Events recorded",
             std::to_string(s.events_recorded));
  t.counters("Stream waits", std::to_string(s.stream_waits), "Segments moved",
             std::to_string(s.segments_moved));
  t.counters("Fence waits", std::to_string(s.fence_waits), "Fence wait time", wait_text);
  t.counters("Releases deferred", std::to_string(s.releases_deferred), "Bytes released",
             human_bytes(static_cast<std::int64_t>(s.bytes_released)));
  t.counters("Peak reserved/allocated", ratio > 0 ? ratio_text : "-", "Release reclaimed",
             human_bytes(static_cast<std::int64_t>(s.release_reclaimed_bytes)));
}

}  // namespace

std::string memory_summary(const statistics& s, int device) {
  summary_table t;
  t.heavy_rule();
  t.centred(device >= 0 ? "streamsafe memory summary, device " + std::to_string(device)
                        : std::string("streamsafe memory summary"));
  t.rule();
  t.row("Metric", "Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed");
  t.rule();
  t.bytes_row("Allocated memory", s.allocated_bytes);
  t.bytes_row("Active memory", s.active_bytes);
  t.bytes_row("Requested memory", s.requested_bytes);
  t.bytes_row("GPU reserved memory", s.reserved_bytes);
  t.bytes_row("Non-releasable memory", s.inactive_split_bytes);
  t.rule();
  t.count_row("Allocations", s.allocation);
  t.count_row("Active allocs", s.active);
  t.count_row("GPU reserved segments", s.segment);
  t.rule();
  summary_counters(t, s);
  t.heavy_rule();
  return t.str();
}

}  // namespace streamsafe
