// streamsafe: libFuzzer harness. The input bytes are a program of allocator operations and
// stream work on the simulated device (see allocator_program.hpp for the decoding and for every
// property checked after each step). The first two bytes choose the configuration: backend,
// fence scope, empty_cache mode, memory limit, chunk and split sizes, handle reuse and FSDP2-style
// unrecorded uses. Under the unsafe allocation_stream scope simulated faults are expected and
// only the allocator's own invariants are checked.
//
// A breach prints the configuration and what broke, then aborts (libFuzzer saves the input).
// To see the operations of a saved input:  STREAMSAFE_FUZZ_TRACE=1 ./allocator_fuzzer crash-FILE
#include "allocator_program.hpp"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstdlib>

namespace {

// Totals over the whole fuzzing run, printed at exit.
streamsafe::fuzz::program_stats totals;
std::uint64_t executions = 0;

void print_totals() {
  std::fprintf(
      stderr,
      "streamsafe fuzz: %llu executions, %llu operations, %llu allocations, %llu out_of_memory, "
      "%llu injected failures (%llu surfaced as errors), %llu waits refused under a hold, %llu bad "
      "pointers, %llu streams destroyed, %llu out_of_memory the reference oracle would serve\n",
      static_cast<unsigned long long>(executions),
      static_cast<unsigned long long>(totals.operations),
      static_cast<unsigned long long>(totals.allocations),
      static_cast<unsigned long long>(totals.out_of_memory),
      static_cast<unsigned long long>(totals.injections),
      static_cast<unsigned long long>(totals.injected_errors),
      static_cast<unsigned long long>(totals.hold_deadlocks),
      static_cast<unsigned long long>(totals.bad_pointer_checks),
      static_cast<unsigned long long>(totals.streams_destroyed),
      static_cast<unsigned long long>(totals.reference_ooms));
}

bool trace_wanted() {
  static const bool wanted = [] {
    const char* v = std::getenv("STREAMSAFE_FUZZ_TRACE");
    return v && *v && *v != '0';
  }();
  return wanted;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // The allocator logs every out-of-memory at error level; at fuzzing speed that is noise.
  auto logger = spdlog::stderr_color_mt("streamsafe");
  logger->set_level(spdlog::level::off);
  std::atexit(print_totals);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace streamsafe::fuzz;
  if (size < 2) return 0;
  const program_config config = program_config::decode(data[0], data[1]);
  span_source src(data + 2, size - 2);
  program p(config);
  p.keep_trace(trace_wanted());
  try {
    p.run(src, size);
    p.finish();
    ++executions;
    totals += p.stats();
  } catch (const violation& v) {
    std::fprintf(stderr, "\n==streamsafe fuzz== VIOLATION: %s\n", v.what());
    if (trace_wanted()) {
      for (const std::string& line : p.trace()) std::fprintf(stderr, "  %s\n", line.c_str());
    } else {
      std::fprintf(stderr, "  (rerun with STREAMSAFE_FUZZ_TRACE=1 for the operations)\n");
    }
    std::abort();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\n==streamsafe fuzz== UNEXPECTED EXCEPTION [%s]: %s\n",
                 config.to_string().c_str(), e.what());
    if (trace_wanted()) {
      for (const std::string& line : p.trace()) std::fprintf(stderr, "  %s\n", line.c_str());
    }
    std::abort();
  }
  return 0;
}
