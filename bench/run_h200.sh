#!/usr/bin/env bash
# The benchmark run on the H200 machine (CUDA 13.0, CMake 4, ninja, PyTorch 2.11, no network).
# From the project root:   bash bench/run_h200.sh
# Builds streamsafe_bench and streamsafe_bench_sim in a fresh build directory (Release, sm_90,
# the PyTorch c10 baseline when PyTorch is importable), runs the GPU suite and the simulated-device
# suite, and writes into $OUT (default ./out):
#   bench.json          the GPU suite's raw results (Google Benchmark JSON)
#   bench_sim.json      the simulated-device suite on this machine's CPU
#   h200_results.md     tables, ratios to every baseline, the issue's targets checked
#   h200_sim_results.md the simulated-device tables
#   h200_scenario1.png  ns per pair by size; h200_scenario3.png  throughput against threads
#                       (.svg instead where matplotlib is missing)
#   run.log             machine, configure, build and benchmark console output
# Every step runs under a time limit taken from one deadline (STREAMSAFE_BENCH_DEADLINE_S, default
# 450 s after the start), so the whole script ends within 7.5 minutes whatever happens (typically
# 3-4): a slow build leaves the GPU suite less time, and a suite stopped early still leaves valid
# entries that plot.py reads. Knobs: STREAMSAFE_BENCH_MIN_TIME (default 0.05 s per benchmark),
# STREAMSAFE_BENCH_REPETITIONS (default 3; plot.py reports the median of the repetitions),
# STREAMSAFE_BENCH_FILTER (a --benchmark_filter regex), STREAMSAFE_BENCH_TRACE (the trace; see
# below), STREAMSAFE_BENCH_BUILD_DIR.
#
# The trace of scenario 6 is looked for at $STREAMSAFE_BENCH_TRACE, ../shared/traces/,
# shared/traces/ and .device-deps/ (in that order). Where ../shared is not beside the checkout
# (the GPU machine), copy the trace into .device-deps/ beforehand (see docs/benchmarks.md).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
OUT=${OUT:-$root/out}
mkdir -p "$OUT"
log=$OUT/run.log
: > "$log"
say() { echo "== $*" | tee -a "$log"; }
start=$(date +%s)
deadline=$(( start + ${STREAMSAFE_BENCH_DEADLINE_S:-450} ))
# Seconds for a step: at most $1, and never past the deadline less $2 kept for the later steps.
budget() {
  local left=$(( deadline - $(date +%s) - $2 ))
  [ "$left" -gt "$1" ] && left=$1
  [ "$left" -lt 5 ] && left=5
  echo "$left"
}

if [ -f .device-deps/env.sh ]; then
  # shellcheck disable=SC1091
  source .device-deps/env.sh
fi

say "machine"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true
  uname -srm
  nproc
  nvcc --version 2>&1 | tail -1 || true
  cmake --version | head -1
  python3 -c 'import torch; print("torch", torch.__version__, "cxx11abi", torch._C._GLIBCXX_USE_CXX11_ABI)' 2>&1 | tail -1
} >> "$log" 2>&1

trace=${STREAMSAFE_BENCH_TRACE:-}
if [ -z "$trace" ]; then
  for candidate in ../shared/traces/gpt2_fixed_adamw.csv.gz shared/traces/gpt2_fixed_adamw.csv.gz \
                   .device-deps/gpt2_fixed_adamw.csv.gz; do
    if [ -f "$candidate" ]; then trace=$root/$candidate; break; fi
  done
fi
if [ -n "$trace" ]; then
  export STREAMSAFE_BENCH_TRACE=$trace
  say "trace: $trace"
else
  say "trace not found: scenario 6 (replay) will be skipped"
fi

build=${STREAMSAFE_BENCH_BUILD_DIR:-$root/build-bench-h200}
rm -rf "$build"

configure() {  # $1: STREAMSAFE_BENCH_TORCH
  timeout "$(budget 90 200)" cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DSTREAMSAFE_BUILD_TESTS=OFF -DSTREAMSAFE_BUILD_EXAMPLES=OFF \
    -DSTREAMSAFE_BUILD_BENCHMARKS=ON -DSTREAMSAFE_BENCH_TORCH="$1" >> "$log" 2>&1
}
build_targets() {
  timeout "$(budget 330 90)" cmake --build "$build" -j "$(nproc)" --target streamsafe_bench streamsafe_bench_sim >> "$log" 2>&1
}

say "configure"
configure AUTO || { say "configure failed"; tail -30 "$log"; exit 1; }
grep "streamsafe_bench:" "$log" || true
say "build"
build_targets
status=$?
if [ "$status" -eq 124 ]; then
  say "build stopped at its time limit"; tail -20 "$log"; exit 1
