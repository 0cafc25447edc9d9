#!/usr/bin/env bash
# Everything that needs the GPU, in one run (a GPU machine with CUDA 13, CMake, ninja and, for the
# PyTorch steps, python3 with torch 2.11 and pytest): builds the gpu preset with the PyTorch
# extension, then, each step under its own time limit so that the whole run ends within
# STREAMSAFE_GPU_ALL_DEADLINE_S (default 400 s):
#   1. the [gpu] Catch2 suite                               -> gpu_tests.log
#   2. the PyTorch pytest suite (tests/python)              -> pytest.log
#   3. examples/pytorch/seed_race.py, signsgd rows          -> seed_race.log
#   4. bench/stream_lock_compare.sh (biased vs spin lock)   -> lock_compare.md
#   5. the hot path: same_stream_pair and random_allocations, streamsafe and baselines -> hot_path.log
#   6. examples/race_repro (2 steps)                        -> race_repro.log
#   7. compute-sanitizer memcheck on seed_race's streamsafe-defer row and on the [gpu] suite
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
deadline=$(( start + ${STREAMSAFE_GPU_ALL_DEADLINE_S:-400} ))
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

# The spin-lock benchmark builds in the background while the suites run (CPU only).
export STREAMSAFE_LOCK_JSON_DIR=/tmp/streamsafe-lock
mkdir -p "$STREAMSAFE_LOCK_JSON_DIR"
(cmake -S . -B build-lock-spin -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
   -DSTREAMSAFE_BUILD_TESTS=OFF -DSTREAMSAFE_BUILD_EXAMPLES=OFF -DSTREAMSAFE_BUILD_BENCHMARKS=ON \
   -DSTREAMSAFE_BENCH_TORCH=OFF -DSTREAMSAFE_TORCH_EXT=OFF -DSTREAMSAFE_STREAM_LOCK=spin &&
 cmake --build build-lock-spin -j 8 --target streamsafe_bench) > "$STREAMSAFE_LOCK_JSON_DIR/spin_build.log" 2>&1 &
spin_build=$!

step "[gpu] suite" 90 "$OUT/gpu_tests.log" "$build/tests/streamsafe_tests" "[gpu]"

ext=$(find "$build" -name 'libstreamsafe_torch_ext.so' | head -1)
plug=$(find "$build" -name 'libstreamsafe_torch.so' | head -1)
export PYTHONPATH=$root/allocator/python${PYTHONPATH:+:$PYTHONPATH}
export STREAMSAFE_TORCH_EXT_LIB=$ext STREAMSAFE_TORCH_LIB=$plug
step "pytest tests/python" 120 "$OUT/pytest.log" python3 -m pytest -q -rA --timeout=120 tests/python
step "seed race (signsgd, busy 0 and 1)" 110 "$OUT/seed_race.log" \
  python3 examples/pytorch/seed_race.py --steps 3 --verbose --opts "${STREAMSAFE_SEED_OPTS:-signsgd}" \
  --rows "${STREAMSAFE_SEED_ROWS:-}"

wait "$spin_build"
echo "spin build exit $?" >> "$summary"
export STREAMSAFE_LOCK_BIASED_BUILD=$build
step "stream lock: biased vs spin" 100 "$OUT/lock_compare.md" bash bench/stream_lock_compare.sh
step "hot path (same_stream_pair, random_allocations)" 40 "$OUT/hot_path.log" \
  "$build/bench/streamsafe_bench" --benchmark_min_time=0.05 --benchmark_repetitions=3 \
  --benchmark_report_aggregates_only=true \
  --benchmark_filter='same_stream_pair/(streamsafe_expandable|streamsafe_cuda_malloc|cub|pytorch_c10)/|random_allocations/(streamsafe|cub|pytorch)'
step "race_repro (2 steps)" 60 "$OUT/race_repro.log" "$build/examples/race_repro/race_repro" --steps 2
step "memcheck: seed race, streamsafe-defer" 60 "$OUT/sanitize.log" \
  compute-sanitizer --tool memcheck python3 examples/pytorch/seed_race.py --child streamsafe-defer \
  --opt signsgd --busy 1 --params 8 --mib 4 --steps 2 --busy-matmuls 20
step "compute-sanitizer: [gpu] suite, memcheck" 200 "$OUT/sanitize.log" \
  bash tests/gpu_sanitize.sh "$build" memcheck
echo "== done in $(( $(date +%s) - start )) s" | tee -a "$summary"
