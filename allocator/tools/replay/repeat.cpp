// streamsafe-replay --repeat (repeat.hpp).
#include "repeat.hpp"

#include <limits>
#include <stdexcept>
#include <string>

namespace streamsafe::replay {

replay_program repeat_program(const replay_program& one, std::size_t times) {
  if (times == 0) throw std::invalid_argument("--repeat: the count must be at least 1");
  if (one.slot_count != 0 && times > std::numeric_limits<std::uint32_t>::max() / one.slot_count) {
    throw std::invalid_argument("--repeat " + std::to_string(times) + ": " +
                                std::to_string(one.slot_count) +
                                " slots per repetition overflow the slot numbers");
  }
  // An allocation the trace never frees: the last alloc of a slot with no free after it.
  std::vector<bool> freed_after(one.steps.size(), false);
  {
    std::vector<std::size_t> open(one.slot_count, one.steps.size());
    for (std::size_t i = 0; i < one.steps.size(); ++i) {
      const replay_step& s = one.steps[i];
      if (s.alloc) open[s.slot] = i;
      else if (open[s.slot] != one.steps.size()) freed_after[open[s.slot]] = true;
    }
  }
  replay_program out = one;
  out.steps.clear();
  out.steps.reserve(one.steps.size() * times);
  out.slot_count = static_cast<std::uint32_t>(one.slot_count * times);
  const std::uint64_t span = one.steps.empty()
                                 ? 0
                                 : one.steps.back().time_us - one.steps.front().time_us + 1;
  for (std::size_t k = 0; k < times; ++k) {
    out.repetition_starts.push_back(out.steps.size());
    for (std::size_t i = 0; i < one.steps.size(); ++i) {
      replay_step s = one.steps[i];
      if (k > 0 && s.alloc && !freed_after[i]) continue;  // the first repetition made it
      s.slot += static_cast<std::uint32_t>(k * one.slot_count);
      s.time_us += k * span;
      out.steps.push_back(s);
    }
  }
  out.allocs = 0;
  out.frees = 0;
  for (const replay_step& s : out.steps) (s.alloc ? out.allocs : out.frees) += 1;
  return out;
}

}  // namespace streamsafe::replay
