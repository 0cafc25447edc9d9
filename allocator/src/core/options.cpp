// streamsafe core: parsing of "key:value,key:value" configuration strings.
#include <streamsafe/core/errors.hpp>
#include <streamsafe/core/options.hpp>

#include "segment_fit.hpp"

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

[[noreturn]] void bad_value(std::string_view key, std::string_view value, std::string_view accepted) {
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
std::size_t parse_bytes(std::string_view key, std::string_view value) {
  static constexpr std::string_view accepted =
      "a byte count with an optional suffix K, KB, KiB, M, MB, MiB, G, GB, GiB (powers of 1024)";
  std::size_t digits = 0;
  while (digits < value.size() && ((value[digits] >= '0' && value[digits] <= '9') || value[digits] == '.')) ++digits;
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

template <class Enum>
Enum parse_enum(std::string_view key, std::string_view value,
                std::initializer_list<std::pair<std::string_view, Enum>> choices) {
  std::string accepted;
  for (auto& [name, e] : choices) {
    if (name == value) return e;
    accepted += accepted.empty() ? "" : ", ";
    accepted += name;
  }
  bad_value(key, value, accepted);
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

options options::parse(std::string_view conf, std::vector<std::string>* warnings) {
  options o;
  std::map<std::string, std::string, std::less<>> seen;
  while (!conf.empty()) {
    auto comma = conf.find(',');
    std::string_view item = trim(conf.substr(0, comma));
    conf = comma == std::string_view::npos ? std::string_view{} : conf.substr(comma + 1);
    if (item.empty()) continue;
    auto colon = item.find(':');
    if (colon == std::string_view::npos) {
      throw config_error("streamsafe: STREAMSAFE_ALLOC_CONF item '" + std::string(item) +
                         "' has no ':'; expected key:value");
    }
    std::string_view key = trim(item.substr(0, colon));
    std::string_view value = trim(item.substr(colon + 1));
    if (auto it = seen.find(key); it != seen.end() && warnings) {
      warnings->push_back("streamsafe: key '" + std::string(key) + "' given twice ('" + it->second +
                          "' then '" + std::string(value) + "'); the last one, '" +
                          std::string(value) + "', wins");
    }
    seen[std::string(key)] = std::string(value);

    if (key == "backend") {
      o.backend = parse_enum<backend_kind>(key, value, {{"cuda_malloc", backend_kind::cuda_malloc},
                                                        {"expandable", backend_kind::expandable}});
    } else if (key == "expandable_segments") {
      bool on = parse_enum<bool>(key, value, {{"True", true}, {"true", true}, {"False", false}, {"false", false}});
      o.backend = on ? backend_kind::expandable : backend_kind::cuda_malloc;
    } else if (key == "release_fence") {
      o.release_fence = parse_enum<fence_scope>(
          key, value, {{"used_streams", fence_scope::used_streams}, {"all_streams", fence_scope::all_streams},
                       {"device", fence_scope::device}, {"allocation_stream", fence_scope::allocation_stream}});
    } else if (key == "empty_cache") {
      o.empty_cache = parse_enum<empty_cache_mode>(
          key, value, {{"wait", empty_cache_mode::wait}, {"defer", empty_cache_mode::defer}});
    } else if (key == "max_split_size_mb") {
      double mb = parse_number(key, value, "a size in MiB, at least 20 (0 = no limit)");
      if (mb != 0 && mb < 20) bad_value(key, value, "a size in MiB, at least 20 (0 = no limit)");
      o.max_split_size_bytes = static_cast<std::size_t>(mb * 1024 * 1024);
    } else if (key == "whole_segment_split_ratio") {
      static constexpr std::string_view accepted = "0 (off) or a whole number from 1 to 1024";
      const double r = parse_number(key, value, accepted);
      if (r > static_cast<double>(detail::k_max_whole_segment_ratio) || r != static_cast<double>(static_cast<std::size_t>(r))) {
        bad_value(key, value, accepted);
      }
      o.whole_segment_split_ratio = static_cast<std::size_t>(r);
    } else if (key == "memory_limit") {
      o.memory_limit_bytes = parse_bytes(key, value);
    } else if (key == "memory_fraction" || key == "per_process_memory_fraction") {
      double f = parse_number(key, value, "a fraction in (0, 1]");
      if (f <= 0 || f > 1) bad_value(key, value, "a fraction in (0, 1]");
      o.memory_fraction = f;
    } else if (key == "expandable_chunk_mb") {
      double mb = parse_number(key, value, "a positive multiple of 2 (MiB)");
      auto bytes = static_cast<std::size_t>(mb * 1024 * 1024);
      if (bytes == 0 || bytes % (std::size_t{2} << 20) != 0) bad_value(key, value, "a positive multiple of 2 (MiB)");
      o.expandable_chunk_bytes = bytes;
    } else if (key == "roundup_power2_divisions") {
      double d = parse_number(key, value, "a power of two from 1 to 64 (0 = off)");
      const auto n = static_cast<std::size_t>(d);
      if (static_cast<double>(n) != d || n > 64 || (n & (n - 1)) != 0) {
        bad_value(key, value, "a power of two from 1 to 64 (0 = off)");
      }
      o.roundup_power2_divisions = n;
    } else if (key == "garbage_collection_threshold") {
      double f = parse_number(key, value, "a fraction in (0, 1)");
      if (f <= 0 || f >= 1) bad_value(key, value, "a fraction in (0, 1)");
      o.garbage_collection_threshold = f;
    } else if (key == "max_cached_bytes") {
      o.max_cached_bytes = parse_bytes(key, value);
    } else if (key == "trace_capacity") {
      o.trace_capacity = static_cast<std::size_t>(parse_number(key, value, "a count of trace events (0 = off)"));
    } else {
      throw config_error("streamsafe: unknown STREAMSAFE_ALLOC_CONF key '" + std::string(key) +
                         "'; known keys: backend, expandable_segments, release_fence, empty_cache, "
                         "max_split_size_mb, whole_segment_split_ratio, memory_limit, memory_fraction, expandable_chunk_mb, roundup_power2_divisions, "
                         "garbage_collection_threshold, max_cached_bytes, trace_capacity");
    }
  }
  return o;
}

options options::from_environment(std::vector<std::string>* warnings) {
  const char* conf = std::getenv("STREAMSAFE_ALLOC_CONF");
  return conf ? parse(conf, warnings) : options{};
}

std::string options::to_string() const {
  std::ostringstream os;
  os << "backend:" << streamsafe::to_string(backend) << ",release_fence:" << streamsafe::to_string(release_fence)
     << ",empty_cache:" << streamsafe::to_string(empty_cache)
     << ",max_split_size_mb:" << max_split_size_bytes / (1024 * 1024)
     << ",whole_segment_split_ratio:" << whole_segment_split_ratio
     << ",memory_limit:" << memory_limit_bytes << ",memory_fraction:" << memory_fraction
     << ",expandable_chunk_mb:" << expandable_chunk_bytes / (1024 * 1024) << ",roundup_power2_divisions:" << roundup_power2_divisions
     << ",garbage_collection_threshold:" << garbage_collection_threshold << ",max_cached_bytes:" << max_cached_bytes
     << ",trace_capacity:" << trace_capacity;
  return os.str();
}

}  // namespace streamsafe
