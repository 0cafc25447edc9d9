#!/usr/bin/env bash
# Runs examples/preload/loop without and with libstreamsafe_preload.so (LD_PRELOAD) and compares:
# the checksums must be identical; the interposer's summary shows its driver allocations next to
# the program's cudaMalloc count; both times are printed.
#   usage: examples/preload/run.sh [BUILD_DIR] [loop arguments...]     (BUILD_DIR default: build)
# Exit status: 0 when both runs pass and agree.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
[ $# -gt 0 ] && shift
loop="$build/examples/preload/preload_loop"
lib="$(cd "$build/allocator" && pwd)/libstreamsafe_preload.so"
for f in "$loop" "$lib"; do
  [ -e "$f" ] || { echo "missing $f: build the targets preload_loop and streamsafe_preload first" >&2; exit 1; }
done

echo "== without the interposer"
plain=$("$loop" "$@") || { echo "$plain"; echo "FAILED without the interposer" >&2; exit 1; }
echo "$plain"
echo
echo "== with LD_PRELOAD=$lib"
preloaded=$(STREAMSAFE_LOG_LEVEL=${STREAMSAFE_LOG_LEVEL:-info} LD_PRELOAD="$lib" "$loop" "$@" 2>&1) ||
  { echo "$preloaded"; echo "FAILED with the interposer" >&2; exit 1; }
echo "$preloaded"
echo
sum_plain=$(grep '^checksum:' <<<"$plain")
sum_pre=$(grep '^checksum:' <<<"$preloaded")
if [ "$sum_plain" != "$sum_pre" ]; then
  echo "checksums differ:"$'\n'"  $sum_plain"$'\n'"  $sum_pre" >&2
  exit 1
fi
echo "identical results: $sum_plain"
echo "time without: $(grep -o '[0-9.]* s ([0-9.]* us per iteration)' <<<"$plain")"
echo "time with:    $(grep -o '[0-9.]* s ([0-9.]* us per iteration)' <<<"$preloaded")"
grep -o '"num_device_alloc": [0-9]*' <<<"$preloaded" | head -1 | sed 's/^/driver allocations with the interposer: /' || true
grep -o '[0-9]* cudaMalloc + [0-9]* cudaMallocAsync calls' <<<"$plain" | sed 's/^/driver allocations without: /' || true
