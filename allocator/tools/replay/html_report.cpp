// streamsafe-replay: the HTML report (see html_report.hpp).
//
// Layout constants are in CSS pixels. The usage plot maps time to x and bytes to y with a
// "nice" axis (steps of 1, 2 or 5 times a power of ten in the unit of the largest value). The
// segment map lays the drawn part of each segment end to end, in address order, over rows of a
// fixed byte span (a nice value chosen so the map has about 24 rows); a block crossing a row
// end continues on the next row. Every piece of text that comes from the input is escaped.
#include "core/common/format.hpp"

#include "html_report.hpp"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <map>
#include <ostream>
#include <sstream>

namespace streamsafe::replay {
namespace {

constexpr const char* k_stream_colors[] = {"#4e79a7", "#59a14f", "#b07aa1", "#edc948",
                                           "#76b7b2", "#ff9da7", "#9c755f", "#bab0ac"};
constexpr int k_stream_color_count = 8;
constexpr const char* k_inactive_color = "#d3d3d3";
constexpr const char* k_releasing_color = "#e15759";
constexpr const char* k_reserved_color = "#f28e2b";
constexpr const char* k_allocated_color = "#4e79a7";
constexpr const char* k_reserved_fill = "#fbd5ad";
constexpr const char* k_allocated_fill = "#a9c0dc";

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string human(double bytes) {
  return streamsafe::detail::human_bytes(static_cast<std::int64_t>(bytes));
}

using streamsafe::detail::hex;
using streamsafe::detail::with_commas;

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

// A tick step of 1, 2 or 5 times a power of ten, giving at most `max_ticks` ticks up to `span`.
double nice_step(double span, int max_ticks) {
  if (span <= 0) return 1;
  const double raw = span / max_ticks;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * mag >= raw) return m * mag;
  }
  return 10 * mag;
}

// "0", "512 MiB", "1 GiB", "1.5 GiB": at most two decimals, trailing zeros dropped.
std::string short_bytes(double bytes) {
  if (bytes <= 0) return "0";
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.2f", bytes);
  std::string text = buf;
  while (text.back() == '0') text.pop_back();
  if (text.back() == '.') text.pop_back();
  return text + " " + units[u];
}

// A rectangle width: two decimals, at least 0.05 px so that tiny blocks still show a hairline.
std::string width_text(double w) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", std::max(w, 0.05));
  return buf;
}

// Unit (divisor and name) for an axis whose largest value is `max_bytes`.
std::pair<double, const char*> byte_unit(double max_bytes) {
  if (max_bytes >= 1024.0 * 1024 * 1024) return {1024.0 * 1024 * 1024, "GiB"};
  if (max_bytes >= 1024.0 * 1024) return {1024.0 * 1024, "MiB"};
  if (max_bytes >= 1024.0) return {1024.0, "KiB"};
  return {1.0, "B"};
}

const char* stream_color(int index) { return k_stream_colors[index % k_stream_color_count]; }

