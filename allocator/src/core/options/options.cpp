// streamsafe core: parsing of "key:value,key:value" configuration strings, driven by one table
// of the known keys (k_options). Pure functions: no state, no lock.
#include <streamsafe/core/errors.hpp>
#include <streamsafe/core/options.hpp>

#include "core/blocks/segment_fit.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <map>
#include <sstream>

namespace streamsafe {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

[[noreturn]] void bad_value(std::string_view key, std::string_view value,
                            std::string_view accepted) {
  throw config_error("streamsafe: bad STREAMSAFE_ALLOC_CONF value '" + std::string(value) +
                     "' for key '" + std::string(key) + "'; accepted: " + std::string(accepted));
}

double parse_number(std::string_view key, std::string_view value, std::string_view accepted) {
  std::string text(value);
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || errno != 0 || !(v >= 0)) {
    bad_value(key, value, accepted);
  }
  return v;
}

// "123", "64MB", "2GiB", "512KB": bytes. Suffixes are powers of 1024.
constexpr std::string_view k_bytes_accepted =
    "a byte count with an optional suffix K, KB, KiB, M, MB, MiB, G, GB, GiB (powers of 1024)";

std::size_t parse_bytes(std::string_view key, std::string_view value) {
  constexpr std::string_view accepted = k_bytes_accepted;
  std::size_t digits = 0;
  while (digits < value.size() &&
         ((value[digits] >= '0' && value[digits] <= '9') || value[digits] == '.'))
    ++digits;
  double number = parse_number(key, value.substr(0, digits), accepted);
  std::string suffix(value.substr(digits));
  for (auto& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double scale = 1;
  if (suffix.empty() || suffix == "B") scale = 1;
  else if (suffix == "K" || suffix == "KB" || suffix == "KIB") scale = 1024.0;
  else if (suffix == "M" || suffix == "MB" || suffix == "MIB") scale = 1024.0 * 1024;
  else if (suffix == "G" || suffix == "GB" || suffix == "GIB") scale = 1024.0 * 1024 * 1024;
  else bad_value(key, value, accepted);
  return static_cast<std::size_t>(number * scale);
}

// ---- the option table -------------------------------------------------------------------------
// One row per key: its name, what kind of value it takes, the accepted values (the error
// message's text, and for a choice the names themselves, in enum order), a line of help, how to
// set it and how to show it (null for an alias, which options::to_string skips). The parser, its
// error messages, the list of known keys and to_string all read this table.

struct option_spec;
using setter = void (*)(options& o, const option_spec& spec, std::string_view value);

struct option_spec {
  std::string_view key;
  std::string_view type;      // "choice", "bytes", "number"
  std::string_view accepted;  // a choice's names, separated by ", "
  std::string_view help;
  setter set;
  std::string (*show)(const options& o);
};

[[noreturn]] void bad_value(const option_spec& spec, std::string_view value) {
  bad_value(spec.key, value, spec.accepted);
}

double number(const option_spec& spec, std::string_view value) {
  return parse_number(spec.key, value, spec.accepted);
}

// The position of `value` among the spec's accepted names.
int choice(const option_spec& spec, std::string_view value) {
  std::string_view rest = spec.accepted;
  for (int i = 0; !rest.empty(); ++i) {
    const auto sep = rest.find(", ");
    if (rest.substr(0, sep) == value) return i;
    rest = sep == std::string_view::npos ? std::string_view{} : rest.substr(sep + 2);
  }
  bad_value(spec, value);
}

template <class T>
std::string show_number(T v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

constexpr std::size_t k_mib = std::size_t{1024} * 1024;

// An expandable chunk size, given in MiB: a whole, positive multiple of the 2 MiB granularity,
// at most 1 TiB.
template <std::size_t options::*Field>
void set_chunk_mib(options& o, const option_spec& s, std::string_view v) {
  const double n = number(s, v);
  if (!(n >= 2 && n <= 1024.0 * 1024) || n != static_cast<double>(static_cast<std::size_t>(n)) ||
      static_cast<std::size_t>(n) % 2 != 0)
    bad_value(s, v);
  o.*Field = static_cast<std::size_t>(n) * k_mib;
}

template <std::size_t options::*Field>
std::string show_chunk_mib(const options& o) {
  return show_number(o.*Field / k_mib);
}

void set_memory_fraction(options& o, const option_spec& s, std::string_view v) {
  const double f = number(s, v);
  if (f < 0 || f > 1) bad_value(s, v);  // 0: unused (the default, as to_string writes it)
  o.memory_fraction = f;
}

constexpr std::string_view k_max_split_accepted = "a size in MiB, at least 20 (0 = no limit)";
constexpr std::string_view k_gc_accepted = "0 (off) or a fraction in (0, 1)";
constexpr std::size_t k_max_divisions = 64;

bool divisions_ok(std::size_t d) { return d <= k_max_divisions && (d & (d - 1)) == 0; }

[[noreturn]] void bad_list(const option_spec& s, std::string_view v, const std::string& why) {
  throw config_error("streamsafe: bad STREAMSAFE_ALLOC_CONF value '" + std::string(v) +
                     "' for key '" + std::string(s.key) + "': " + why +
                     "; accepted: " + std::string(s.accepted));
}

// A whole number written in `text`, or false.
bool whole_number(std::string_view text, std::size_t& out) {
  if (text.empty() || text.size() > 18) return false;
  out = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    out = out * 10 + static_cast<std::size_t>(c - '0');
  }
  return true;
}

// PyTorch's list form: "[64:8,128:2,>:1]" (see power2_divisions).
power2_divisions parse_division_list(const option_spec& s, std::string_view v) {
  if (v.size() < 2 || v.back() != ']') bad_list(s, v, "the list has no closing ']'");
  std::string_view rest = v.substr(1, v.size() - 2);
  power2_divisions out;
  bool first = true, tail_given = false;
  std::size_t last_boundary = 0, last_index = 0;
  while (!trim(rest).empty()) {
    const auto comma = rest.find(',');
    const std::string_view entry = trim(rest.substr(0, comma));
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    const auto colon = entry.find(':');
    if (colon == std::string_view::npos)
      bad_list(s, v, "entry '" + std::string(entry) + "' is not boundary:divisions");
    const std::string_view boundary = trim(entry.substr(0, colon));
    const std::string_view count = trim(entry.substr(colon + 1));
    std::size_t d = 0;
    if (!whole_number(count, d) || !divisions_ok(d))
      bad_list(s, v, "divisions '" + std::string(count) + "' is not 0 or a power of two up to 64");
    if (tail_given) bad_list(s, v, "'>' must be the last entry");
    if (boundary == ">") {
      for (std::size_t i = first ? 1 : last_index + 1; i < power2_divisions::k_intervals; ++i)
        out.by_interval[i] = d;
      tail_given = true;
      continue;
    }
    std::size_t mib = 0;
    if (!whole_number(boundary, mib) || mib == 0 || (mib & (mib - 1)) != 0)
      bad_list(s, v, "boundary '" + std::string(boundary) + "' is not a power of two (MiB)");
    if (!first && mib <= last_boundary)
      bad_list(s, v,
               "boundaries must increase ('" + std::string(boundary) + "' after " +
                   std::to_string(last_boundary) + ")");
    // The interval starting at `mib` MiB (mib a power of two; from 32 GiB on, the last).
    const auto log2 = static_cast<std::size_t>(63 - __builtin_clzll(mib));
    const std::size_t index = std::min(log2, power2_divisions::k_intervals - 1);
    for (std::size_t i = first ? 0 : index; i <= index; ++i) out.by_interval[i] = d;
    first = false;
    last_boundary = mib;
    last_index = index;
  }
  return out;
}

void set_divisions(options& o, const option_spec& s, std::string_view v) {
  if (!v.empty() && v.front() == '[') {
    o.roundup_power2_divisions = parse_division_list(s, v);
    return;
  }
  const double d = number(s, v);
  const auto n = static_cast<std::size_t>(d);
  if (static_cast<double>(n) != d || !divisions_ok(n)) bad_value(s, v);
  o.roundup_power2_divisions = n;
}

// One number when every interval agrees, else the list naming every interval up to the last
// that differs from those after it, which '>' covers.
std::string show_divisions(const options& o) {
  const auto& by = o.roundup_power2_divisions.by_interval;
  std::size_t tail_from = by.size() - 1;
  while (tail_from > 0 && by[tail_from - 1] == by.back()) --tail_from;
  if (tail_from == 0) return show_number(by.back());
  std::string out = "[";
  for (std::size_t i = 0; i < tail_from; ++i)
    out += show_number(std::size_t{1} << i) + ":" + show_number(by[i]) + ",";
  return out + ">:" + show_number(by.back()) + "]";
}

const option_spec k_options[] = {
    {"backend", "choice", "cuda_malloc, expandable",
     "how pools grow: one cudaMalloc per segment, or mapped chunks",
     [](options& o, const option_spec& s, std::string_view v) {
       o.backend = static_cast<backend_kind>(choice(s, v));
     },
     [](const options& o) { return std::string(to_string(o.backend)); }},
    {"expandable_segments", "choice", "True, true, False, false",
     "PyTorch's name: True means backend:expandable",
     [](options& o, const option_spec& s, std::string_view v) {
       o.backend = choice(s, v) < 2 ? backend_kind::expandable : backend_kind::cuda_malloc;
     },
     nullptr},
    {"release_fence", "choice", "used_streams, all_streams, device, allocation_stream",
     "which streams a release waits for",
     [](options& o, const option_spec& s, std::string_view v) {
       o.release_fence = static_cast<fence_scope>(choice(s, v));
     },
     [](const options& o) { return std::string(to_string(o.release_fence)); }},
    {"reuse_fence", "choice", "allocation_stream, all_streams",
     "which streams a host free is fenced against before its block is reused",
     [](options& o, const option_spec& s, std::string_view v) {
       o.reuse_fence = static_cast<reuse_fence_scope>(choice(s, v));
     },
     [](const options& o) { return std::string(to_string(o.reuse_fence)); }},
    {"empty_cache", "choice", "wait, defer",
     "whether a release waits on its fence or queues what is not safe yet",
     [](options& o, const option_spec& s, std::string_view v) {
       o.empty_cache = static_cast<empty_cache_mode>(choice(s, v));
     },
     [](const options& o) { return std::string(to_string(o.empty_cache)); }},
    {"release_worker", "choice", "off, on, auto",
     "in defer mode, unmap on a worker thread (auto: on for a real GPU through cuda::allocator)",
     [](options& o, const option_spec& s, std::string_view v) {
       o.release_worker = static_cast<release_worker_mode>(choice(s, v));
     },
     [](const options& o) { return std::string(to_string(o.release_worker)); }},
    {"max_split_size_mb", "number", k_max_split_accepted, "blocks larger than this are never split",
     [](options& o, const option_spec& s, std::string_view v) {
       const double mb = number(s, v);
       if (mb != 0 && mb < 20) bad_value(s, v);
       o.max_split_size_bytes = static_cast<std::size_t>(mb * 1024 * 1024);
     },
     [](const options& o) { return show_number(o.max_split_size_bytes / k_mib); }},
    {"whole_segment_split_ratio", "number", "0 (off) or a whole number from 1 to 1024",
     "a whole free segment this many times a large request stays whole",
     [](options& o, const option_spec& s, std::string_view v) {
       const double r = number(s, v);
       if (r > static_cast<double>(detail::k_max_whole_segment_ratio) ||
           r != static_cast<double>(static_cast<std::size_t>(r))) {
         bad_value(s, v);
       }
       o.whole_segment_split_ratio = static_cast<std::size_t>(r);
     },
     [](const options& o) { return show_number(o.whole_segment_split_ratio); }},
    {"memory_limit", "bytes", k_bytes_accepted, "cap on reserved bytes (0 = the device's memory)",
     [](options& o, const option_spec& s, std::string_view v) {
       o.memory_limit_bytes = parse_bytes(s.key, v);
     },
     [](const options& o) { return show_number(o.memory_limit_bytes); }},
    {"memory_fraction", "number", "0 (unused) or a fraction in (0, 1]",
     "cap on reserved bytes as a fraction of the device's memory", set_memory_fraction,
     [](const options& o) { return show_number(o.memory_fraction); }},
    {"per_process_memory_fraction", "number", "0 (unused) or a fraction in (0, 1]",
     "PyTorch's name for memory_fraction", set_memory_fraction, nullptr},
    {"expandable_chunk_mb", "number", "a whole, even number of MiB from 2 to 1048576",
     "chunk mapped at a time in expandable large pools",
     set_chunk_mib<&options::expandable_chunk_bytes>,
     show_chunk_mib<&options::expandable_chunk_bytes>},
    {"expandable_peak_chunk_mb", "number", "a whole, even number of MiB from 2 to 1048576",
     "chunk of an expandable large-pool growth past the high-water mark of reserved bytes "
     "(at most expandable_chunk_mb)",
     set_chunk_mib<&options::expandable_peak_chunk_bytes>,
     show_chunk_mib<&options::expandable_peak_chunk_bytes>},
    {"expandable_chunks_per_peak", "number", "0 (off) or a whole number from 1 to 65536",
     "an expandable large-pool chunk is at most the reserved high-water mark over this (at least "
     "the granularity, at most expandable_chunk_mb)",
     [](options& o, const option_spec& s, std::string_view v) {
       const double n = number(s, v);
       if (!(n >= 0 && n <= 65536) || n != static_cast<double>(static_cast<std::size_t>(n)))
         bad_value(s, v);
       o.expandable_chunks_per_peak = static_cast<std::size_t>(n);
     },
     [](const options& o) { return show_number(o.expandable_chunks_per_peak); }},
    {"expandable_tag_handle_mb", "number", "a whole, even number of MiB from 2 to 1048576",
     "largest physical handle in which resume maps a paused tag's memory again (at least "
     "expandable_chunk_mb)",
     set_chunk_mib<&options::expandable_tag_handle_bytes>,
     show_chunk_mib<&options::expandable_tag_handle_bytes>},
    {"roundup_power2_divisions", "number",
     "0 (off) or a power of two up to 64, or PyTorch's list "
     "[boundary_mib:divisions,...,>:divisions] with power-of-two boundaries in increasing order",
     "round requests to this many steps per power of two (a list: per size interval)",
     set_divisions, show_divisions},
    {"garbage_collection_threshold", "number", k_gc_accepted,
     "release free cached segments before growing past this fraction of the limit",
     [](options& o, const option_spec& s, std::string_view v) {
       const double f = number(s, v);
       if (f < 0 || f >= 1) bad_value(s, v);  // 0: off (the default, as to_string writes it)
       o.garbage_collection_threshold = f;
     },
     [](const options& o) { return show_number(o.garbage_collection_threshold); }},
    {"offload_keep_host", "choice", "True, true, False, false",
     "keep offload's pinned host backup between switches (False: given back after each resume)",
     [](options& o, const option_spec& s, std::string_view v) {
       o.offload_keep_host = choice(s, v) < 2;
     },
     [](const options& o) { return std::string(o.offload_keep_host ? "True" : "False"); }},
    {"graph_capture_record_stream_reuse", "choice", "True, true, False, false",
     "reuse, inside a CUDA graph capture, a block freed with side-stream uses once the capturing "
     "stream follows them (False: held until the capture ends)",
     [](options& o, const option_spec& s, std::string_view v) {
       o.graph_capture_record_stream_reuse = choice(s, v) < 2;
     },
     [](const options& o) {
       return std::string(o.graph_capture_record_stream_reuse ? "True" : "False");
     }},
    {"max_cached_bytes", "bytes", k_bytes_accepted,
     "release free cached segments before growing past this many cached bytes",
     [](options& o, const option_spec& s, std::string_view v) {
       o.max_cached_bytes = parse_bytes(s.key, v);
     },
     [](const options& o) { return show_number(o.max_cached_bytes); }},
    {"trace_capacity", "number", "a count of trace events (0 = off)",
     "events kept in the allocator's trace ring",
     [](options& o, const option_spec& s, std::string_view v) {
       o.trace_capacity = static_cast<std::size_t>(number(s, v));
     },
     [](const options& o) { return show_number(o.trace_capacity); }},
};

const option_spec* find_option(std::string_view key) {
  for (const option_spec& spec : k_options) {
    if (spec.key == key) return &spec;
  }
  return nullptr;
}

std::string known_keys() {
  std::string keys;
  for (const option_spec& spec : k_options)
    keys += (keys.empty() ? "" : ", ") + std::string(spec.key);
  return keys;
}

// Where the item at the start of conf ends: its first ',' outside brackets (npos: at the end).
std::size_t item_end(std::string_view conf) {
  int depth = 0;
  for (std::size_t i = 0; i < conf.size(); ++i) {
    if (conf[i] == '[') ++depth;
    else if (conf[i] == ']' && depth > 0) --depth;
    else if (conf[i] == ',' && depth == 0) return i;
  }
  return std::string_view::npos;
}

// Splits "key:value" (trimmed); throws when there is no ':'.
std::pair<std::string_view, std::string_view> split_item(std::string_view item) {
  const auto colon = item.find(':');
  if (colon == std::string_view::npos) {
    throw config_error("streamsafe: STREAMSAFE_ALLOC_CONF item '" + std::string(item) +
                       "' has no ':'; expected key:value");
  }
  return {trim(item.substr(0, colon)), trim(item.substr(colon + 1))};
}

}  // namespace

