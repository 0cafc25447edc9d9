// streamsafe-replay: replays an allocation trace through streamsafe's caching allocator on the
// simulated device (default) or a GPU, and reports speed (events/s) and memory efficiency
// (peak reserved / peak allocated); optionally writes the replay's trace, the snapshot at the
// peak and an HTML picture. Run with --help for the options and exit statuses.
//
// Single-threaded; all the work is in streamsafe_replay_lib (trace_reader, replay,
// html_report), this file only parses the command line and prints.
#include "core/common/format.hpp"

#include "html_report.hpp"
#include "repeat.hpp"
#include "replay.hpp"
#include "trace_reader.hpp"

#include <streamsafe/core/errors.hpp>
#include <streamsafe/core/options.hpp>
#include <streamsafe/core/trace.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>

namespace {

using namespace streamsafe;
using namespace streamsafe::replay;
using streamsafe::detail::with_commas;

constexpr int k_exit_ok = 0, k_exit_usage = 1, k_exit_rejected = 2, k_exit_ratio = 3;

const char* k_usage = R"(usage: streamsafe-replay [options] TRACE

Replays an allocation trace through streamsafe's caching allocator and reports events/s, peak
allocated and reserved bytes and their ratio, and segment operations. TRACE is a PyTorch-style
CSV (time_us,action,address,size,stream: shared/traces, streamsafe's own trace) or RAPIDS RMM's
logging CSV (Thread,Time,Action,Pointer,Size,Stream), plain or gzip-compressed.

  --conf KEY:VALUE,...     allocator options, STREAMSAFE_ALLOC_CONF syntax
                           (default: STREAMSAFE_ALLOC_CONF, else streamsafe's defaults)
  --format auto|pytorch|rmm  trace format (default auto: from the header line)
  --strict                 reject the trace at its first malformed line (exit 2);
                           default: report malformed lines with their number and skip them
  --device-memory SIZE     memory of the simulated device (default 141GiB)
  --gpu[=N]                replay on GPU N (default 0) with streamsafe's CUDA backends
  --passes N               timed passes, the fastest counts (default 3)
  --repeat N               replay the trace N times back to back (default 1); what the trace
                           never frees is allocated once; prints each repetition's segment
                           operations, ratio and host time (fastest timed pass): the later
                           ones are the steady state
  --out FILE               write the replay's trace: FILE.json as JSON, else CSV
  --snapshot FILE          write the memory snapshot at the peak of allocated bytes (JSON)
  --html FILE              write an HTML report: bytes over time and the segment map at the peak
  --max-ratio R            exit 3 when peak reserved / peak allocated is above R
  --show-bad-lines N       malformed lines printed (default 20; all are counted)
  -h, --help               this text

Exit status: 0 done, 1 usage or I/O error, 2 trace rejected (--strict or unknown format),
3 ratio above --max-ratio.
)";

std::string human(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  char buf[48];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

std::string bytes_text(std::int64_t b) {
  return with_commas(static_cast<std::uint64_t>(b < 0 ? 0 : b)) + " B (" +
         human(static_cast<double>(b)) + ")";
}

std::string fixed(double v, int digits) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string base_name(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

struct cli {
  std::string trace_path;
  std::optional<std::string> conf;
  read_options read;
  std::size_t device_bytes = std::size_t{141} << 30;
  std::optional<int> gpu;
  int passes = 3;
  std::size_t repeat = 1;
  std::string out, snapshot, html;
  std::optional<double> max_ratio;
  std::size_t show_bad_lines = 20;
};

[[noreturn]] void usage_error(const std::string& message) {
  std::cerr << "streamsafe-replay: " << message << "\n(run with --help for the options)\n";
  std::exit(k_exit_usage);
}

cli parse_args(int argc, char** argv) {
  cli c;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string value;
    const auto eq = a.find('=');
    const bool has_inline = a.rfind("--", 0) == 0 && eq != std::string::npos;
    if (has_inline) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
    }
    auto next = [&]() -> std::string {
      if (has_inline) return value;
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    auto number = [&](const std::string& text, double lo) {
      char* end = nullptr;
      const double v = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0' || !(v >= lo))
        usage_error("bad value '" + text + "' for " + a);
      return v;
    };
    if (a == "-h" || a == "--help") {
      std::cout << k_usage;
      std::exit(k_exit_ok);
    } else if (a == "--conf") {
      c.conf = next();
    } else if (a == "--format") {
      const std::string f = next();
      if (f == "pytorch") c.read.format = trace_format::pytorch;
      else if (f == "rmm") c.read.format = trace_format::rmm;
      else if (f != "auto") usage_error("bad --format '" + f + "'; accepted: auto, pytorch, rmm");
    } else if (a == "--strict") {
      c.read.strict = true;
    } else if (a == "--device-memory") {
      const std::string v = next();
      try {
        c.device_bytes =
            options::parse("memory_limit:" + v).memory_limit_bytes;  // the same size syntax
      } catch (const config_error&) {
        usage_error("bad --device-memory '" + v +
                    "'; give bytes with an optional K, M, G (KiB, MiB, GiB) suffix");
      }
      if (c.device_bytes == 0) usage_error("--device-memory must be positive");
    } else if (a == "--gpu") {
      c.gpu = has_inline ? static_cast<int>(number(value, 0)) : 0;
    } else if (a == "--passes") {
      c.passes = static_cast<int>(number(next(), 0));
    } else if (a == "--repeat") {
      const double n = number(next(), 1);
      if (n > 1000 || n != static_cast<double>(static_cast<std::size_t>(n)))
        usage_error("--repeat takes a whole number from 1 to 1000");
      c.repeat = static_cast<std::size_t>(n);
    } else if (a == "--out") {
      c.out = next();
    } else if (a == "--snapshot") {
      c.snapshot = next();
    } else if (a == "--html") {
      c.html = next();
    } else if (a == "--max-ratio") {
      c.max_ratio = number(next(), 0);
    } else if (a == "--show-bad-lines") {
      c.show_bad_lines = static_cast<std::size_t>(number(next(), 0));
    } else if (!a.empty() && a[0] == '-' && a != "-") {
      usage_error("unknown option " + a);
    } else if (c.trace_path.empty()) {
      c.trace_path = a;
    } else {
      usage_error("one trace at a time (got '" + c.trace_path + "' and '" + a + "')");
    }
  }
  if (c.trace_path.empty()) usage_error("no TRACE given");
  return c;
}

void write_file(const std::string& path, const std::string& what,
                const std::function<void(std::ostream&)>& body) {
  std::ofstream f(path, std::ios::binary);
  if (f) body(f);
  if (!f) {
    std::cerr << "streamsafe-replay: cannot write " << what << " to " << path << '\n';
    std::exit(k_exit_usage);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const cli c = parse_args(argc, argv);

  options opts;
  std::vector<std::string> warnings;
  try {
    opts = c.conf ? options::parse(*c.conf, &warnings) : options::from_environment(&warnings);
  } catch (const config_error& e) {
    std::cerr << e.what() << '\n';
    return k_exit_usage;
  }
  for (const auto& w : warnings) std::cerr << w << '\n';

  replay_program program;
  try {
    program = read_trace_file(c.trace_path, c.read);
  } catch (const trace_parse_error& e) {
    if (e.line() == 0) {
      std::cerr << "streamsafe-replay: " << e.what() << '\n';
      return std::string(e.what()).rfind("cannot open", 0) == 0 ? k_exit_usage : k_exit_rejected;
    }
    std::cerr << c.trace_path << ':' << e.line() << ": " << e.what()
              << "\nstreamsafe-replay: trace rejected" << (c.read.strict ? " (--strict)" : "")
              << '\n';
    return k_exit_rejected;
  }
  for (std::size_t i = 0; i < program.bad_lines.size() && i < c.show_bad_lines; ++i) {
    std::cerr << c.trace_path << ':' << program.bad_lines[i].line << ": "
              << program.bad_lines[i].message << " (skipped)\n";
  }
  if (program.bad_lines.size() > c.show_bad_lines) {
    std::cerr << "... and " << program.bad_lines.size() - c.show_bad_lines
              << " more malformed line(s)\n";
  }

  if (c.repeat > 1) {
    try {
      program = repeat_program(program, c.repeat);
    } catch (const std::invalid_argument& e) {
      usage_error(e.what());
    }
  }

  replay_settings settings;
  settings.alloc_options = opts;
  if (c.gpu) {
    const int gpu = *c.gpu;
    const backend_kind kind = opts.backend;
    settings.make_device = [gpu, kind] { return make_gpu_device(gpu, kind); };
  } else {
    const std::size_t bytes = c.device_bytes;
    settings.make_device = [bytes] { return make_simulated_device(bytes); };
  }
  settings.timed_passes = c.passes;
  settings.trace_capacity = c.out.empty() ? 0 : 2 * program.steps.size() + 65536;
  settings.timeline_points = c.html.empty() ? 0 : 2000;
  settings.snapshot_at_peak = !c.html.empty() || !c.snapshot.empty();

  replay_report rep;
  try {
    rep = run_replay(program, settings);
  } catch (const std::exception& e) {
    std::cerr << "streamsafe-replay: replay failed: " << e.what() << '\n';
    return k_exit_usage;
  }
  const pass_result& r = rep.result;
  const statistics& s = r.stats;
  const double ratio = rep.ratio();
  const double eps = rep.events_per_second();

  std::vector<std::pair<std::string, std::string>> facts;
  auto fact = [&](const std::string& k, const std::string& v) {
    facts.emplace_back(k, v);
    std::printf("%-16s %s\n", k.c_str(), v.c_str());
  };
  fact("trace", c.trace_path + " (" + to_string(program.format) + " format, " +
                    with_commas(program.lines) + " lines)");
  fact("replayed", with_commas(r.steps) + " events: " + with_commas(program.allocs) + " alloc, " +
                       with_commas(program.frees) + " free, on " +
                       std::to_string(program.trace_streams.size()) + " stream(s)");
  std::string not_replayed;
  if (program.ignored_free_completed)
    not_replayed += with_commas(program.ignored_free_completed) + " free_completed, ";
  if (program.segment_rows) not_replayed += with_commas(program.segment_rows) + " segment rows, ";
  if (program.other_rows) not_replayed += with_commas(program.other_rows) + " other rows, ";
  if (program.zero_size_allocs)
    not_replayed += with_commas(program.zero_size_allocs) + " zero-size or null, ";
  not_replayed += with_commas(program.live_at_end) + " blocks never freed";
  fact("not replayed", not_replayed);
  fact("bad lines",
       with_commas(program.bad_lines.size()) + (program.bad_lines.empty() ? "" : " (skipped)"));
  fact("device", rep.device);
  fact("options", opts.to_string());
  fact("events/s", fixed(eps / 1e6, 2) + " M (" + fixed(eps > 0 ? 1e9 / eps : 0, 0) +
                       " ns per event: allocator CPU time, " +
                       (c.passes > 1 ? "best of " + std::to_string(c.passes) + " passes"
                                     : std::string("one pass")) +
                       ")");
  fact("peak allocated", bytes_text(s.allocated_bytes.peak));
  fact("peak reserved", bytes_text(s.reserved_bytes.peak));
  fact("ratio", fixed(ratio, 4) + " (peak reserved / peak allocated)");
  fact("segment ops", with_commas(r.segment_ops.segment_allocs) + " segment_alloc, " +
                          with_commas(r.segment_ops.segment_frees) + " segment_free, " +
                          with_commas(r.segment_ops.maps) + " segment_map, " +
                          with_commas(r.segment_ops.unmaps) + " segment_unmap");
  for (std::size_t k = 0; k < r.repetitions.size(); ++k) {
    const repetition_result& x = r.repetitions[k];
    const auto& o = x.segment_ops;
    fact("repetition " + std::to_string(k + 1),
         with_commas(o.segment_allocs + o.maps) + " alloc/map, " +
             with_commas(o.segment_frees + o.unmaps) + " free/unmap; peak reserved " +
             bytes_text(x.peak_reserved) + ", ratio " +
             fixed(x.peak_allocated > 0 ? static_cast<double>(x.peak_reserved) /
                                              static_cast<double>(x.peak_allocated)
                                        : 0.0,
                   4) +
             (x.seconds > 0 ? ", " + fixed(x.seconds * 1e3, 2) + " ms" : std::string()));
  }
  if (r.ooms)
    fact("out of memory", with_commas(r.ooms) + " allocation(s) failed; " +
                              with_commas(r.frees_skipped) + " free(s) skipped");
  if (program.recorded_reserved_peak && s.allocated_bytes.peak > 0) {
    fact("recorded run", "peak reserved " +
                             bytes_text(static_cast<std::int64_t>(program.recorded_reserved_peak)) +
                             " from the trace's segment rows: " +
                             fixed(static_cast<double>(program.recorded_reserved_peak) /
                                       static_cast<double>(s.allocated_bytes.peak),
                                   4) +
                             " x peak allocated here");
  }

  if (!c.out.empty()) {
    write_file(c.out, "the trace", [&](std::ostream& os) {
      if (ends_with(c.out, ".json"))
        write_trace_json(os, rep.trace, settings.trace_capacity, rep.trace_dropped);
      else write_trace_csv(os, rep.trace);
    });
    std::printf("%-16s %s (%s events)\n", "trace written", c.out.c_str(),
                with_commas(rep.trace.size()).c_str());
  }
  if (!c.snapshot.empty() && rep.peak_snapshot) {
    write_file(c.snapshot, "the snapshot",
               [&](std::ostream& os) { rep.peak_snapshot->to_json(os); });
    std::printf("%-16s %s\n", "snapshot written", c.snapshot.c_str());
  }
  if (!c.html.empty()) {
    html_report_input in;
    in.title = "streamsafe replay of " + base_name(c.trace_path) + ", backend " +
               to_string(opts.backend);
    in.facts = facts;
    in.facts.erase(std::remove_if(in.facts.begin(), in.facts.end(),
                                  [](const auto& f) {
                                    return f.first == "bad lines" || f.first == "not replayed";
                                  }),
                   in.facts.end());
    for (auto& f : in.facts) {
      if (f.first != "options") continue;  // let the browser wrap it
      std::string spaced;
      for (char ch : f.second) spaced += ch == ',' ? std::string(", ") : std::string(1, ch);
      f.second = spaced;
    }
    for (const timeline_point& p : r.timeline)
      in.usage.push_back({p.time_us, p.allocated, p.reserved});
    in.snapshot = rep.peak_snapshot;
    in.final_stats = s;
    write_file(c.html, "the HTML report", [&](std::ostream& os) { write_html_report(os, in); });
    std::printf("%-16s %s\n", "html written", c.html.c_str());
  }
  if (c.max_ratio && ratio > *c.max_ratio) {
    std::fprintf(stderr, "streamsafe-replay: ratio %.4f is above --max-ratio %.4f\n", ratio,
                 *c.max_ratio);
    return k_exit_ratio;
  }
  return k_exit_ok;
}
