// streamsafe-replay: trace parsing (PyTorch-style and RMM CSV) into a replay program.
//
// One parser object per read: it takes lines one at a time (from an std::istream or from zlib),
// recognises the format on the first line that is not blank or a comment, then turns each data
// line into at most one replay_step. Live blocks are tracked by trace address -> slot so that
// frees resolve to slots here, once, and the replay loop indexes a vector. Bad lines are
// collected (or thrown, strict); nothing here can crash on any input: every field access is
// bounds-checked and numbers are parsed without exceptions.
#include "trace_reader.hpp"

#include <streamsafe/core/trace.hpp>

#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <memory>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace streamsafe::replay {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '"'))
    s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '"' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// Digits only, no sign; base 16 when hex is set or the text starts with 0x. False on overflow.
bool parse_u64(std::string_view s, std::uint64_t& out, bool hex = false) {
  if (s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
    s.remove_prefix(2);
    hex = true;
  }
  if (s.empty()) return false;
  const std::uint64_t base = hex ? 16 : 10;
  std::uint64_t v = 0;
  for (char c : s) {
    std::uint64_t d;
    if (c >= '0' && c <= '9') d = static_cast<std::uint64_t>(c - '0');
    else if (hex && c >= 'a' && c <= 'f') d = static_cast<std::uint64_t>(c - 'a' + 10);
    else if (hex && c >= 'A' && c <= 'F') d = static_cast<std::uint64_t>(c - 'A' + 10);
    else return false;
    if (v > (~std::uint64_t{0} - d) / base) return false;
    v = v * base + d;
  }
  out = v;
  return true;
}

// "123.456789" seconds -> microseconds, exactly (the fraction is cut at 6 digits).
bool parse_seconds_us(std::string_view s, std::uint64_t& us) {
  const auto dot = s.find('.');
  std::uint64_t whole = 0, frac = 0;
  if (!parse_u64(s.substr(0, dot), whole)) return false;
  if (dot != std::string_view::npos) {
    std::string digits(s.substr(dot + 1, 6));
    if (digits.empty() && s.size() == dot + 1) digits = "0";
    while (digits.size() < 6) digits += '0';
    if (!parse_u64(digits, frac)) return false;
    if (s.size() > dot + 7) {  // further digits must still be digits
      std::uint64_t ignored;
      if (!parse_u64(s.substr(dot + 7), ignored)) return false;
    }
  }
  if (whole > 18'000'000'000'000ull) return false;  // would overflow in microseconds
  us = whole * 1'000'000 + frac;
  return true;
}

std::string quote(std::string_view line) {
  std::string out = "\"";
  out += line.substr(0, 120);
  if (line.size() > 120) out += "...";
  out += '"';
  return out;
}

// Column positions, -1 when absent.
struct columns {
  int time = -1, action = -1, address = -1, size = -1, stream = -1;
  int needed() const { return std::max({time, action, address, size, stream}) + 1; }
};

class parser {
 public:
  explicit parser(const read_options& opts) : opts_(opts) {}

  void feed(std::string_view line) {
    ++line_no_;
    ++prog_.lines;
    while (!line.empty() && (line.back() == '\r' || line.back() == '\n')) line.remove_suffix(1);
    if (line_no_ == 1 && line.substr(0, 3) == "\xEF\xBB\xBF") line.remove_prefix(3);  // UTF-8 BOM
    std::string_view t = trim(line);
    if (t.empty() || t.front() == '#') return;
    split(line);
    if (!have_format_) {
      detect();
      if (is_header_) return;
    }
    data_line(line);
  }

  // A problem with the file as a whole after `line_no_` lines (e.g. truncated compressed data).
  void file_problem(const std::string& message) { bad(line_no_ + 1, message); }

  replay_program finish() {
    if (!have_format_ && !opts_.format) {
      throw trace_parse_error(0, "no data: the trace has no header and no event line");
    }
    prog_.live_at_end = live_.size();
    prog_.slot_count = next_slot_;
    return std::move(prog_);
  }

 private:
  void split(std::string_view line) {
    fields_.clear();
    std::size_t start = 0;
    while (true) {
      const auto comma = line.find(',', start);
      fields_.push_back(
          trim(line.substr(start, comma == std::string_view::npos ? line.npos : comma - start)));
      if (comma == std::string_view::npos) break;
      start = comma + 1;
    }
  }

