#!/usr/bin/env bash
# Fuzzes the allocator for a bounded time: builds the harness tests/fuzz with the fuzz preset of
# CMakePresets.json (clang, libFuzzer, AddressSanitizer and UndefinedBehaviorSanitizer, no CUDA),
# replays the seed corpus tests/fuzz/corpus, then fuzzes. Exits non-zero on any crash, sanitizer report or
# property violation; the failing input is kept under $build/artifacts/.
# Usage: bash .ci/fuzz.sh [seconds]      (default 120; or STREAMSAFE_FUZZ_SECONDS)
#        STREAMSAFE_FUZZ_BUILD_DIR=dir   (default build-fuzz, the preset's; CI: build-asan-ubsan)
# Reproduce a failure: STREAMSAFE_FUZZ_TRACE=1 build-fuzz/tests/fuzz/allocator_fuzzer build-fuzz/artifacts/crash-...
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-${STREAMSAFE_FUZZ_SECONDS:-120}}
build=${STREAMSAFE_FUZZ_BUILD_DIR:-build-fuzz}

# Debian 12: clang is clang-14; libFuzzer and the sanitizer runtimes are in libclang-rt-14-dev.
bash .ci/deps.sh --host-only clang libclang-rt-14-dev cmake ninja-build libspdlog-dev libfmt-dev

# A build tree configured with the harness already (CI: the asan-ubsan preset's, whose sanitizers
# are the fuzz preset's) is reused; any other is configured with the fuzz preset.
if grep -qs '^STREAMSAFE_BUILD_FUZZERS:BOOL=ON' "$build/CMakeCache.txt"; then
  echo "== the harness of $build (configured with STREAMSAFE_BUILD_FUZZERS=ON)"
else
  cmake --preset fuzz -B "$build"
fi
cmake --build "$build" -j "$(nproc)" --target allocator_fuzzer
fuzzer="$build/tests/fuzz/allocator_fuzzer"

mkdir -p "$build/corpus" "$build/artifacts"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
echo "== replaying the seed corpus"
"$fuzzer" -runs=0 -artifact_prefix="$build/artifacts/" tests/fuzz/corpus
echo "== fuzzing for ${seconds} s"
"$fuzzer" -max_total_time="$seconds" -timeout=60 -rss_limit_mb=4096 -print_final_stats=1 \
  -artifact_prefix="$build/artifacts/" "$build/corpus" tests/fuzz/corpus 2>&1 | tee "$build/fuzz.log" |
  grep -vE '^#[0-9]+[[:space:]]+(NEW|REDUCE|pulse)'
echo "fuzz: $(grep -E 'stat::number_of_executed_units' "$build/fuzz.log" | awk '{print $2}') executions, no failure"
