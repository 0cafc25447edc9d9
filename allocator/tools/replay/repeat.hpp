// streamsafe-replay --repeat: a trace run several times back to back, to see the steady state.
//
// A captured trace is a few steps of a workload; a training run repeats such steps thousands of
// times. Repetition k (0-based) replays every step of the trace again, on slots of its own
// (slot + k * slot_count) and at times shifted by k trace spans, except that the allocations the
// trace never frees (model state, caches alive when the snapshot was taken) are made by the
// first repetition only. What a repetition after the first still maps or unmaps, and its peak
// reserved over its peak allocated, are then the cost of the workload's steady state rather
// than of its warm-up.
// Thread safety: a pure function.
#pragma once

#include "trace_reader.hpp"

#include <cstddef>

namespace streamsafe::replay {

// The program of `times` repetitions of `one` (times >= 1; 1 returns a copy). Sets
// repetition_starts. Throws std::invalid_argument when times is 0 or the slots would overflow.
replay_program repeat_program(const replay_program& one, std::size_t times);

}  // namespace streamsafe::replay
