#!/usr/bin/env bash
# PyTorch's own caching-allocator tests (the peer suite, .device-deps/peer/ on the GPU machine,
# shared/peer/ in the steering tree) with PyTorch's allocator and with streamsafe installed on
# both backends; prints the results side by side and the tests that pass natively but fail with
# streamsafe. Run from the repository root on the GPU machine after
# `pip install --no-build-isolation --no-deps .`:
#
#   bash tests/peer_suite.sh [PEER_DIR] [OUT_DIR]
#
# PEER_DIR: the folder holding torch_memory_tests.py (default .device-deps/peer, else
# ../shared/peer). OUT_DIR: where each run's log goes (default $OUT if set, else /tmp/peer_suite).
# Per run timeout: PEER_TIMEOUT seconds (default 300; a run takes 150-250 s on an H100). PEER_RUNS
# picks the runs, in order (default pytorch streamsafe_cuda_malloc streamsafe_expandable):
#   pytorch                     PyTorch's allocator as configured (the suite's baseline)
#   streamsafe_cuda_malloc      streamsafe, backend:cuda_malloc
#   streamsafe_expandable       streamsafe, backend:expandable; the suite's expandable_segments flag
#                               is false, so its graph-pool tests assert cudaMalloc segment counts
#   pytorch_expandable          PyTorch's allocator with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True;
#                               torch 2.11's test utilities read that variable, so the suite's flag
#                               is true here (the results equal pytorch_expandable_flag's)
#   pytorch_expandable_flag     the suite in PyTorch's own expandable mode (its
#   streamsafe_expandable_flag  test_cuda_expandable_segments.py): the flag true, which turns those
#                               assertions into the expandable counts; and streamsafe's expandable
#                               backend under the same flag
# The flag runs add a conftest.py beside their copy that sets PYTORCH_CUDA_ALLOC_CONF before the
# suite is imported and the suite's EXPANDABLE_SEGMENTS to true. PEER_K selects tests (pytest -k),
# to run them alone or in another order; PEER_PYTEST_ARGS adds pytest arguments (e.g.
# --durations=10). PEER_PARALLEL=1 runs the chosen runs at once on the one GPU, each in its own
# process and folder (four runs took 245 s on an H100 instead of about 700 s; the suite's large
# allocations are at most half the device, so two of them at the same moment can make a spurious
# out-of-memory failure: rerun such a test alone with PEER_K). The comparison reads every run's
# results in OUT_DIR, earlier calls' too, comparing only the tests that both runs of a pair ran.
# Each test has 90 s (pytest-timeout); at PEER_TIMEOUT a run is interrupted and keeps the results
# of the tests that finished. Skipped tests are not listed. Exit status 0 when every run completed
# (whatever the tests said; pytest exit 0 or 1), 1 when one did not, 2 for a bad argument; the
# comparison is the output.
set -u
peer=${1:-}
if [ -z "$peer" ]; then
  if [ -f .device-deps/peer/torch_memory_tests.py ]; then peer=.device-deps/peer; else peer=../shared/peer; fi
fi
[ -d "$peer" ] || { echo "peer_suite: no folder $peer"; exit 2; }
peer=$(cd "$peer" && pwd)
[ -f "$peer/torch_memory_tests.py" ] || { echo "peer_suite: no torch_memory_tests.py in $peer"; exit 2; }
runs=${PEER_RUNS:-pytorch streamsafe_cuda_malloc streamsafe_expandable}
known=" pytorch pytorch_expandable pytorch_expandable_flag streamsafe_cuda_malloc streamsafe_expandable streamsafe_expandable_flag "
seen=" "
for r in $runs; do
  case $known in *" $r "*) ;; *) echo "peer_suite: unknown run $r (one of:$known)"; exit 2 ;; esac
  case $seen in *" $r "*) echo "peer_suite: run $r named twice"; exit 2 ;; esac
  seen="$seen$r "
done
out=${2:-${OUT:-/tmp/peer_suite}}
mkdir -p "$out" ~/.cache
# One snapshot test would download flamegraph.pl to ~/.cache; the peer folder carries it.
[ -f "$peer/flamegraph.pl" ] && cp "$peer/flamegraph.pl" ~/.cache/
tmp=$(mktemp -d /tmp/peer_tc.XXXXXX)  # one folder per run inside
# Interrupted or done: stop the runs still going and remove the copies.
# shellcheck disable=SC2317  # called from the trap
kill_tree() { local c; for c in $(pgrep -P "$1"); do kill_tree "$c"; done; kill "$1" 2>/dev/null; }
# shellcheck disable=SC2154  # j is the trap's own loop variable
trap 'for j in $(jobs -p); do kill_tree "$j"; done; rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM
export PYTHONPATH="$peer${PYTHONPATH:+:$PYTHONPATH}"
timeout_s=${PEER_TIMEOUT:-300}

# The suite's expandable mode, as PyTorch's own expandable run sets it (flag runs only).
flag_conftest() {  # flag_conftest DIR
  cat >"$1/conftest.py" <<'PY'
import os
os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "EXPANDABLE_SEGMENTS"):
            module.EXPANDABLE_SEGMENTS = True