const char* to_string(fence_scope scope) noexcept {
  switch (scope) {
    case fence_scope::used_streams: return "used_streams";
    case fence_scope::all_streams: return "all_streams";
    case fence_scope::device: return "device";
    case fence_scope::allocation_stream: return "allocation_stream";
  }
  return "?";
}

const char* to_string(empty_cache_mode mode) noexcept {
  return mode == empty_cache_mode::wait ? "wait" : "defer";
}

const char* to_string(backend_kind kind) noexcept {
  return kind == backend_kind::cuda_malloc ? "cuda_malloc" : "expandable";
}

const char* to_string(release_worker_mode mode) noexcept {
  switch (mode) {
    case release_worker_mode::off: return "off";
    case release_worker_mode::on: return "on";
    case release_worker_mode::automatic: return "auto";
  }
  return "?";
}

const char* to_string(reuse_fence_scope scope) noexcept {
  return scope == reuse_fence_scope::allocation_stream ? "allocation_stream" : "all_streams";
}

std::size_t power2_divisions::interval_of(std::size_t size_bytes) noexcept {
  constexpr int k_first_log2 = 20;  // interval 1 starts at 2 MiB, interval 15 at 32 GiB
  if (size_bytes < (std::size_t{2} << k_first_log2)) return 0;
  const int log2 = 63 - __builtin_clzll(static_cast<unsigned long long>(size_bytes));
  const auto index = static_cast<std::size_t>(log2 - k_first_log2);
  return index < k_intervals ? index : k_intervals - 1;
}