void write_usage_plot(std::ostream& os, const html_report_input& in) {
  const auto& pts = in.usage;
  constexpr double width = 1300, height = 300, left = 78, right = 20, top = 16, bottom = 44;
  const double pw = width - left - right, ph = height - top - bottom;
  std::int64_t peak_alloc = 0, peak_res = 0;
  for (const auto& p : pts) {
    peak_alloc = std::max(peak_alloc, p.allocated);
    peak_res = std::max(peak_res, p.reserved);
  }
  const std::uint64_t t0 = pts.front().time_us, t1 = pts.back().time_us;
  const bool by_index = t1 <= t0;  // no usable clock: steps along x
  const double x_span = by_index ? static_cast<double>(pts.size() - 1 ? pts.size() - 1 : 1)
                                 : static_cast<double>(t1 - t0) / 1e6;
  auto x_of = [&](std::size_t i) {
    const double v = by_index ? static_cast<double>(i)
                              : static_cast<double>(pts[i].time_us - t0) / 1e6;
    return left + pw * v / x_span;
  };
  const double y_max_raw = static_cast<double>(std::max<std::int64_t>({peak_alloc, peak_res, 1}));
  const auto [unit, unit_name] = byte_unit(y_max_raw);
  const double y_step = nice_step(y_max_raw / unit * 1.08, 6);
  const double y_top = std::ceil(y_max_raw / unit * 1.08 / y_step) * y_step;  // in units
  auto y_of = [&](double bytes) { return top + ph - ph * (bytes / unit) / y_top; };

  os << "<svg class=\"plot\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width
     << "\" height=\"" << height << "\" viewBox=\"0 0 " << width << ' ' << height
     << "\" role=\"img\" aria-label=\"allocated and reserved bytes over time\">\n";
  // Grid and y axis.
  for (double v = 0; v <= y_top + 1e-9; v += y_step) {
    const double y = top + ph - ph * v / y_top;
    os << "<line x1=\"" << left << "\" y1=\"" << num(y) << "\" x2=\"" << left + pw << "\" y2=\""
       << num(y) << "\" stroke=\"#e6e6e6\"/>\n<text x=\"" << left - 8 << "\" y=\"" << num(y + 4)
       << "\" text-anchor=\"end\" class=\"tick\">"
       << (y_step < 1 ? num(v) : std::to_string(static_cast<long long>(v))) << ' ' << unit_name
       << "</text>\n";
  }
  // x axis ticks.
  const double x_step = nice_step(x_span, 10);
  for (double v = 0; v <= x_span + 1e-9; v += x_step) {
    const double x = left + pw * v / x_span;
    char label[32];
    if (by_index) std::snprintf(label, sizeof label, "%.0f", v);
    else
      std::snprintf(label, sizeof label,
                    x_step < 0.01  ? "%.3f"
                    : x_step < 0.1 ? "%.2f"
                                   : "%.1f",
                    v);
    os << "<line x1=\"" << num(x) << "\" y1=\"" << top + ph << "\" x2=\"" << num(x) << "\" y2=\""
       << top + ph + 5 << "\" stroke=\"#666\"/>\n<text x=\"" << num(x) << "\" y=\"" << top + ph + 19
       << "\" text-anchor=\"middle\" class=\"tick\">" << label << "</text>\n";
  }
  os << "<text x=\"" << left + pw / 2 << "\" y=\"" << height - 6
     << "\" text-anchor=\"middle\" class=\"axis\">"
     << (by_index ? "event" : "time since the first event (s)") << "</text>\n";
  // Areas, reserved below allocated.
  auto area = [&](bool reserved, const char* color, const char* fill) {
    std::ostringstream line;
    for (std::size_t i = 0; i < pts.size(); ++i) {
      const double v = static_cast<double>(reserved ? pts[i].reserved : pts[i].allocated);
      line << (i ? " L" : "M") << num(x_of(i)) << ' ' << num(y_of(v));
    }
    os << "<path d=\"" << line.str() << " L" << num(x_of(pts.size() - 1)) << ' ' << num(top + ph)
       << " L" << num(x_of(0)) << ' ' << num(top + ph) << " Z\" fill=\"" << fill
       << "\" stroke=\"none\"/>\n<path d=\"" << line.str() << "\" fill=\"none\" stroke=\"" << color
       << "\" stroke-width=\"1.5\"/>\n";
  };
  // Opaque fills: allocated covers reserved, so the orange band is reserved minus allocated.
  area(true, k_reserved_color, k_reserved_fill);
  area(false, k_allocated_color, k_allocated_fill);
  // Peak lines: reserved label above its line, allocated label below its line.
  auto peak_line = [&](std::int64_t bytes, const char* color, const std::string& label,
                       bool above) {
    const double y = y_of(static_cast<double>(bytes));
    os << "<line x1=\"" << left << "\" y1=\"" << num(y) << "\" x2=\"" << left + pw << "\" y2=\""
       << num(y) << "\" stroke=\"" << color << "\" stroke-dasharray=\"6 4\"/>\n<text x=\""
       << left + pw - 6 << "\" y=\"" << num(above ? y - 5 : y + 14)
       << "\" text-anchor=\"end\" class=\"peak\" fill=\"" << color << "\">" << label << "</text>\n";
  };
  peak_line(peak_res, k_reserved_color, "peak reserved " + human(static_cast<double>(peak_res)),
            true);
  peak_line(peak_alloc, k_allocated_color,
            "peak allocated " + human(static_cast<double>(peak_alloc)), false);
  // The moment of the snapshot.
  if (in.snapshot && !by_index && in.snapshot->time_us >= t0 && in.snapshot->time_us <= t1) {
    const double x = left + pw * (static_cast<double>(in.snapshot->time_us - t0) / 1e6) / x_span;
    os << "<line x1=\"" << num(x) << "\" y1=\"" << top << "\" x2=\"" << num(x) << "\" y2=\""
       << top + ph << "\" stroke=\"#444\" stroke-dasharray=\"2 3\"/>\n<text x=\"" << num(x + 4)
       << "\" y=\"" << top + 12 << "\" class=\"tick\">snapshot below</text>\n";
  }
  // Axes and legend.
  os << "<line x1=\"" << left << "\" y1=\"" << top << "\" x2=\"" << left << "\" y2=\"" << top + ph
     << "\" stroke=\"#666\"/>\n<line x1=\"" << left << "\" y1=\"" << top + ph << "\" x2=\""
     << left + pw << "\" y2=\"" << top + ph << "\" stroke=\"#666\"/>\n";
  os << "</svg>\n";
}