elif [ "$status" -ne 0 ]; then
  # The c10 baseline is the part that depends on the machine's PyTorch: rather than lose the run,
  # build the rest (same build directory: what compiled is kept).
  say "build failed (errors below); retrying without the PyTorch c10 baseline"
  grep -E -A3 "error:|Error [0-9]|FAILED" "$log" | tail -40
  configure OFF && build_targets || { say "build failed"; tail -40 "$log"; exit 1; }
fi
say "built in $(( $(date +%s) - start )) s"

min_time=${STREAMSAFE_BENCH_MIN_TIME:-0.05}
repetitions=${STREAMSAFE_BENCH_REPETITIONS:-3}
# The driver default (CUDA_DEVICE_MAX_CONNECTIONS unset): more hardware queues make every
# cudaEventQuery slower (measured: 0.33 us with the default, 1.37 us with 32).
unset CUDA_DEVICE_MAX_CONNECTIONS
filter=${STREAMSAFE_BENCH_FILTER:-.}
say "GPU suite (min_time ${min_time} s)"
timeout "$(budget 200 30)" "$build/bench/streamsafe_bench" --benchmark_min_time="$min_time" --benchmark_repetitions="$repetitions" \
  --benchmark_filter="$filter" --benchmark_out="$OUT/bench.json" --benchmark_out_format=json \
  2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
say "GPU suite exit status $status, $(( $(date +%s) - start )) s so far"
if [ "$status" -ne 0 ] && [ "$status" -ne 124 ] && [ "$filter" = "." ] && grep -q pytorch_c10 "$OUT/bench.json" 2>/dev/null; then
  # A crash (not the time limit) with the c10 baseline in: keep what it wrote, run the rest again
  # without that baseline (Google Benchmark 1.7 takes a leading '-' as a negative filter).
  mv "$OUT/bench.json" "$OUT/bench_crashed.json"
  say "GPU suite crashed; again without pytorch_c10 (partial results kept in bench_crashed.json)"
  timeout "$(budget 200 30)" "$build/bench/streamsafe_bench" --benchmark_min_time="$min_time" \
    --benchmark_repetitions="$repetitions" --benchmark_filter=-pytorch_c10 --benchmark_out="$OUT/bench.json" \
    --benchmark_out_format=json 2>&1 | tee -a "$log"
  say "GPU suite (without pytorch_c10) exit status ${PIPESTATUS[0]}"
fi

# The host's vCPUs differ in speed (a shared VM): one short run pinned to each vCPU shows how far
# a single-thread figure depends on where the scheduler put the thread. Same binary, same minute.
if command -v taskset >/dev/null; then
  say "vCPU spread (same_stream_pair 512 B, record_stream_free, driver floor; pinned to each vCPU)"
  {
    echo "vCPU: benchmark=ns (real time) ..."
    for cpu in $(seq 0 $(( $(nproc) - 1 ))); do
      [ "$(budget 100 60)" -gt 12 ] || break  # keep a minute for the simulated suite and plots
      row=$(timeout 15 taskset -c "$cpu" "$build/bench/streamsafe_bench" --benchmark_min_time=0.02 \
        --benchmark_filter='same_stream_pair/(streamsafe_expandable|cub)/bytes:512/|record_stream_free/streamsafe_expandable|driver_floor/cu_event_record_query' \
        2>/dev/null | awk '/^(same|record|driver)/ {sub("/real_time", "", $1); printf "%s=%s ", $1, $2}')
      echo "$cpu: $row"
    done
  } > "$OUT/cpu_spread.txt" 2>&1
  cat "$OUT/cpu_spread.txt" | tee -a "$log"
fi

say "simulated-device suite"
timeout "$(budget 40 8)" "$build/bench/streamsafe_bench_sim" --benchmark_min_time=0.05 --benchmark_repetitions=1 \
  --benchmark_out="$OUT/bench_sim.json" --benchmark_out_format=json >> "$log" 2>&1
say "simulated-device suite exit status $?"

say "plots and tables"
if [ -s "$OUT/bench.json" ]; then
  python3 bench/plot.py "$OUT/bench.json" --out-dir "$OUT" --prefix h200 --formats png 2>&1 | tee -a "$log"
fi
if [ -s "$OUT/bench_sim.json" ]; then
  python3 bench/plot.py "$OUT/bench_sim.json" --out-dir "$OUT" --prefix h200_sim --formats none 2>&1 | tee -a "$log"
fi
[ -f "$OUT/h200_results.md" ] && sed -n '/### Targets/,$p' "$OUT/h200_results.md"
say "done in $(( $(date +%s) - start )) s; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
