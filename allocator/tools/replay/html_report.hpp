// streamsafe-replay: the picture, one self-contained HTML file (inline CSS and SVG; no script,
// no font, image or style sheet fetched from anywhere).
//
// It shows, top to bottom: the title and a few facts (label: value pairs the caller chooses);
// an SVG plot of allocated and reserved bytes over time with their peaks marked and the moment
// of the snapshot; an SVG map of every segment and block of a memory_snapshot (taken at the
// peak), segments laid end to end in rows of a fixed byte span, blocks coloured by state
// (active and pending free in their stream's colour, pending free hatched; inactive grey;
// unmapped white; releasing red), with a tooltip (SVG <title>) on every block and segment; a
// legend; and memory_summary() of the final statistics. Expandable segments are drawn up to
// their last mapped byte; the address space reserved beyond it is only counted in the legend.
//
// The renderer depends on the snapshot and samples only, not on how they were obtained, so the
// same code draws the core's caching_allocator snapshot once it exists.
// Thread safety: a pure function of its input.
#pragma once

#include <streamsafe/core/snapshot.hpp>
#include <streamsafe/core/statistics.hpp>

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace streamsafe::replay {

struct usage_point {
  std::uint64_t time_us = 0;  // any origin; the plot starts at the first point
  std::int64_t allocated = 0;
  std::int64_t reserved = 0;
};

struct html_report_input {
  std::string title;
  std::vector<std::pair<std::string, std::string>> facts;  // shown as a table, in this order
  std::vector<usage_point> usage;                          // in time order
  std::optional<memory_snapshot> snapshot;                 // the map; omitted when empty
  std::string snapshot_label = "at the peak of allocated bytes";
  std::optional<statistics> final_stats;  // memory_summary(); omitted when empty
};

void write_html_report(std::ostream& os, const html_report_input& input);

}  // namespace streamsafe::replay