struct map_layout {
  double width = 1300, left = 78, row_h = 14, row_gap = 5;
  double bytes_per_row = 0;
  double pw() const { return width - left - 8; }
};

void write_segment_map(std::ostream& os, const memory_snapshot& snap, const std::string& label) {
  // Streams in order of first appearance get colours.
  std::map<stream_handle, int> stream_index;
  auto color_of = [&](stream_handle s) {
    auto it = stream_index.find(s);
    if (it == stream_index.end())
      it = stream_index.emplace(s, static_cast<int>(stream_index.size())).first;
    return it->second;
  };
  // The drawn span of each segment: an expandable one ends at its last mapped byte.
  std::vector<std::size_t> drawn(snap.segments.size(), 0);
  std::uint64_t total_drawn = 0, hidden_unmapped = 0, total_mapped = 0;
  std::size_t small_segments = 0, expandable_segments = 0;
  std::uint64_t by_state[5] = {0, 0, 0, 0, 0};
  for (std::size_t i = 0; i < snap.segments.size(); ++i) {
    const segment_snapshot& seg = snap.segments[i];
    std::size_t end = 0;
    for (const block_snapshot& b : seg.blocks) {
      if (b.state != snapshot_block_state::unmapped) end = b.address + b.size_bytes - seg.address;
      by_state[static_cast<int>(b.state)] += b.size_bytes;
      if (b.state != snapshot_block_state::inactive && b.state != snapshot_block_state::unmapped)
        color_of(b.stream);
    }
    drawn[i] = seg.expandable ? end : seg.size_bytes;
    hidden_unmapped += seg.size_bytes - drawn[i];
    total_drawn += drawn[i];
    total_mapped += seg.mapped_bytes;
    if (seg.pool == snapshot_pool::small) ++small_segments;
    if (seg.expandable) ++expandable_segments;
  }
  os << "<h2>Segments and blocks " << escape(label) << "</h2>\n<p class=\"note\">"
     << snap.segments.size() << " segments (" << small_segments << " small pool, "
     << snap.segments.size() - small_segments << " large pool"
     << (expandable_segments ? ", " + std::to_string(expandable_segments) + " expandable"
                             : std::string())
     << "), " << human(static_cast<double>(total_mapped)) << " mapped: active "
     << human(static_cast<double>(by_state[0])) << ", pending free "
     << human(static_cast<double>(by_state[1])) << ", inactive "
     << human(static_cast<double>(by_state[2])) << ", releasing "
     << human(static_cast<double>(by_state[4])) << ".";
  if (total_drawn == 0) {
    os << " Nothing is mapped.</p>\n";
    return;
  }
  map_layout L;
  // About 24 rows, each a nice number of bytes.
  const double target = static_cast<double>(total_drawn) / 24.0;
  L.bytes_per_row = 1024;  // a power of two: row labels read 512 MiB, 1 GiB, 1.5 GiB, ...
  while (L.bytes_per_row < target) L.bytes_per_row *= 2;
  const double bytes_per_px = L.bytes_per_row / L.pw();
  const double rows = std::ceil(static_cast<double>(total_drawn) / L.bytes_per_row);
  os << " Each row is " << human(L.bytes_per_row)
     << "; segments are laid end to end in address order, each starting "
     << "at a dark mark.";
  if (hidden_unmapped) {
    os << " Expandable segments are drawn up to their last mapped byte ("
       << human(static_cast<double>(hidden_unmapped))
       << " of reserved, unmapped address space beyond is not drawn).";
  }
  os << " Hover for details.</p>\n";
  const double height = rows * (L.row_h + L.row_gap) + 6;
  os << "<svg class=\"map\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" << L.width
     << "\" height=\"" << num(height) << "\" viewBox=\"0 0 " << L.width << ' ' << num(height)
     << "\" role=\"img\" aria-label=\"segment map\">\n<defs>\n";
  for (const auto& [stream, idx] : stream_index) {
    os << "<pattern id=\"hatch" << idx
       << "\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
       << "patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#fff\"/><rect "
          "width=\"3\" height=\"6\" fill=\""
       << stream_color(idx) << "\"/></pattern>\n";
  }
  os << "</defs>\n";
  for (int r = 0; r < static_cast<int>(rows); ++r) {
    const double y = r * (L.row_h + L.row_gap) + 3;
    os << "<rect x=\"" << L.left << "\" y=\"" << y << "\" width=\"" << L.pw() << "\" height=\""
       << L.row_h << "\" fill=\"#fafafa\" stroke=\"#eee\"/>\n<text x=\"" << L.left - 8 << "\" y=\""
       << y + L.row_h - 3 << "\" text-anchor=\"end\" class=\"tick\">"
       << short_bytes(L.bytes_per_row * r) << "</text>\n";
  }
  // Draws [offset, offset+bytes) of the strip, wrapping rows; returns the pieces' count.
  auto strip = [&](double offset, double bytes, const std::string& attrs,
                   const std::string& title) {
    while (bytes > 0) {
      const double row = std::floor(offset / L.bytes_per_row);
      const double in_row = offset - row * L.bytes_per_row;
      const double take = std::min(bytes, L.bytes_per_row - in_row);
      const double x = L.left + in_row / bytes_per_px;
      const double w = take / bytes_per_px;
      os << "<rect x=\"" << num(x) << "\" y=\"" << num(row * (L.row_h + L.row_gap) + 3)
         << "\" width=\"" << width_text(w) << "\" height=\"" << L.row_h << "\" " << attrs
         << "><title>" << title << "</title></rect>\n";
      offset += take;
      bytes -= take;
    }
  };
  double offset = 0;
  for (std::size_t i = 0; i < snap.segments.size(); ++i) {
    const segment_snapshot& seg = snap.segments[i];
    const double seg_start = offset;
    for (const block_snapshot& b : seg.blocks) {
      const std::size_t rel = b.address - seg.address;
      if (rel >= drawn[i]) break;
      std::string fill;
      switch (b.state) {
        case snapshot_block_state::active:
          fill = std::string("fill=\"") + stream_color(color_of(b.stream)) + "\"";
          break;
        case snapshot_block_state::pending_free:
          fill = "fill=\"url(#hatch" + std::to_string(color_of(b.stream)) + ")\"";
          break;
        case snapshot_block_state::inactive:
          fill = std::string("fill=\"") + k_inactive_color + "\"";
          break;
        case snapshot_block_state::unmapped:
          fill = "fill=\"#ffffff\" stroke=\"#bbb\" stroke-width=\"0.5\"";
          break;
        case snapshot_block_state::releasing:
          fill = std::string("fill=\"") + k_releasing_color + "\"";
          break;
      }
      std::string title = std::string(to_string(b.state)) + " block " + hex(b.address) + ", " +
                          human(static_cast<double>(b.size_bytes));
      if (b.requested_bytes) title += " (requested " + with_commas(b.requested_bytes) + " B)";
      title += ", stream " + std::to_string(b.stream);
      if (!seg.tag.empty()) title += ", tag " + seg.tag;
      if (seg.paused_bytes != 0 && b.state != snapshot_block_state::unmapped)
        title += " (paused: its memory is back with the driver until resume)";
      if (!b.waiting_on.empty()) {
        title += ", waiting on stream";
        for (stream_handle s : b.waiting_on) title += " " + std::to_string(s);
      }
      strip(seg_start + static_cast<double>(rel),
            static_cast<double>(std::min(b.size_bytes, drawn[i] - rel)), fill, title);
    }
    // The segment's start mark, with the segment's tooltip.
    const double row = std::floor(seg_start / L.bytes_per_row);
    const double x = L.left + (seg_start - row * L.bytes_per_row) / bytes_per_px;
    os << "<rect x=\"" << num(x) << "\" y=\"" << num(row * (L.row_h + L.row_gap) + 1)
       << "\" width=\"1.5\" height=\"" << L.row_h + 4 << "\" fill=\"#222\"><title>segment "
       << hex(seg.address) << ": " << human(static_cast<double>(seg.size_bytes))
       << (seg.expandable ? " reserved (expandable), " : ", ")
       << human(static_cast<double>(seg.mapped_bytes)) << " mapped, " << to_string(seg.pool)
       << " pool, stream " << seg.stream << (seg.tag.empty() ? "" : ", tag " + seg.tag)
       << (seg.paused_bytes ? ", paused " + human(static_cast<double>(seg.paused_bytes)) : "")
       << "</title></rect>\n";
    offset += static_cast<double>(drawn[i]);
  }
  os << "</svg>\n<div class=\"legend\">";
  for (const auto& [stream, idx] : stream_index) {
    os << "<span><i style=\"background:" << stream_color(idx) << "\"></i>active, stream " << stream
       << "</span>"
       << "<span><i style=\"background:repeating-linear-gradient(45deg," << stream_color(idx)
       << " 0 3px,#fff 3px 6px)\"></i>"
       << "pending free, stream " << stream << "</span>";
  }
  os << "<span><i style=\"background:" << k_inactive_color
     << "\"></i>inactive (cached, free)</span>"
     << "<span><i style=\"background:#fff;border:1px solid #bbb\"></i>unmapped</span>"
     << "<span><i style=\"background:" << k_releasing_color << "\"></i>releasing</span>"
     << "<span><i style=\"background:#222;width:3px\"></i>segment start</span></div>\n";
}

}  // namespace

