// streamsafe benchmarks: the allocation trace that scenario 6 replays (no CUDA header).
//
// Reads a PyTorch allocator trace in the CSV form of shared/traces/README.md
// (time_us,action,address,size,stream; gzip-compressed when the name ends in .gz, read through
// `gzip -dc`) and turns it into a flat list of operations on numbered slots, so a replay does
// no lookup: `alloc` takes a free slot, `free_requested` frees the slot its address holds.
// `free_completed` and `segment_*` rows are PyTorch's own bookkeeping and are skipped (the
// trace has one stream, where free_completed follows free_requested at once).
//
// Which file: $STREAMSAFE_BENCH_TRACE, else <source>/../shared/traces/gpt2_fixed_adamw.csv.gz,
// else <source>/shared/traces/gpt2_fixed_adamw.csv.gz (source = the project root, compiled in
// as STREAMSAFE_BENCH_SOURCE_DIR).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <unordered_map>
#include <vector>

#ifndef STREAMSAFE_BENCH_SOURCE_DIR
#define STREAMSAFE_BENCH_SOURCE_DIR "."
#endif

namespace streamsafe_bench {

struct trace_op {
  bool allocate = false;
  std::uint32_t slot = 0;
  std::size_t size_bytes = 0;  // allocations only
};

struct trace {
  std::string path;
  std::string error;  // empty when loaded
  std::vector<trace_op> ops;
  std::size_t slots = 0;
  std::size_t allocations = 0;
  std::size_t frees = 0;
  std::size_t skipped_rows = 0;  // frees of unknown addresses, zero sizes, malformed rows
  // Peak of the live bytes, each request rounded up to 512 (the allocated_bytes that PyTorch and
  // streamsafe report), reached by the program itself whatever the allocator.
  std::size_t peak_allocated_bytes = 0;

  bool ok() const { return error.empty(); }
};

namespace detail {

inline bool file_exists(const std::string& path) {
  if (std::FILE* f = std::fopen(path.c_str(), "rb")) {
    std::fclose(f);
    return true;
  }
  return false;
}

inline std::string resolve_trace_path() {
  if (const char* env = std::getenv("STREAMSAFE_BENCH_TRACE"); env != nullptr && *env != '\0')
    return env;
  const std::string root = STREAMSAFE_BENCH_SOURCE_DIR;
  for (const char* candidate :
       {"/../shared/traces/gpt2_fixed_adamw.csv.gz", "/shared/traces/gpt2_fixed_adamw.csv.gz"}) {
    if (file_exists(root + candidate)) return root + candidate;
  }
  return root + "/../shared/traces/gpt2_fixed_adamw.csv.gz";
}

inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Splits one CSV row into its five fields; false when it has fewer.
inline bool split_row(const std::string& line, std::string fields[5]) {
  std::size_t start = 0;
  for (int i = 0; i < 5; ++i) {
    const std::size_t comma = line.find(',', start);
    if (i < 4 && comma == std::string::npos) return false;
    fields[i] = line.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    start = comma + 1;
  }
  return true;
}

inline trace parse_trace(const std::string& path) {
  trace t;
  t.path = path;
  if (!file_exists(path)) {
    t.error = "trace not found: " + path + " (set STREAMSAFE_BENCH_TRACE)";
    return t;
  }
  const bool gz = path.size() > 3 && path.compare(path.size() - 3, 3, ".gz") == 0;
  std::FILE* in = gz ? popen(("gzip -dc -- " + shell_quote(path)).c_str(), "r")
                     : std::fopen(path.c_str(), "r");
  if (in == nullptr) {
    t.error = "cannot read trace " + path;
    return t;
  }
  std::unordered_map<std::uint64_t, std::uint32_t> slot_of;  // live address -> slot
  std::vector<std::uint32_t> free_slots;
  std::size_t live_bytes = 0;
  std::vector<std::size_t> slot_bytes;
  std::string line, fields[5];
  char buf[512];
  bool header = true;
  while (std::fgets(buf, sizeof buf, in) != nullptr) {
    line.assign(buf);
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
    if (header) {
      header = false;
      if (line.rfind("time_us", 0) == 0) continue;
    }
    if (line.empty()) continue;
    if (!split_row(line, fields)) {
      ++t.skipped_rows;
      continue;
    }
    const std::string& action = fields[1];
    const std::uint64_t address = std::strtoull(fields[2].c_str(), nullptr, 10);
    const std::size_t size = std::strtoull(fields[3].c_str(), nullptr, 10);
    if (action == "alloc") {
      if (size == 0 || slot_of.count(address) != 0) {
        ++t.skipped_rows;
        continue;
      }
      std::uint32_t slot;
      if (!free_slots.empty()) {
        slot = free_slots.back();
        free_slots.pop_back();
      } else {
        slot = static_cast<std::uint32_t>(t.slots++);
        slot_bytes.push_back(0);
      }
      slot_of.emplace(address, slot);
      const std::size_t rounded = (size + 511) / 512 * 512;
      slot_bytes[slot] = rounded;
      live_bytes += rounded;
      if (live_bytes > t.peak_allocated_bytes) t.peak_allocated_bytes = live_bytes;
      t.ops.push_back(trace_op{true, slot, size});
      ++t.allocations;
    } else if (action == "free_requested") {
      const auto it = slot_of.find(address);
      if (it == slot_of.end()) {
        ++t.skipped_rows;
        continue;
      }
      const std::uint32_t slot = it->second;
      slot_of.erase(it);
      free_slots.push_back(slot);
      live_bytes -= slot_bytes[slot];
      t.ops.push_back(trace_op{false, slot, 0});
      ++t.frees;
    }
  }
  const int status = gz ? pclose(in) : std::fclose(in);
  if (status != 0)
    t.error = "reading trace " + path + " failed (status " + std::to_string(status) + ")";
  else if (t.ops.empty()) t.error = "trace " + path + " holds no alloc / free_requested rows";
  return t;
}

}  // namespace detail

// The trace, read once (thread-safe initialisation).
inline const trace& load_trace() {
  static const trace t = detail::parse_trace(detail::resolve_trace_path());
  return t;
}

}  // namespace streamsafe_bench