bool power2_divisions::any() const noexcept {
  for (std::size_t d : by_interval)
    if (d > 1) return true;
  return false;
}

runtime_options runtime_options::of(const options& o) noexcept {
  return {o.max_split_size_bytes, o.garbage_collection_threshold, o.roundup_power2_divisions,
          o.graph_capture_record_stream_reuse};
}

void runtime_options::apply_to(options& o) const noexcept {
  o.max_split_size_bytes = max_split_size_bytes;
  o.garbage_collection_threshold = garbage_collection_threshold;
  o.roundup_power2_divisions = roundup_power2_divisions;
  o.graph_capture_record_stream_reuse = graph_capture_record_stream_reuse;
}

void runtime_options::validate() const {
  auto refuse = [](std::string_view key, const std::string& value) {
    throw config_error("streamsafe: bad runtime option " + std::string(key) + ":" + value +
                       "; accepted: " + std::string(find_option(key)->accepted) +
                       " (nothing changed)");
  };
  if (max_split_size_bytes != 0 && max_split_size_bytes < 20 * k_mib)
    refuse("max_split_size_mb",
           show_number(static_cast<double>(max_split_size_bytes) / static_cast<double>(k_mib)));
  if (!(garbage_collection_threshold >= 0 && garbage_collection_threshold < 1))
    refuse("garbage_collection_threshold", show_number(garbage_collection_threshold));
  for (std::size_t i = 0; i < power2_divisions::k_intervals; ++i) {
    if (!divisions_ok(roundup_power2_divisions.by_interval[i]))
      refuse("roundup_power2_divisions",
             show_number(roundup_power2_divisions.by_interval[i]) + " (interval from " +
                 show_number(i == 0 ? 0 : std::size_t{1} << i) + " MiB)");
  }
}

