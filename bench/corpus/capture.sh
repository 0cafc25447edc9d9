#!/usr/bin/env bash
# Captures the corpus on a GPU: every workload of workloads.py twice, each run in its own
# process, once with PyTorch's default allocator settings and once with
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; converts each snapshot to a trace with
# allocator/tools/snapshot_to_trace.py and collects PyTorch's peaks into one CSV.
#
# Usage: bash bench/corpus/capture.sh [--out DIR] [--jobs N] [--budget SECONDS]
#                                     [--per-run SECONDS] [--only NAME,NAME] [--keep-pickles]
#   --out DIR       results (default corpus_capture): traces/NAME.TAG.csv.gz, pytorch_ratios.csv,
#                   corpus_rows.csv (the rows for ratios.csv of every workload captured both ways:
#                   the split ratios.csv gives it, else the one workloads.py declares, else
#                   held-out; ceilings left empty), capture.log (one line per run: ok, or why
#                   not), logs/NAME.TAG.log
#   --jobs N        runs at a time on the one GPU (default 4; each process has its own caching
#                   allocator, so the peaks do not depend on it)
#   --budget S      no run starts after S seconds (default 900), and none outlives them
#   --per-run S     the most one run may take (default 240)
#   --keep-pickles  keep raw/NAME.TAG.pickle after a successful conversion
# Needs python3 with torch (and transformers for llama_hf_varlen); PYTHON overrides python3.
# A failing run (its exit status and last log lines go to capture.log) does not stop the others.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
converter=$here/../../allocator/tools/snapshot_to_trace.py
out=corpus_capture
jobs=4
budget=900
per_run=240
only=""
keep_pickles=0
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --per-run) per_run=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --keep-pickles) keep_pickles=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "capture.sh: unknown argument $1" >&2; exit 1 ;;
  esac
done
python=${PYTHON:-python3}
mkdir -p "$out/raw" "$out/traces" "$out/logs"
out=$(cd "$out" && pwd)
: >"$out/capture.log"

names=$("$python" "$here/workloads.py" --list | cut -f1)
if [ -n "$only" ]; then
  names=$(printf '%s\n' $names | grep -Fx -f <(tr ',' '\n' <<<"$only"))
fi
{
  echo "# $(date -u +%FT%TZ) capture on $(hostname)"
  "$python" -c 'import sys, torch; print("# python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")' 2>&1
  "$python" -c 'import transformers; print("# transformers", transformers.__version__)' 2>&1 | tail -1
} >>"$out/capture.log"

deadline=$(($(date +%s) + budget))
export here converter out deadline per_run keep_pickles python

run_one() {
  local name=$1 tag=$2 conf="" left limit rc why
  [ "$tag" = expandable ] && conf=expandable_segments:True
  left=$((deadline - $(date +%s)))
  if [ "$left" -lt 20 ]; then
    echo "$name $tag: not run: the time budget is spent" >>"$out/capture.log"
    return 0
  fi
  limit=$((left < per_run ? left : per_run))
  local log=$out/logs/$name.$tag.log
  local start=$(date +%s)
  if [ -n "$conf" ]; then
    OMP_NUM_THREADS=2 PYTORCH_CUDA_ALLOC_CONF=$conf env -u PYTORCH_ALLOC_CONF timeout -k 5 "$limit" \
      "$python" "$here/workloads.py" "$name" --out "$out/raw" --tag "$tag" >"$log" 2>&1
  else
    OMP_NUM_THREADS=2 env -u PYTORCH_CUDA_ALLOC_CONF -u PYTORCH_ALLOC_CONF timeout -k 5 "$limit" \
      "$python" "$here/workloads.py" "$name" --out "$out/raw" --tag "$tag" >"$log" 2>&1
  fi
  rc=$?
  if [ $rc -ne 0 ]; then
    why=$(grep -v '^\s*$' "$log" | tail -n 3 | tr '\n' ' ' | cut -c1-400)
    [ $rc -eq 124 ] && why="timed out after ${limit} s; $why"
    echo "$name $tag: FAILED (exit $rc after $(($(date +%s) - start)) s): $why" >>"$out/capture.log"
    return 0
  fi
  if "$python" "$converter" "$out/raw/$name.$tag.pickle" -o "$out/traces/$name.$tag.csv.gz" >>"$log" 2>&1; then
    [ "$keep_pickles" = 1 ] || rm -f "$out/raw/$name.$tag.pickle"
    echo "$name $tag: ok in $(($(date +%s) - start)) s: $(grep -m1 'ratio' "$log" | cut -c1-300)" >>"$out/capture.log"
  else
    echo "$name $tag: FAILED conversion: $(tail -n 2 "$log" | tr '\n' ' ' | cut -c1-300) (pickle kept)" >>"$out/capture.log"
  fi
}
export -f run_one

