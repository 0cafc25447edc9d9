#!/usr/bin/env bash
# The memory run on the H200 (CUDA 13, PyTorch 2.11, transformers, no network), in one call of at
# most ~9 minutes, beside PyTorch in the same run. From the project root:
#     source .device-deps/env.sh && bash bench/run_h200_memory.sh
# It builds the gpu preset's PyTorch extension, replay tool, benchmarks and tests (build-gpu), points
# PYTHONPATH at allocator/python, and runs, each part under its own time limit taken from one
# deadline (STREAMSAFE_MEMORY_DEADLINE_S, default 540 s after the start):
#   4. (from the start, beside the build) bench/corpus/capture.sh of the three held-out generation
#      workloads, then their replay beside PyTorch's ratios, and report.py --check on the corpus
#   1. examples/pytorch/empty_cache_under_cap.py: the seed under a 35 GiB cap, every mode, both
#      backends, without and with the busy stream
#   2. examples/pytorch/fsdp_train.py: FSDP2, 24-layer GPT of width 2048, batch 4 x 512, SignSGD
#      and AdamW, PyTorch expandable and default, streamsafe cuda_malloc defer, expandable defer/wait
#   3. examples/pytorch/seed_race.py: the seed example without the busy stream, every step, every mode
#   5. streamsafe_bench and streamsafe_bench_sim: same_stream_pair and random_allocations
#   6. the [gpu] Catch2 tests, with the time left
# Files in $OUT (default ./out), eight at most:
#   summary.md        the tables of every part, each part's exit status and seconds
#   run.log           progress lines with timestamps, the machine
#   build.log         configure and build
#   under_cap.log     part 1, every step      fsdp.log   part 2, every step
#   seed.log          part 3                  bench_tests.log   parts 5 and 6
#   artifacts.tar.gz  the corpus capture (traces, PyTorch's peaks, corpus_rows.csv, logs; not the raw
#                     snapshots, which would pass the 16 MiB a returned file may have), the
#                     replay reports and the benchmarks' JSON
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root=$PWD
OUT=${OUT:-$root/out}
mkdir -p "$OUT"
if [ -f .device-deps/env.sh ]; then
  # shellcheck disable=SC1091
  source .device-deps/env.sh
fi
export PYTHONUNBUFFERED=1
start=$(date +%s)
deadline=$(( start + ${STREAMSAFE_MEMORY_DEADLINE_S:-540} ))
build=$root/build-gpu
work=$root/build-memory-run  # scratch; /build*/ is ignored by git
rm -rf "$work"
mkdir -p "$work"
run_log=$OUT/run.log
summary=$OUT/summary.md
status=$work/status.md
: > "$run_log"
: > "$status"
jobs=$(nproc)

say() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - start ))s] $*" | tee -a "$run_log"; }
left() { echo $(( deadline - $(date +%s) )); }
# cap LIMIT KEEP: LIMIT seconds at most, leaving KEEP seconds before the deadline for what follows.
cap() {
  local l=$(( $(left) - $2 ))
  [ "$l" -gt "$1" ] && l=$1
  echo "$l"
}
# part NAME LIMIT KEEP LOG CMD...: runs CMD under `timeout` (LIMIT capped by the deadline less KEEP),
# appends its output to LOG and a row to the status table.
part() {
  local name=$1 limit keep=$3 log=$4
  limit=$(cap "$2" "$keep")
  shift 4
  if [ "$limit" -lt 10 ]; then
    say "$name: skipped (no time left)"
    echo "| $name | skipped: no time left | 0 |" >> "$status"
    return 0
  fi
  say "$name: start (limit ${limit} s)"
  echo "== $name (limit ${limit} s): $*" >> "$log"
  local t0 rc
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  local why=""
  [ "$rc" -eq 124 ] && why=" (time limit)"
  say "$name: exit $rc$why in $(( $(date +%s) - t0 )) s"
  echo "| $name | $rc$why | $(( $(date +%s) - t0 )) |" >> "$status"
  return 0
}
# summary_of LOG: what a part printed after its '<!-- summary -->' line (else its last lines).
summary_of() {
  if grep -q '^<!-- summary -->' "$1" 2>/dev/null; then
    sed -n '/^<!-- summary -->/,$p' "$1" | sed 1d
  else
    echo '```'
    tail -n 25 "$1" 2>/dev/null
    echo '```'
  fi
}

