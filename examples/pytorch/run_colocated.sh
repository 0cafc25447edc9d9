#!/usr/bin/env bash
# examples/pytorch/colocated_rl.py on a GPU machine (docs/colocated_rl.md): builds the PyTorch
# extension (the gpu preset, target streamsafe_torch_ext only), then runs, each under its own time
# limit, the steps named in STREAMSAFE_COLOCATED_STEPS (default "quick full"):
#   floor     streamsafe_bench --benchmark_filter=switch_floor: the driver calls of a switch by
#             handle size, the pinned copies (docs/sleep.md, "The floor")  -> colocated_floor.log
#   quick     colocated_rl.py --quick: every row on a small model          -> colocated_quick.log
#   chunks    the quick streamsafe row with expandable_chunk_mb:128 (pause and resume cost per
#             driver mapping: fewer, larger ones)                        -> colocated_chunks.log
#   full      colocated_rl.py: every row, the numbers of the docs          -> colocated_full.log
#   hybrid    colocated_rl.py --hybrid: every row, trainer and engine in one process
#                                                                        -> colocated_hybrid.log
#   hybrid_quick  colocated_rl.py --quick --hybrid                      -> colocated_hybrid_quick.log
#   large     colocated_rl.py --large --rows reference,streamsafe,field (about 30 GiB a side)
#                                                                        -> colocated_large.log
#   tests     pytest tests/python/test_colocated.py                        -> colocated_tests.log
#   unsafe    colocated_rl.py --quick --rows reference,unsafe --unsafe-release -> colocated_unsafe.log
#   sanitize  compute-sanitizer --tool memcheck on colocated_rl.py --sanitize -> colocated_memcheck.log
# STREAMSAFE_COLOCATED_ROWS (a comma list) narrows the rows of full and hybrid; STREAMSAFE_LARGE_ARGS
# adds arguments to large (e.g. "--steps 4 --warmup 1").
# Logs and a summary (colocated_summary.log) go to $OUT (default ./out).
#   usage (project root):  source .device-deps/env.sh && bash examples/pytorch/run_colocated.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
OUT=${OUT:-$root/out}
mkdir -p "$OUT"
[ -f .device-deps/env.sh ] && source .device-deps/env.sh
export PYTHONUNBUFFERED=1
steps=${STREAMSAFE_COLOCATED_STEPS:-quick full}
summary=$OUT/colocated_summary.log
: > "$summary"
start=$(date +%s)
run() {  # run NAME LIMIT_S LOG CMD...
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$(date +%s)
  echo "== $name (limit ${limit} s): $*" >> "$log"
  timeout "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  tail -n 14 "$log" | sed 's/^/   /' >> "$summary"
  return $rc
}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' 2>&1 | tail -1
} >> "$summary" 2>&1

build=$root/build-gpu
run "configure" 90 "$OUT/colocated_build.log" cmake --preset gpu -DSTREAMSAFE_TORCH_EXT=ON \
  -DSTREAMSAFE_BENCH_TORCH=OFF || { echo "configure failed: see colocated_build.log" | tee -a "$summary"; exit 1; }
run "build streamsafe_torch_ext" 300 "$OUT/colocated_build.log" \
  cmake --build "$build" -j "$(nproc)" --target streamsafe_torch_ext streamsafe_torch \
  || { echo "build failed: see colocated_build.log" | tee -a "$summary"; exit 1; }
ext=$(find "$build" -name 'libstreamsafe_torch_ext.so' | head -1)
plug=$(find "$build" -name 'libstreamsafe_torch.so' | head -1)
export PYTHONPATH=$root/allocator/python${PYTHONPATH:+:$PYTHONPATH}
export STREAMSAFE_TORCH_EXT_LIB=$ext STREAMSAFE_TORCH_LIB=$plug
ex=examples/pytorch/colocated_rl.py
for s in $steps; do
  case $s in
    floor) run "build streamsafe_bench" 300 "$OUT/colocated_build.log" \
             cmake --build "$build" -j "$(nproc)" --target streamsafe_bench &&
           run "switch floor" 180 "$OUT/colocated_floor.log" "$build/bench/streamsafe_bench" \
             --benchmark_filter=switch_floor --benchmark_counters_tabular=true \
             --benchmark_out="$OUT/colocated_floor.json" --benchmark_out_format=json ;;
    quick) run "quick" 120 "$OUT/colocated_quick.log" python3 $ex --quick --json "$OUT/colocated_quick.json" ;;
    chunks) run "quick, 128 MiB chunks" 120 "$OUT/colocated_chunks.log" python3 $ex --quick \
              --rows reference,streamsafe --ss-conf expandable_chunk_mb:128 \
              --json "$OUT/colocated_chunks.json" ;;
    full) run "full" 420 "$OUT/colocated_full.log" python3 $ex ${STREAMSAFE_COLOCATED_ROWS:+--rows $STREAMSAFE_COLOCATED_ROWS} \
            --json "$OUT/colocated_full.json" ;;
    hybrid_quick) run "hybrid, quick" 120 "$OUT/colocated_hybrid_quick.log" python3 $ex --quick --hybrid \
                    ${STREAMSAFE_COLOCATED_ROWS:+--rows $STREAMSAFE_COLOCATED_ROWS} \
                    --json "$OUT/colocated_hybrid_quick.json" ;;
    hybrid) run "hybrid" 420 "$OUT/colocated_hybrid.log" python3 $ex --hybrid \
              ${STREAMSAFE_COLOCATED_ROWS:+--rows $STREAMSAFE_COLOCATED_ROWS} --json "$OUT/colocated_hybrid.json" ;;
    large) run "large" 580 "$OUT/colocated_large.log" python3 $ex --large --rows reference,streamsafe,field \
             ${STREAMSAFE_LARGE_ARGS:-} --json "$OUT/colocated_large.json" ;;
    tests) run "pytest test_colocated" 420 "$OUT/colocated_tests.log" \
             python3 -m pytest -q -rA tests/python/test_colocated.py ;;
    unsafe) run "unsafe control" 150 "$OUT/colocated_unsafe.log" \
              python3 $ex --quick --rows reference,unsafe --unsafe-release ;;
    sanitize) run "memcheck" 580 "$OUT/colocated_memcheck.log" \
                compute-sanitizer --tool memcheck --target-processes all python3 $ex --sanitize ;;
    *) echo "unknown step $s" | tee -a "$summary" ;;
  esac
done
echo "== done in $(( $(date +%s) - start )) s" | tee -a "$summary"