for name in $names; do
  for tag in default expandable; do echo "$name $tag"; done
done | xargs -P "$jobs" -L 1 bash -c 'run_one "$0" "$1"'

# PyTorch's own peaks, one row per run that finished; and the rows for ratios.csv.
"$python" - "$out" "$here/ratios.csv" <<'EOF'
import csv, glob, json, os, sys
out, ratios_path = sys.argv[1], sys.argv[2]
fields = ["workload", "tag", "alloc_conf", "max_memory_reserved", "max_memory_allocated", "ratio",
          "requested_peak", "num_device_alloc", "num_device_free", "num_alloc_retries", "trace_entries", "segment_maps",
          "seconds", "history_context", "torch", "device"]
rows = []
for path in sorted(glob.glob(os.path.join(out, "raw", "*.json"))):
    with open(path) as f:
        r = json.load(f)
    r["ratio"] = f"{r['ratio']:.4f}"
    rows.append({k: r.get(k, "") for k in fields})
with open(os.path.join(out, "pytorch_ratios.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields)
    w.writeheader()
    w.writerows(rows)
print(f"capture: {len(rows)} runs recorded in {out}/pytorch_ratios.csv")

# Rows in ratios.csv's format for every workload captured with both settings. The split of a
# workload already listed stays; a new one takes its declared split, else held-out (never tuning
# by default: a workload added after the defaults were chosen is one they were not chosen on).
with open(ratios_path, newline="") as f:
    listed = {r["trace"]: r for r in csv.DictReader(l for l in f if not l.startswith("#"))}
runs = {}
for path in sorted(glob.glob(os.path.join(out, "raw", "*.json"))):
    with open(path) as f:
        r = json.load(f)
    runs.setdefault(r["workload"], {})[r["tag"]] = r
ratio_fields = ["trace", "split", "pytorch_default_reserved", "pytorch_default_allocated", "pytorch_default_ratio",
                "pytorch_expandable_reserved", "pytorch_expandable_allocated", "pytorch_expandable_ratio",
                "ceiling_expandable", "ceiling_cuda_malloc"]
proposed = []
for name, tags in sorted(runs.items()):
    if "default" not in tags or "expandable" not in tags:
        print(f"capture: {name}: not captured both ways; no ratios.csv row")
        continue
    d, e = tags["default"], tags["expandable"]
    split = listed[name]["split"] if name in listed else (d.get("split") or "held-out")
    proposed.append({"trace": name, "split": split,
                     "pytorch_default_reserved": d["max_memory_reserved"],
                     "pytorch_default_allocated": d["max_memory_allocated"],
                     "pytorch_default_ratio": f"{d['max_memory_reserved'] / max(1, d['max_memory_allocated']):.4f}",
                     "pytorch_expandable_reserved": e["max_memory_reserved"],
                     "pytorch_expandable_allocated": e["max_memory_allocated"],
                     "pytorch_expandable_ratio": f"{e['max_memory_reserved'] / max(1, e['max_memory_allocated']):.4f}",
                     "ceiling_expandable": "", "ceiling_cuda_malloc": ""})
with open(os.path.join(out, "corpus_rows.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=ratio_fields, lineterminator="\n")
    w.writeheader()
    w.writerows(proposed)
new = [r["trace"] + " (" + r["split"] + ")" for r in proposed if r["trace"] not in listed]
print(f"capture: {len(proposed)} rows for ratios.csv in {out}/corpus_rows.csv"
      + (f"; not yet in ratios.csv: {', '.join(new)}" if new else ""))
EOF
ok=$(grep -c ': ok in' "$out/capture.log" || true)
failed=$(grep -c 'FAILED\|not run' "$out/capture.log" || true)
echo "capture: $ok run(s) ok, $failed failed or not run; see $out/capture.log"
