#!/usr/bin/env bash
# Everything that needs the GPU, in one run (a GPU machine with CUDA 13, CMake, ninja and, for the
# PyTorch steps, python3 with torch 2.11 and pytest): builds the gpu preset with the PyTorch
# extension, then, each step under its own time limit so that the whole run ends within
# STREAMSAFE_GPU_ALL_DEADLINE_S (default 560 s):
#   1. the [gpu] Catch2 suite and the two-process IPC test  -> gpu_tests.log
#   2. the PyTorch pytest suite (tests/python)              -> pytest.log
#   3. examples/pytorch/seed_race.py, signsgd rows, and examples/race_repro (2 steps)
#                                                          -> races.log
#   3b. examples/pytorch/sleep_wake.py, every row           -> sleep_wake.log
#   4. the hot path: same_stream_pair, random_allocations (streamsafe and baselines) and the
#      stream lock under a stats() monitor (stream_lock_bench.cpp) -> hot_path.log
#   6. compute-sanitizer memcheck on seed_race's and sleep_wake's streamsafe-defer rows and on
#      the [gpu] suite
#      (tests/gpu_sanitize.sh memcheck) with the time left  -> sanitize.log
# A summary of every step (exit status, seconds) goes to summary.log. Files go to $OUT
# (default ./out); at most eight, so that a device tool that returns eight files gets them all.
#   usage (project root):  bash tests/gpu_all.sh
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
OUT=${OUT:-$root/out}
mkdir -p "$OUT"
[ -f .device-deps/env.sh ] && source .device-deps/env.sh
export PYTHONUNBUFFERED=1
start=$(date +%s)
deadline=$(( start + ${STREAMSAFE_GPU_ALL_DEADLINE_S:-560} ))
summary=$OUT/summary.log
: > "$summary"
left() { echo $(( deadline - $(date +%s) )); }
# step NAME LIMIT_S LOG CMD...: runs CMD under min(LIMIT_S, time left - 5), appends to LOG.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local l
  l=$(left)
  l=$(( l - 5 ))
  [ "$l" -lt "$limit" ] && limit=$l
  if [ "$limit" -le 5 ]; then echo "== $name: skipped (no time left)" | tee -a "$summary"; return; fi
  local t0
  t0=$(date +%s)
  echo "== $name (limit ${limit} s)" >> "$log"
  timeout "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  tail -n 6 "$log" | sed 's/^/   /' >> "$summary"
}

build=$root/build-gpu
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -1
} >> "$summary" 2>&1
step "configure (gpu preset, PyTorch extension)" 60 "$OUT/build.log" \
  cmake --preset gpu -DSTREAMSAFE_TORCH_EXT=AUTO -DSTREAMSAFE_BENCH_TORCH=AUTO
step "build" 150 "$OUT/build.log" cmake --build "$build" -j "$(nproc)"

step "[gpu] suite" 90 "$OUT/gpu_tests.log" "$build/tests/streamsafe_tests" "[gpu]"
step "IPC, two processes" 60 "$OUT/gpu_tests.log" "$build/tests/streamsafe_ipc_gpu_test"

ext=$(find "$build" -name 'libstreamsafe_torch_ext.so' | head -1)
plug=$(find "$build" -name 'libstreamsafe_torch.so' | head -1)
export PYTHONPATH=$root/allocator/python${PYTHONPATH:+:$PYTHONPATH}
export STREAMSAFE_TORCH_EXT_LIB=$ext STREAMSAFE_TORCH_LIB=$plug
step "pytest tests/python" 120 "$OUT/pytest.log" python3 -m pytest -q -rA --timeout=120 tests/python
step "seed race (signsgd, busy 0 and 1)" 110 "$OUT/races.log" \
  python3 examples/pytorch/seed_race.py --steps 3 --verbose --opts "${STREAMSAFE_SEED_OPTS:-signsgd}" \
  --rows "${STREAMSAFE_SEED_ROWS:-}"

step "hot path (same_stream_pair, random_allocations)" 40 "$OUT/hot_path.log" \
  "$build/bench/streamsafe_bench" --benchmark_min_time=0.05 --benchmark_repetitions=3 \
  --benchmark_report_aggregates_only=true \
  --benchmark_filter='same_stream_pair/(streamsafe_expandable|streamsafe_cuda_malloc|cub|pytorch_c10)/|random_allocations/(streamsafe|cub|pytorch)|monitored_'
step "race_repro (2 steps)" 60 "$OUT/races.log" "$build/examples/race_repro/race_repro" --steps 2
step "sleep/wake (every row)" 150 "$OUT/sleep_wake.log" \
  python3 examples/pytorch/sleep_wake.py --params "${STREAMSAFE_SLEEP_PARAMS:-64}" \
  --mib "${STREAMSAFE_SLEEP_MIB:-64}" --cycles 3
step "memcheck: seed race, streamsafe-defer" 60 "$OUT/sanitize.log" \
  compute-sanitizer --tool memcheck python3 examples/pytorch/seed_race.py --child streamsafe-defer \
  --opt signsgd --busy 1 --params 8 --mib 4 --steps 2 --busy-matmuls 20
step "memcheck: sleep/wake, streamsafe-defer" 90 "$OUT/sanitize.log" \
  compute-sanitizer --tool memcheck python3 examples/pytorch/sleep_wake.py --child streamsafe-defer \
  --params 8 --mib 8 --cycles 2 --kv-blocks 12 --kv-mib 8 --tail-cycles 20000
step "compute-sanitizer: [gpu] suite, memcheck" 200 "$OUT/sanitize.log" \
  bash tests/gpu_sanitize.sh "$build" memcheck
echo "== done in $(( $(date +%s) - start )) s" | tee -a "$summary"
