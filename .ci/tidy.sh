#!/usr/bin/env bash
# Runs clang-tidy (.clang-tidy; clang-tidy 14, the Debian 12 package) over the allocator core
# (allocator/src/core) and the simulated device (allocator/src/sim), with the compile commands
# of a host-only build (no CUDA), and fails on any finding. Prints the findings per check.
#   bash .ci/tidy.sh [BUILD_DIR]     (default: $STREAMSAFE_TIDY_BUILD_DIR or build-tidy)
# Full output: BUILD_DIR/clang-tidy.log. Files: $STREAMSAFE_TIDY_FILES (a regex over the paths
# in compile_commands.json; default the two folders above).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-${STREAMSAFE_TIDY_BUILD_DIR:-build-tidy}}
files=${STREAMSAFE_TIDY_FILES:-/allocator/src/(core|sim)/}

bash .ci/deps.sh --host-only clang clang-tidy cmake ninja-build catch2 libspdlog-dev libfmt-dev \
  libbenchmark-dev zlib1g-dev

# Configure only: clang-tidy needs the compile commands, not the objects. clang++ so that the
# flags in compile_commands.json are ones clang-tidy understands.
mkdir -p "$build"
cmake -S . -B "$build" -G Ninja -DSTREAMSAFE_ENABLE_CUDA=OFF -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ > "$build/configure.log" 2>&1 ||
  { cat "$build/configure.log" >&2; exit 1; }
[ -f "$build/compile_commands.json" ] || { echo "tidy: no $build/compile_commands.json" >&2; exit 1; }

tidy=clang-tidy; command -v clang-tidy-14 >/dev/null 2>&1 && tidy=clang-tidy-14
runner=""
for r in run-clang-tidy-14 run-clang-tidy; do command -v "$r" >/dev/null 2>&1 && { runner=$r; break; }; done
echo "tidy: $("$tidy" --version | grep -m1 version), files matching '$files'"

log="$build/clang-tidy.log"
status=0
if [ -n "$runner" ]; then
  "$runner" -clang-tidy-binary "$(command -v "$tidy")" -p "$build" -j "$(nproc)" -quiet "$files" \
    > "$log" 2>&1 || status=$?
else
  mapfile -t tus < <(python3 -c 'import json,re,sys
for e in json.load(open(sys.argv[1])):
    if re.search(sys.argv[2], e["file"]): print(e["file"])' "$build/compile_commands.json" "$files")
  for tu in "${tus[@]}"; do "$tidy" -p "$build" --quiet "$tu" >> "$log" 2>&1 || status=$?; done
fi

# A header's finding is printed once per translation unit that includes it: count each once.
findings=$(sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -E ': (warning|error): ' | sort -u || true)
if [ -n "$findings" ]; then
  echo "${findings//$PWD\//}"
  echo
  echo "tidy: $(echo "$findings" | wc -l) findings; per check:"
  echo "$findings" | grep -oE '\[[a-z0-9.,-]+\]$' | sort | uniq -c | sort -rn
  exit 1
fi
if [ "$status" -ne 0 ]; then
  echo "tidy: clang-tidy failed (exit $status) with no finding; see $log" >&2
  exit 1
fi
echo "tidy: clean"