  void detect() {
    have_format_ = true;
    std::vector<std::string> names;
    for (auto f : fields_) names.push_back(lower(f));
    auto find = [&](std::initializer_list<const char*> options) {
      for (const char* o : options) {
        auto it = std::find(names.begin(), names.end(), o);
        if (it != names.end()) return static_cast<int>(it - names.begin());
      }
      return -1;
    };
    const bool has_action = find({"action"}) >= 0;
    const bool rmm_header = has_action && find({"pointer"}) >= 0;
    const bool pytorch_header = has_action && find({"address", "addr"}) >= 0;
    if (rmm_header || pytorch_header) {
      is_header_ = true;
      format_ = rmm_header ? trace_format::rmm : trace_format::pytorch;
      if (opts_.format && *opts_.format != format_) {
        throw trace_parse_error(line_no_, std::string("the header is that of the ") +
                                              to_string(format_) + " format, but the " +
                                              to_string(*opts_.format) + " format was asked for");
      }
      if (format_ == trace_format::rmm) {
        cols_ = {find({"time"}), find({"action"}), find({"pointer"}), find({"size"}),
                 find({"stream"})};
      } else {
        cols_ = {find({"time_us", "time"}), find({"action"}), find({"address", "addr"}),
                 find({"size"}), find({"stream"})};
      }
      if (cols_.size < 0) throw trace_parse_error(line_no_, "the header has no 'size' column");
      prog_.format = format_;
      return;
    }
    // No header: the forced format, or a guess from the first event line; canonical column order.
    auto pytorch_action = [&](std::string_view a) {
      return parse_trace_action(a) || a == "snapshot" || a == "workspace_snapshot";
    };
    auto rmm_action = [&](std::string_view a) {
      return a == "allocate" || a == "free" || a == "deallocate" || a == "allocate failure";
    };
    if (opts_.format) {
      format_ = *opts_.format;
    } else if (fields_.size() >= 5 && pytorch_action(fields_[1])) {
      format_ = trace_format::pytorch;
    } else if (fields_.size() >= 6 && rmm_action(lower(fields_[2]))) {
      format_ = trace_format::rmm;
    } else {
      throw trace_parse_error(line_no_,
                              "unrecognised trace format: expected a header "
                              "'time_us,action,address,size,stream' (PyTorch style) or "
                              "'Thread,Time,Action,Pointer,Size,Stream' (RMM), found " +
                                  quote(fields_.empty() ? std::string_view{} : fields_[0]));
    }
    cols_ = format_ == trace_format::rmm ? columns{1, 2, 3, 4, 5} : columns{0, 1, 2, 3, 4};
    prog_.format = format_;
  }

  void bad(std::size_t line, std::string message) {
    if (opts_.strict) throw trace_parse_error(line, message);
    prog_.bad_lines.push_back({line, std::move(message)});
  }

  std::uint32_t stream_index(std::uint64_t id) {
    auto [it, inserted] = streams_.emplace(id,
                                           static_cast<std::uint32_t>(prog_.trace_streams.size()));
    if (inserted) prog_.trace_streams.push_back(id);
    return it->second;
  }

  bool field_u64(int col, std::string_view what, std::string_view line, std::uint64_t& out,
                 bool hex = false) {
    if (col < 0) {
      out = 0;
      return true;
    }
    if (parse_u64(fields_[static_cast<std::size_t>(col)], out, hex)) return true;
    bad(line_no_, "bad " + std::string(what) + " '" +
                      std::string(fields_[static_cast<std::size_t>(col)].substr(0, 40)) + "' in " +
                      quote(line));
    return false;
  }