options options::parse(std::string_view conf, std::vector<std::string>* warnings) {
  options o;
  std::map<std::string, std::string, std::less<>> seen;
  while (!conf.empty()) {
    const auto comma = item_end(conf);
    const std::string_view item = trim(conf.substr(0, comma));
    conf = comma == std::string_view::npos ? std::string_view{} : conf.substr(comma + 1);
    if (item.empty()) continue;
    const auto [key, value] = split_item(item);
    if (auto it = seen.find(key); it != seen.end() && warnings) {
      warnings->push_back("streamsafe: key '" + std::string(key) + "' given twice ('" + it->second +
                          "' then '" + std::string(value) + "'); the last one, '" +
                          std::string(value) + "', wins");
    }
    seen[std::string(key)] = std::string(value);
    const option_spec* spec = find_option(key);
    if (!spec) {
      throw config_error("streamsafe: unknown STREAMSAFE_ALLOC_CONF key '" + std::string(key) +
                         "'; known keys: " + known_keys());
    }
    spec->set(o, *spec, value);
  }
  return o;
}

options options::from_environment(std::vector<std::string>* warnings) {
  const char* conf = std::getenv("STREAMSAFE_ALLOC_CONF");
  return conf ? parse(conf, warnings) : options{};
}

std::string options::to_string() const {
  std::string out;
  for (const option_spec& spec : k_options) {
    if (spec.show) out += (out.empty() ? "" : ",") + std::string(spec.key) + ":" + spec.show(*this);
  }
  return out;
}

}  // namespace streamsafe