void write_html_report(std::ostream& os, const html_report_input& in) {
  os << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>"
     << escape(in.title) << "</title>\n<style>\n"
     << "body{font-family:system-ui,-apple-system,'Segoe "
        "UI',Helvetica,Arial,sans-serif;margin:14px 22px;color:#222;"
        "background:#fff}\n"
     << "h1{font-size:19px;margin:0 0 8px}h2{font-size:15px;margin:14px 0 4px}\n"
     << "table.facts{border-collapse:collapse;font-size:13px;margin-bottom:6px}\n"
     << "table.facts td{padding:1px 14px 1px 0;vertical-align:top}table.facts "
        "td.k{color:#666;white-space:nowrap}\n"
     << "table.facts td.v{width:520px}\n"
     << "svg "
        "text{font-family:inherit}.tick{font-size:11px;fill:#444}.axis{font-size:12px;fill:#333}"
        ".peak{font-size:12px;font-weight:600}\n"
     << ".note{font-size:12px;color:#555;margin:0 0 4px;max-width:1300px}\n"
     << ".legend{font-size:12px;margin:2px 0 0 78px}.legend "
        "span{margin-right:16px;white-space:nowrap;"
        "display:inline-block}\n"
     << ".legend "
        "i{display:inline-block;width:14px;height:10px;margin-right:5px;vertical-align:-1px}\n"
     << "pre{font-size:11px;line-height:1.25;background:#f7f7f7;padding:8px;display:inline-block}\n"
     << "</style>\n</head>\n<body>\n<h1>" << escape(in.title) << "</h1>\n";
  if (!in.facts.empty()) {
    os << "<table class=\"facts\">\n";
    // Two pairs per row.
    for (std::size_t i = 0; i < in.facts.size(); i += 2) {
      os << "<tr>";
      for (std::size_t j = i; j < i + 2 && j < in.facts.size(); ++j) {
        os << "<td class=\"k\">" << escape(in.facts[j].first) << "</td><td class=\"v\">"
           << escape(in.facts[j].second) << "</td>";
      }
      os << "</tr>\n";
    }
    os << "</table>\n";
  }
  if (!in.usage.empty()) {
    os << "<h2>Allocated and reserved bytes over time</h2>\n<div class=\"legend\"><span><i "
          "style=\"background:"
       << k_allocated_fill << ";border-top:2px solid " << k_allocated_color
       << "\"></i>allocated (blocks handed out)</span><span><i style=\"background:"
       << k_reserved_fill << ";border-top:2px solid " << k_reserved_color
       << "\"></i>reserved (held from the driver); the orange band is reserved but not "
          "allocated</span></div>\n";
    write_usage_plot(os, in);
  }
  if (in.snapshot) write_segment_map(os, *in.snapshot, in.snapshot_label);
  if (in.final_stats) {
    os << "<h2>Statistics at the end</h2>\n<pre>"
       << escape(memory_summary(*in.final_stats, in.snapshot ? in.snapshot->device : -1))
       << "</pre>\n";
  }
  os << "</body>\n</html>\n";
}

}  // namespace streamsafe::replay