  bool rmm_time(std::string_view s, std::uint64_t& us) {
    if (s.find(':') == std::string_view::npos) return parse_seconds_us(s, us);
    // HH:MM:SS:micro or HH:MM:SS.fraction: time of day; a step back of more than 12 h is a new day.
    std::uint64_t parts[4] = {0, 0, 0, 0};
    std::size_t n = 0, start = 0;
    std::string_view seconds_text;
    while (n < 4) {
      const auto colon = s.find(':', start);
      std::string_view part = s.substr(start,
                                       colon == std::string_view::npos ? s.npos : colon - start);
      if (n == 2) seconds_text = part;
      if (n == 2 && part.find('.') != std::string_view::npos) {
        if (!parse_seconds_us(part, parts[2])) return false;
      } else if (!parse_u64(part, parts[n])) {
        return false;
      } else if (n == 2) {
        parts[2] *= 1'000'000;
      }
      ++n;
      if (colon == std::string_view::npos) break;
      start = colon + 1;
    }
    if (n < 3 || parts[0] > 23 || parts[1] > 59 || parts[2] >= 61'000'000 || parts[3] > 999'999)
      return false;
    if (n == 4 && seconds_text.find('.') != std::string_view::npos) return false;
    std::uint64_t of_day = (parts[0] * 3600 + parts[1] * 60) * 1'000'000 + parts[2] + parts[3];
    constexpr std::uint64_t day = 86'400'000'000ull;
    if (have_time_of_day_ && of_day + day / 2 < last_time_of_day_) day_offset_ += day;
    have_time_of_day_ = true;
    last_time_of_day_ = of_day;
    us = day_offset_ + of_day;
    return true;
  }

  void data_line(std::string_view line) {
    if (static_cast<int>(fields_.size()) < cols_.needed()) {
      bad(line_no_, "expected " + std::to_string(cols_.needed()) + " fields, found " +
                        std::to_string(fields_.size()) + ": " + quote(line));
      return;
    }
    const std::string_view action_text = fields_[static_cast<std::size_t>(cols_.action)];
    enum class kind { alloc, free, free_completed, segment_add, segment_remove, other } k;
    if (format_ == trace_format::pytorch) {
      auto a = parse_trace_action(action_text);
      if (!a) {
        if (action_text == "snapshot" || action_text == "workspace_snapshot") {
          ++prog_.other_rows;
          return;
        }
        bad(line_no_,
            "unknown action '" + std::string(action_text.substr(0, 40)) + "' in " + quote(line));
        return;
      }
      switch (*a) {
        case trace_action::alloc: k = kind::alloc; break;
        case trace_action::free_requested: k = kind::free; break;
        case trace_action::free_completed: k = kind::free_completed; break;
        case trace_action::segment_alloc:
        case trace_action::segment_map: k = kind::segment_add; break;
        case trace_action::segment_free:
        case trace_action::segment_unmap: k = kind::segment_remove; break;
        default: k = kind::other; break;
      }
    } else {
      const std::string a = lower(action_text);
      if (a == "allocate") k = kind::alloc;
      else if (a == "free" || a == "deallocate") k = kind::free;
      else if (a == "allocate failure" || a == "allocate_failure") k = kind::other;
      else {
        bad(line_no_,
            "unknown action '" + std::string(action_text.substr(0, 40)) + "' in " + quote(line));
        return;
      }
    }

    std::uint64_t time_us = 0, address = 0, size = 0, stream = 0;
    if (cols_.time >= 0) {
      const std::string_view text = fields_[static_cast<std::size_t>(cols_.time)];
      const bool ok = format_ == trace_format::rmm ? rmm_time(text, time_us)
                                                   : parse_u64(text, time_us);
      if (!ok) {
        bad(line_no_, "bad time '" + std::string(text.substr(0, 40)) + "' in " + quote(line));
        return;
      }
    }
    if (!field_u64(cols_.address, format_ == trace_format::rmm ? "pointer" : "address", line,
                   address, format_ == trace_format::rmm) ||
        !field_u64(cols_.size, "size", line, size) ||
        !field_u64(cols_.stream, "stream", line, stream)) {
      return;
    }
    if (k == kind::other) {
      ++prog_.other_rows;
      return;
    }
    if (k == kind::segment_add || k == kind::segment_remove) {
      ++prog_.segment_rows;
      if (k == kind::segment_add) {
        recorded_reserved_ += size;
        prog_.recorded_reserved_peak = std::max(prog_.recorded_reserved_peak, recorded_reserved_);
      } else {
        recorded_reserved_ -= std::min(recorded_reserved_, size);
      }
      return;
    }
    if (k == kind::alloc) {
      if (size == 0 || address == 0) {
        ++prog_.zero_size_allocs;
        if (address != 0) zero_live_.insert(address);
        return;
      }
      if (auto it = live_.find(address); it != live_.end()) {
        bad(line_no_, "alloc at address " + std::to_string(address) + ", still live since line " +
                          std::to_string(it->second.line) + " (its free is missing)");
        return;
      }
      std::uint32_t slot;
      if (!free_slots_.empty()) {
        slot = free_slots_.back();
        free_slots_.pop_back();
      } else {
        slot = next_slot_++;
      }
      const std::uint32_t s = stream_index(stream);
      live_.emplace(address, live_block{slot, static_cast<std::size_t>(size),
                                        static_cast<std::uint32_t>(line_no_)});
      prog_.steps.push_back({time_us, static_cast<std::size_t>(size), slot, s, true,
                             static_cast<std::uint32_t>(line_no_)});
      ++prog_.allocs;
      requested_ += size;
      prog_.requested_peak = std::max(prog_.requested_peak, requested_);
      return;
    }
    // free / free_completed
    auto it = live_.find(address);
    if (it == live_.end()) {
      if (address == 0 || zero_live_.erase(address) != 0) {
        ++prog_.zero_size_allocs;
        return;
      }
      if (k == kind::free_completed) {
        ++prog_.ignored_free_completed;  // the free_requested before it did the work
        return;
      }
      bad(line_no_, "free of address " + std::to_string(address) +
                        ", which no live alloc holds: " + quote(line));
      return;
    }
    const live_block b = it->second;
    live_.erase(it);
    free_slots_.push_back(b.slot);
    prog_.steps.push_back({time_us, b.size, b.slot, stream_index(stream), false,
                           static_cast<std::uint32_t>(line_no_)});
    ++prog_.frees;
    requested_ -= b.size;
  }

  struct live_block {
    std::uint32_t slot;
    std::size_t size;
    std::uint32_t line;
  };

  read_options opts_;
  replay_program prog_;
  std::size_t line_no_ = 0;
  bool have_format_ = false;
  bool is_header_ = false;
  trace_format format_ = trace_format::pytorch;
  columns cols_;
  std::vector<std::string_view> fields_;
  std::unordered_map<std::uint64_t, live_block> live_;
  std::unordered_set<std::uint64_t> zero_live_;
  std::unordered_map<std::uint64_t, std::uint32_t> streams_;
  std::vector<std::uint32_t> free_slots_;
  std::uint32_t next_slot_ = 0;
  std::uint64_t recorded_reserved_ = 0;
  std::uint64_t requested_ = 0;
  bool have_time_of_day_ = false;
  std::uint64_t last_time_of_day_ = 0;
  std::uint64_t day_offset_ = 0;
};

struct gz_closer {
  void operator()(gzFile_s* f) const noexcept { gzclose(f); }
};

}  // namespace