PY
}

run() {  # run NAME [ENV...]
  local name=$1
  shift
  local work=$tmp/$name
  mkdir -p "$work"
  # The copy must be named test_cuda.py: a few tests assert that recorded stacks name that file.
  cp "$peer/torch_memory_tests.py" "$work/test_cuda.py"
  case $name in *_flag) flag_conftest "$work" ;; esac
  echo "== peer suite: $name ($*)"
  # PEER_PYTEST_ARGS splits on spaces (several arguments, none with a space inside).
  # SIGINT at the run's limit: pytest stops the test under way and still prints its summary, so
  # the tests that finished keep their results (--foreground: Ctrl-C reaches pytest too).
  # shellcheck disable=SC2086
  (cd "$work" && env "$@" timeout --foreground -s INT -k 30 "$timeout_s" python3 -m pytest -q -rA \
    -p no:cacheprovider --timeout 90 test_cuda.py ${PEER_K:+-k "$PEER_K"} ${PEER_PYTEST_ARGS:-}) \
    >"$out/$name.log" 2>&1
  local rc=$?
  echo "$rc" >"$tmp/$name.rc"
  local note=""
  [ "$rc" -ge 2 ] && note=" (did not complete: pytest exit 2-5 is an error of the run, 124 its limit)"
  echo "== $name: exit $rc$note; $(grep -E '^(=+ )?[0-9]+ (passed|failed)' "$out/$name.log" | tail -1)"
  grep -E '^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) ' "$out/$name.log" |
    sed -E 's/^([A-Z]+) test_cuda.py::([^ ]+).*/\2 \1/' | sort -u >"$out/$name.results"
}

one() {  # one RUN: the run's settings
  case $1 in
    pytorch) run pytorch ;;
    pytorch_expandable | pytorch_expandable_flag) run "$1" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ;;
    streamsafe_cuda_malloc) run "$1" STREAMSAFE_INSTALL=1 STREAMSAFE_ALLOC_CONF=backend:cuda_malloc ;;
    streamsafe_expandable | streamsafe_expandable_flag)
      run "$1" STREAMSAFE_INSTALL=1 STREAMSAFE_ALLOC_CONF=backend:expandable ;;
  esac
}
for r in $runs; do
  if [ "${PEER_PARALLEL:-0}" = 1 ]; then
    one "$r" &
    sleep 2  # staggered starts: the CUDA contexts come up one at a time
  else
    one "$r"
  fi
done
wait

# shellcheck disable=SC2086  # $known: one argument per run name
python3 - "$out" $known <<'EOF'
import os, sys
out, runs = sys.argv[1], sys.argv[2:]
res = {}
for r in runs:
    path = os.path.join(out, r + ".results")
    if os.path.exists(path):
        d = {}
        for line in open(path):
            parts = line.split()
            if len(parts) == 2:
                # A test that passed but whose tearDown raised has two lines: the failure wins.
                if d.get(parts[0]) not in ("FAILED", "ERROR"):
                    d[parts[0]] = parts[1]
        res[r] = d
shown = [r for r in runs if r in res]
tests = sorted(set().union(*[set(d) for d in res.values()])) if res else []
w = max([len(t) for t in tests] + [10])
print()
print(f"{'test':<{w}}  " + " ".join(f"{r:<26}" for r in shown))
for t in tests:
    print(f"{t:<{w}}  " + " ".join(f"{res[r].get(t, '-'):<26}" for r in shown))
for r in shown:
    d = res[r]
    print(f"{r}: {sum(v == 'PASSED' for v in d.values())} passed, "
          f"{sum(v in ('FAILED', 'ERROR') for v in d.values())} failed")
# Each streamsafe run against PyTorch's allocator in the same mode of the suite: the default and
# streamsafe_expandable with the flag false, PyTorch's expandable runs (flag true) with
# streamsafe_expandable_flag.
pairs = [("pytorch", "streamsafe_cuda_malloc"), ("pytorch", "streamsafe_expandable"),
         ("pytorch_expandable", "streamsafe_expandable_flag"),
         ("pytorch_expandable_flag", "streamsafe_expandable_flag")]
for base, r in pairs:
    if base not in res or r not in res:
        continue
    # Only the tests both runs ran (a PEER_K run beside an earlier full one).
    both = set(res[base]) & set(res[r])
    native = {t for t in both if res[base][t] == "PASSED"}
    lost = sorted(t for t in native if res[r][t] != "PASSED")
    only = len(set(res[base]) ^ set(res[r]))
    print(f"\npasses with {base}, not with {r} ({len(lost)}"
          + (f"; {only} tests ran in only one of the two, not compared" if only else "") + "):")
    for t in lost:
        print("  " + t)
EOF
status=0
for r in $runs; do
  rc=$(cat "$tmp/$r.rc" 2>/dev/null || echo 124)
  [ "$rc" -ge 2 ] && status=1
done
exit $status