say "machine"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  nproc
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1
  python3 -c 'import transformers; print("transformers", transformers.__version__)' 2>&1 | tail -1
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
} | tee -a "$run_log"
machine=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)
torch_version=$(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null)

# ---- part 4 starts now, beside the build: it needs only PyTorch and the GPU ---------------------
names=hf_sample_generate,hf_beam_search,chat_multiturn_generate
capture_limit=$(cap 170 300)
if [ "$capture_limit" -ge 40 ]; then
  say "corpus capture ($names) in the background (limit ${capture_limit} s)"
  timeout -k 10 "$((capture_limit + 10))" bash bench/corpus/capture.sh --out "$work/corpus" --only "$names" --jobs 3 \
    --budget "$capture_limit" --per-run "$capture_limit" > "$work/corpus_console.log" 2>&1 &
  capture_pid=$!
  capture_t0=$(date +%s)
else
  say "corpus capture: skipped (no time left)"
  capture_pid=
fi

# ---- build ---------------------------------------------------------------------------------------
: > "$OUT/build.log"
part "configure (gpu preset, PyTorch extension)" 90 400 "$OUT/build.log" \
  cmake --preset gpu -DSTREAMSAFE_TORCH_EXT=AUTO -DSTREAMSAFE_BENCH_TORCH=AUTO
part "build: the PyTorch extension" 200 330 "$OUT/build.log" \
  cmake --build "$build" -j "$jobs" --target streamsafe_torch_ext streamsafe_torch
ext=$(find "$build" -name 'libstreamsafe_torch_ext.so' | head -1)
plug=$(find "$build" -name 'libstreamsafe_torch.so' | head -1)
[ -n "$ext" ] || say "WARNING: libstreamsafe_torch_ext.so was not built: the streamsafe rows will fail"
# The rest builds while the capture runs; it must end before the timed parts start.
build_until=$(( start + 180 ))
(
  for targets in streamsafe-replay "streamsafe_bench streamsafe_bench_sim" streamsafe_tests; do
    l=$(( build_until - $(date +%s) ))
    if [ "$l" -lt 10 ]; then
      echo "== build $targets: no time left"
      echo "| build: $targets (beside the capture) | skipped: no time left | 0 |" >> "$status"
      continue
    fi
    echo "== build $targets (limit $l s)"
    t0=$(date +%s)
    # shellcheck disable=SC2086
    timeout -k 5 "$l" cmake --build "$build" -j "$jobs" --target $targets
    rc=$?
    echo "== build $targets: exit $rc"
    echo "| build: $targets (beside the capture) | $rc | $(( $(date +%s) - t0 )) |" >> "$status"
  done
) >> "$OUT/build.log" 2>&1 &
build_pid=$!

if [ -n "$capture_pid" ]; then
  wait "$capture_pid"
  rc=$?
  ok_runs=$(grep -c ': ok in' "$work/corpus/capture.log" 2>/dev/null)
  say "corpus capture: exit $rc (${ok_runs:-0} of 6 runs ok)"
  echo "| 4. corpus capture (beside the build): ${ok_runs:-0} of 6 runs ok | $rc | $(( $(date +%s) - capture_t0 )) |" >> "$status"
fi
wait "$build_pid"
say "build done: $(grep '^== build' "$OUT/build.log" | grep -c 'exit 0') of 3 background target groups built"
grep '^== build' "$OUT/build.log" | sed 's/^/   /' | tee -a "$run_log"

