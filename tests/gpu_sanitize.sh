#!/usr/bin/env bash
# Runs the [gpu] test suite under NVIDIA compute-sanitizer, once per tool: memcheck (with
# --leak-check full), racecheck and synccheck. Needs a machine with a GPU and a build made
# there (bash tests/run.sh, or the gpu preset). One log per tool; exits non-zero when any tool
# reports an error, a test fails, or the [gpu] tests were skipped (no GPU).
#
#   bash tests/gpu_sanitize.sh [BUILD_DIR|TEST_BINARY] [TOOL...]
#     BUILD_DIR    default build; the binary is BUILD_DIR/tests/streamsafe_tests
#     TEST_BINARY  a streamsafe_tests executable given by path
#     TOOL         memcheck, racecheck, synccheck (default: all three, in that order)
#
# Environment:
#   COMPUTE_SANITIZER              the sanitizer (default: compute-sanitizer on PATH, else
#                                  /usr/local/cuda/bin/compute-sanitizer)
#   STREAMSAFE_GPU_SANITIZE_TESTS  the Catch2 test spec (default: [gpu] without the one test
#                                  whose child process faults on purpose, see below)
#   STREAMSAFE_GPU_SANITIZE_LOGS   where the logs go (default: BUILD_DIR/gpu-sanitize, or
#                                  gpu-sanitize beside TEST_BINARY)
#   STREAMSAFE_GPU_SANITIZE_TIMEOUT  seconds allowed per tool (default: no limit)
#
# Processes: --target-processes all, so the programs the tests start (the race example's
# children, the C example, the interposer's loop) are checked too. The test "On the GPU the
# allocation_stream scope unmaps under a pending kernel and faults" runs a child that reproduces
# the illegal memory access on purpose, so it is left out of the default spec.
set -euo pipefail

deliberate_fault='On the GPU the allocation_stream scope unmaps under a pending kernel and faults'
default_spec="[gpu]~\"$deliberate_fault\""

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//' >&2
  exit 2
}

target=${1:-build}
[ $# -gt 0 ] && shift
case "$target" in -h|--help) usage ;; esac

if [ -d "$target" ]; then
  binary="$target/tests/streamsafe_tests"
  logs_default="$target/gpu-sanitize"
elif [ -f "$target" ]; then
  binary="$target"
  logs_default="$(dirname "$target")/gpu-sanitize"
else
  echo "gpu_sanitize: '$target' is neither a build directory nor a test binary" >&2
  usage
fi
[ -x "$binary" ] || { echo "gpu_sanitize: no executable test binary at $binary (build first)" >&2; exit 2; }

tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck synccheck)
for tool in "${tools[@]}"; do
  case "$tool" in
    memcheck|racecheck|synccheck) ;;
    *) echo "gpu_sanitize: unknown tool '$tool' (memcheck, racecheck or synccheck)" >&2; exit 2 ;;
  esac
done

sanitizer=${COMPUTE_SANITIZER:-}
if [ -z "$sanitizer" ]; then
  if command -v compute-sanitizer >/dev/null 2>&1; then sanitizer=compute-sanitizer
  else sanitizer=/usr/local/cuda/bin/compute-sanitizer; fi
fi
command -v "$sanitizer" >/dev/null 2>&1 || [ -x "$sanitizer" ] ||
  { echo "gpu_sanitize: compute-sanitizer not found ($sanitizer); set COMPUTE_SANITIZER" >&2; exit 2; }

spec=${STREAMSAFE_GPU_SANITIZE_TESTS:-$default_spec}
logs=${STREAMSAFE_GPU_SANITIZE_LOGS:-$logs_default}
timeout_s=${STREAMSAFE_GPU_SANITIZE_TIMEOUT:-}
mkdir -p "$logs"

# Sums the counts of one summary line over every process the sanitizer reported on.
sum_of() {  # file, extended regex whose first group is the count
  sed -nE "s/.*$2.*/\\1/p" "$1" | awk '{ s += $1 } END { print s + 0 }'
}

echo "gpu_sanitize: $("$sanitizer" --version 2>/dev/null | grep -m1 -i version || echo "$sanitizer")"
echo "gpu_sanitize: $binary $spec; logs in $logs"
failed=()
for tool in "${tools[@]}"; do
  log="$logs/$tool.log"
  args=(--tool "$tool" --target-processes all --error-exitcode 86)
  [ "$tool" = memcheck ] && args+=(--leak-check full)
  cmd=("$sanitizer" "${args[@]}" "$binary" "$spec")
  [ -n "$timeout_s" ] && cmd=(timeout --kill-after=30 "$timeout_s" "${cmd[@]}")
  echo "== $tool: ${cmd[*]}" | tee "$log"
  start=$(date +%s)
  rc=0
  "${cmd[@]}" >> "$log" 2>&1 || rc=$?
  secs=$(( $(date +%s) - start ))

  # memcheck and synccheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: N hazards
  # displayed (E errors, W warnings)"; memcheck's leak check: "LEAK SUMMARY: B bytes leaked".
  summaries=$(grep -cE 'ERROR SUMMARY:|RACECHECK SUMMARY:' "$log" || true)
  errors=$(sum_of "$log" 'ERROR SUMMARY: ([0-9]+) error')
  errors=$(( errors + $(sum_of "$log" 'RACECHECK SUMMARY: [0-9]+ hazards? displayed \(([0-9]+) error') ))
  warnings=$(sum_of "$log" 'RACECHECK SUMMARY: .*, ([0-9]+) warning')
  leaked=$(sum_of "$log" 'LEAK SUMMARY: ([0-9]+) bytes? leaked')
  skipped=$(grep -c 'skipped: no GPU present' "$log" || true)
  tests=$(grep -E '^(All tests passed|test cases:)' "$log" | tail -1 || true)

  verdict=clean
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="timed out after ${timeout_s} s"
  elif [ "$errors" -gt 0 ]; then verdict="errors reported: $errors"
  elif [ "$leaked" -gt 0 ]; then verdict="bytes leaked: $leaked"
  elif [ "$rc" -eq 86 ]; then verdict="the sanitizer reported errors (exit 86)"
  elif [ "$rc" -ne 0 ]; then verdict="exit status $rc (a test failed or the run broke)"
  elif [ "$summaries" -eq 0 ]; then verdict="no sanitizer summary in the log"
  elif [ "$skipped" -gt 0 ]; then verdict="tests skipped for want of a GPU: $skipped"
  fi
  extra=""; [ "$tool" = racecheck ] && extra="; racecheck warnings: $warnings"
  echo "$tool: $verdict; ${tests:-no test summary}$extra; ${secs} s; $log"
  [ "$verdict" = clean ] || failed+=("$tool")
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_sanitize: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "gpu_sanitize: ${tools[*]}: clean"
