// streamsafe-replay: reading allocation traces into a replay program.
//
// Two formats, told apart by their header line (or forced with trace_format):
//   pytorch  time_us,action,address,size,stream   (shared/traces/README.md; what
//            streamsafe's trace_recorder writes). Replayed: alloc, free_requested, and
//            free_completed of a block with no free_requested before it. Counted, not replayed:
//            segment_alloc / segment_free / segment_map / segment_unmap (the recording
//            allocator's own decisions, summed into recorded_reserved) and every other known
//            action (oom, release_deferred, snapshot, ...).
//   rmm      Thread,Time,Action,Pointer,Size,Stream   (RAPIDS RMM logging_resource_adaptor).
//            Replayed: allocate, free / deallocate. Counted: allocate failure.
// Columns are found by name, so extra columns and another order are fine. Numbers are decimal
// or 0x-hexadecimal; RMM's Pointer column is hexadecimal with or without 0x. RMM times may be
// HH:MM:SS:micro, HH:MM:SS.fraction, or seconds (with a fraction) since the epoch.
//
// A line is bad when it has too few fields, a number that does not parse, an unknown action,
// an alloc at an address that is still live, or a free of an address with no live alloc.
// Bad lines are reported with their 1-based line number; by default they are skipped (every
// one is kept in bad_lines), with strict = true the first one throws trace_parse_error.
// Blank lines and lines starting with '#' are ignored. Files are read through zlib, so .csv.gz
// and plain .csv are both read, whatever their name.
//
// The program refers to live blocks by slot (dense indices), not addresses, so a replay loop
// needs no map lookup. Thread safety: plain functions of their input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <istream>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace streamsafe::replay {

enum class trace_format { pytorch, rmm };
const char* to_string(trace_format format) noexcept;

struct bad_line {
  std::size_t line = 0;  // 1-based
  std::string message;   // what is wrong, with the offending text (cut at 120 characters)
};

class trace_parse_error : public std::runtime_error {
 public:
  trace_parse_error(std::size_t line, const std::string& message)
      : std::runtime_error(message), line_(line) {}
  std::size_t line() const noexcept { return line_; }  // 0: the file as a whole (unreadable)

 private:
  std::size_t line_;
};

struct replay_step {
  std::uint64_t time_us = 0;   // from the trace (RMM: microseconds since its first midnight)
  std::size_t size_bytes = 0;  // alloc: requested bytes; free: the alloc's requested bytes
  std::uint32_t slot = 0;      // the block, 0 .. slot_count-1 (reused after its free)
  std::uint32_t stream = 0;    // index into replay_program::trace_streams
  bool alloc = false;          // else free
  std::uint32_t line = 0;      // 1-based line of the trace
};

struct replay_program {
  trace_format format = trace_format::pytorch;
  std::vector<replay_step> steps;
  std::vector<std::uint64_t> trace_streams;  // the trace's stream ids, by first appearance
  std::uint32_t slot_count = 0;
  std::size_t lines = 0;  // lines read, header and blank lines included
  std::size_t allocs = 0, frees = 0;
  std::size_t ignored_free_completed = 0;  // free_completed after a free_requested of the block
  std::size_t segment_rows = 0;            // segment_* rows (PyTorch format)
  std::size_t other_rows = 0;              // other known actions / RMM allocate failures
  std::size_t zero_size_allocs = 0;        // allocs of 0 bytes and frees of null: not replayed
  std::size_t live_at_end = 0;             // allocs the trace never frees
  // What the recording allocator reserved, from the segment rows (0 when there are none).
  std::uint64_t recorded_reserved_peak = 0;
  std::uint64_t requested_peak = 0;  // peak of live requested bytes over the trace
  // repeat_program (repeat.hpp): the first step of each repetition; empty for a plain trace.
  std::vector<std::size_t> repetition_starts;
  std::vector<bad_line> bad_lines;
};

struct read_options {
  std::optional<trace_format> format;  // nullopt: detect from the header / first line
  bool strict = false;                 // throw trace_parse_error at the first bad line
};

// Parses a whole trace from a stream of text. Throws trace_parse_error (strict mode, or when the
// format cannot be recognised).
replay_program read_trace(std::istream& in, const read_options& opts = {});
replay_program read_trace_text(std::string_view text, const read_options& opts = {});
// Reads a file, plain or gzip-compressed. Throws trace_parse_error (line 0) when it cannot be
// opened or decompressed.
replay_program read_trace_file(const std::string& path, const read_options& opts = {});

}  // namespace streamsafe::replay
