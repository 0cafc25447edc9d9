#!/usr/bin/env bash
# CI: a short smoke run of the benchmark suite where there is no GPU. Builds streamsafe_bench_sim
# (scenarios 1-3 and 6 on the simulated device) and streamsafe_bench (the GPU suite must compile
# and start without a driver: it lists its benchmarks), then runs scenarios 1-3 on the simulated
# device for 0.01 s each and fails only if a benchmark reports an error. It asserts nothing about
# timing. Usage: bash .ci/bench.sh   (build directory: build/, or $STREAMSAFE_BUILD_DIR; configure
# preset: default, or $STREAMSAFE_PRESET)
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/deps.sh
build=${STREAMSAFE_BUILD_DIR:-build}
cmake --preset "${STREAMSAFE_PRESET:-default}" -B "$build" -DSTREAMSAFE_BUILD_BENCHMARKS=ON
cmake --build "$build" -j "$(nproc)" --target streamsafe_bench_sim streamsafe_bench

echo "== streamsafe_bench (GPU suite) starts without a GPU and lists $("$build/bench/streamsafe_bench" --benchmark_list_tests 2>/dev/null | wc -l) benchmarks"

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# Google Benchmark 1.7.1 (Debian 12): --benchmark_min_time takes plain seconds.
"$build/bench/streamsafe_bench_sim" --benchmark_min_time=0.01 \
  --benchmark_filter='^(same_stream_pair|random_allocations|threads_own_stream|threads_shared_stream)/' \
  --benchmark_out="$out/sim.json" --benchmark_out_format=json
runs=$(grep -c '"run_name"' "$out/sim.json" || true)
errors=$(grep -c '"error_occurred": true' "$out/sim.json" || true)
if [ "$runs" -eq 0 ] || [ "$errors" -ne 0 ]; then
  echo "benchmark smoke run: $runs runs, $errors with errors" >&2
  grep -A1 '"error_occurred": true' "$out/sim.json" >&2 || true
  exit 1
fi
echo "benchmark smoke run: $runs runs, none with errors"
