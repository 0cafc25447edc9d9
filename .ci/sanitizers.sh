#!/usr/bin/env bash
# Builds the host tests (streamsafe_tests without CUDA: the allocator core, the simulated device
# and tests/core, tests/sim) twice, with clang, through the presets of CMakePresets.json:
# asan-ubsan (AddressSanitizer + UndefinedBehaviorSanitizer) and tsan (ThreadSanitizer); runs
# both. Any sanitizer report fails.
# Usage: bash .ci/sanitizers.sh [asan|tsan]...   (default: both)
#        Catch2 arguments in STREAMSAFE_SANITIZER_TEST_ARGS (default: every host test but [soak])
#        build directories: the presets' build-asan-ubsan/, build-tsan/
set -euo pipefail
cd "$(dirname "$0")/.."
which=("$@")
[ ${#which[@]} -eq 0 ] && which=(asan tsan)

bash .ci/deps.sh --host-only clang libclang-rt-14-dev cmake ninja-build catch2 libspdlog-dev libfmt-dev

# Sanitizer runs are slower: the million-operation run ([soak]) is left to the plain build.
read -r -a test_args <<< "${STREAMSAFE_SANITIZER_TEST_ARGS:-~[soak]}"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}

for kind in "${which[@]}"; do
  case "$kind" in
    asan) preset=asan-ubsan ;;
    tsan) preset=tsan ;;
    *) echo "unknown sanitizer '$kind' (asan or tsan)" >&2; exit 2 ;;
  esac
  cmake --preset "$preset"
  cmake --build --preset "$preset" -j "$(nproc)"
  echo "== host tests under $kind (preset $preset)"
  runner=()
  # ThreadSanitizer of clang 14 needs a narrower address space than recent kernels randomise into.
  if [ "$kind" = tsan ] && command -v setarch >/dev/null; then runner=(setarch "$(uname -m)" -R); fi
  "${runner[@]}" "build-$preset/tests/streamsafe_tests" "${test_args[@]}"
done