export PYTHONPATH=$root/allocator/python${PYTHONPATH:+:$PYTHONPATH}
export STREAMSAFE_TORCH_EXT_LIB=$ext STREAMSAFE_TORCH_LIB=$plug
unset STREAMSAFE_ALLOC_CONF PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF
[ -z "$ext" ] && unset STREAMSAFE_TORCH_EXT_LIB
[ -z "$plug" ] && unset STREAMSAFE_TORCH_LIB

# ---- 4, the replays: the new traces beside PyTorch, and the corpus against its ceilings ----------
replay=$(find "$build" -name streamsafe-replay -type f -perm -u+x | head -1)
: > "$work/corpus_report.txt"
if [ -n "$replay" ] && [ -s "$work/corpus/corpus_rows.csv" ]; then
  mkdir -p "$work/corpus_eval"
  head -1 "$work/corpus/corpus_rows.csv" > "$work/corpus_eval/ratios.csv"
  tail -n +2 "$work/corpus/corpus_rows.csv" | while IFS=, read -r name rest; do
    if [ -f "$work/corpus/traces/$name.default.csv.gz" ]; then
      cp "$work/corpus/traces/$name.default.csv.gz" "$work/corpus_eval/$name.csv.gz"
      echo "$name,$rest" >> "$work/corpus_eval/ratios.csv"
    fi
  done
  part "corpus: the new traces replayed" 40 240 "$work/corpus_report.txt" \
    python3 bench/corpus/report.py --replay "$replay" --traces "$work/corpus_eval" \
    --ratios "$work/corpus_eval/ratios.csv" --passes 1
else
  rows=none
  [ -f "$work/corpus/corpus_rows.csv" ] && rows=$(( $(wc -l < "$work/corpus/corpus_rows.csv") - 1 ))
  say "corpus: no replay of the new traces (replay tool: '${replay:-none}', rows: $rows)"
fi
if [ -n "$replay" ]; then
  part "corpus: report.py --check (the twelve traces)" 40 230 "$work/corpus_report.txt" \
    python3 bench/corpus/report.py --replay "$replay" --check --passes 1
fi

# ---- 1, 2, 3: the PyTorch parts (timed: nothing else runs) -------------------------------------
# Each script gets a budget 10 s inside its part's limit: it skips the rows it has no time for and
# still prints its summary.
: > "$OUT/under_cap.log"
l=$(cap 120 205)
part "1. the seed under a 35 GiB cap" "$l" 0 "$OUT/under_cap.log" \
  python3 examples/pytorch/empty_cache_under_cap.py --steps 4 --busy-stream both --settle-timeout-ms 1000 \
  --timeout 60 --budget $(( l - 10 ))
: > "$OUT/fsdp.log"
l=$(cap 170 85)
part "2. FSDP2, world size 1" "$l" 0 "$OUT/fsdp.log" \
  python3 examples/pytorch/fsdp_train.py --layers 24 --embd 2048 --heads 16 --vocab 50257 --block 512 --batch 4 \
  --steps 10 --opts signsgd,adamw --timeout 75 --budget $(( l - 10 )) \
  --rows pytorch-expandable,pytorch,streamsafe-cuda_malloc-defer,streamsafe-expandable-defer,streamsafe-expandable-wait
: > "$OUT/seed.log"
l=$(cap 50 40)
part "3. the seed example, no busy stream" "$l" 0 "$OUT/seed.log" \
  python3 examples/pytorch/seed_race.py --steps 6 --opts signsgd --busy-modes 0 --per-step --verbose --timeout 40 \
  --budget $(( l - 10 )) \
  --rows pytorch,pytorch-default,streamsafe-defer,streamsafe-wait,streamsafe-cuda_malloc-defer,streamsafe-cuda_malloc-wait