const char* to_string(trace_format format) noexcept {
  return format == trace_format::rmm ? "rmm" : "pytorch";
}

replay_program read_trace(std::istream& in, const read_options& opts) {
  parser p(opts);
  std::string line;
  while (std::getline(in, line)) p.feed(line);
  return p.finish();
}

replay_program read_trace_text(std::string_view text, const read_options& opts) {
  parser p(opts);
  std::size_t start = 0;
  while (start < text.size()) {
    auto nl = text.find('\n', start);
    if (nl == std::string_view::npos) nl = text.size();
    p.feed(text.substr(start, nl - start));
    start = nl + 1;
  }
  return p.finish();
}

replay_program read_trace_file(const std::string& path, const read_options& opts) {
  errno = 0;
  std::unique_ptr<gzFile_s, gz_closer> f(gzopen(path.c_str(), "rb"));
  if (!f) {
    throw trace_parse_error(0, "cannot open " + path + ": " +
                                   (errno ? std::strerror(errno) : "zlib could not allocate"));
  }
  gzbuffer(f.get(), 1 << 17);
  parser p(opts);
  std::vector<char> buf(1 << 16);
  std::string partial;
  int n;
  while ((n = gzread(f.get(), buf.data(), static_cast<unsigned>(buf.size()))) > 0) {
    std::string_view chunk(buf.data(), static_cast<std::size_t>(n));
    std::size_t start = 0;
    while (true) {
      const auto nl = chunk.find('\n', start);
      if (nl == std::string_view::npos) {
        partial.append(chunk.substr(start));
        break;
      }
      if (partial.empty()) {
        p.feed(chunk.substr(start, nl - start));
      } else {
        partial.append(chunk.substr(start, nl - start));
        p.feed(partial);
        partial.clear();
      }
      start = nl + 1;
    }
  }
  int err = Z_OK;
  const char* message = gzerror(f.get(), &err);
  if (!partial.empty()) p.feed(partial);
  if (n < 0 || (err != Z_OK && err != Z_STREAM_END)) {
    const std::string what = path + ": " +
                             (err == Z_BUF_ERROR ? "the compressed data ends early (truncated file)"
                                                 : std::string("decompression failed: ") + message);
    p.file_problem(what);  // throws in strict mode
  }
  return p.finish();
}

}  // namespace streamsafe::replay
