#!/usr/bin/env bash
# Runs the schedule checker (tests/core/schedule_checker_test.cpp, tag [schedules]) for a bounded
# time in each build given that exists: seeded turn-taking schedules of 2 to 8 threads, every
# interleaving of small two-thread programs, and threads running at once, each test case for
# STREAMSAFE_CHECKER_SECONDS seconds. It prints the interleavings run and the violations seen
# (seed and schedule, to replay with STREAMSAFE_CHECKER_SEED).
# Usage: bash .ci/checker.sh [BUILD_DIR[:SECONDS]]...
#        default: build:30 build-asan-ubsan:15 build-tsan:15 (3 test cases each: about 3 min)
#        STREAMSAFE_CHECKER_STRICT=1 also fails on the kinds in k_known_broken (none today).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=("$@")
[ ${#runs[@]} -eq 0 ] && runs=(build:30 build-asan-ubsan:15 build-tsan:15)

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}

for run in "${runs[@]}"; do
  dir=${run%%:*}
  seconds=${run#*:}
  [ "$seconds" = "$run" ] && seconds=30
  binary="$dir/tests/streamsafe_tests"
  if [ ! -x "$binary" ]; then
    echo "checker: $binary not built, skipped"
    continue
  fi
  runner=()
  # ThreadSanitizer of clang 14 needs a narrower address space than recent kernels randomise into.
  if [[ "$dir" == *tsan* ]] && command -v setarch >/dev/null; then runner=(setarch "$(uname -m)" -R); fi
  echo "== schedule checker in $dir, ${seconds} s per test case"
  STREAMSAFE_CHECKER_SECONDS="$seconds" "${runner[@]}" "$binary" "[schedules]"
done