# ---- 5, 6: the hot path and the [gpu] tests -------------------------------------------------------
: > "$OUT/bench_tests.log"
hot='^(same_stream_pair/(streamsafe_expandable|streamsafe_cuda_malloc|cub|pytorch_c10)/|random_allocations/(streamsafe|cub|pytorch))'
if [ -x "$build/bench/streamsafe_bench_sim" ]; then
  part "5. hot path, simulated device" 10 28 "$OUT/bench_tests.log" \
    "$build/bench/streamsafe_bench_sim" --benchmark_filter='^(same_stream_pair|random_allocations)/' \
    --benchmark_min_time=0.05 --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
    --benchmark_out="$work/bench_sim.json" --benchmark_out_format=json
fi
if [ -x "$build/bench/streamsafe_bench" ]; then
  "$build/bench/streamsafe_bench" --benchmark_list_tests --benchmark_filter="$hot" > "$work/bench_list.txt" 2>&1
  say "5. hot path, GPU: $(wc -l < "$work/bench_list.txt") benchmarks match"
  part "5. hot path, GPU" 25 3 "$OUT/bench_tests.log" \
    "$build/bench/streamsafe_bench" --benchmark_filter="$hot" --benchmark_min_time=0.05 --benchmark_repetitions=3 \
    --benchmark_report_aggregates_only=true --benchmark_out="$work/bench_gpu.json" --benchmark_out_format=json
else
  say "5. hot path: streamsafe_bench was not built"
fi
if [ -x "$build/tests/streamsafe_tests" ]; then
  part "6. [gpu] Catch2 tests" 90 2 "$OUT/bench_tests.log" "$build/tests/streamsafe_tests" "[gpu]"
else
  say "6. [gpu] tests: streamsafe_tests was not built"
fi

# ---- the summary and the files --------------------------------------------------------------------
{
  echo "# streamsafe memory run: ${machine:-unknown GPU}, torch ${torch_version:-?}, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%FT%TZ)"
  echo
  echo "| part | exit | seconds |"
  echo "| --- | --- | --- |"
  cat "$status"
  echo
  echo "## 1. The seed under a memory cap (under_cap.log has every step)"
  summary_of "$OUT/under_cap.log"
  echo
  echo "## 2. FSDP2, world size 1 (fsdp.log has every step)"
  summary_of "$OUT/fsdp.log"
  echo
  echo "## 3. The seed example without the busy stream (seed.log)"
  summary_of "$OUT/seed.log"
  echo
  echo "## 4. Corpus: the new generation workloads (artifacts.tar.gz: corpus/)"
  echo
  echo '```'
  cat "$work/corpus/capture.log" 2>/dev/null || echo "no capture.log"
  tail -n 3 "$work/corpus_console.log" 2>/dev/null
  echo '```'
  echo
  cat "$work/corpus_report.txt" 2>/dev/null
  echo
  echo "## 5. Hot path (bench_tests.log)"
  echo
  echo '```'
  grep -E '^(same_stream_pair|random_allocations)/.*_(median|mean) ' "$OUT/bench_tests.log" 2>/dev/null | grep median ||
    echo "no benchmark results"
  echo '```'
  echo
  echo "## 6. [gpu] tests"
  echo
  echo '```'
  grep -E 'test cases|assertions|All tests passed|FAILED' "$OUT/bench_tests.log" 2>/dev/null | tail -n 5 || true
  echo '```'
} > "$summary"
cp "$work/corpus_console.log" "$work/corpus/" 2>/dev/null
kept=()
for f in corpus corpus_eval corpus_report.txt bench_sim.json bench_gpu.json bench_list.txt; do
  [ -e "$work/$f" ] && kept+=("$f")
done
[ "${#kept[@]}" -gt 0 ] && tar -czf "$OUT/artifacts.tar.gz" --exclude="*.pickle" --exclude="corpus/raw" -C "$work" "${kept[@]}" 2>> "$run_log"
say "done in $(( $(date +%s) - start )) s; files in $OUT: $(find "$OUT" -maxdepth 1 -type f -printf '%f ')"
