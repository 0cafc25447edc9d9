#!/usr/bin/env bash
# The stream lock, measured: the biased lock against the plain spin lock on this machine's GPU.
# Builds streamsafe_bench twice (-DSTREAMSAFE_STREAM_LOCK=biased and =spin, Release, sm_90),
# then runs the two binaries interleaved (biased, spin, biased, spin, ...) STREAMSAFE_LOCK_REPS
# times (default 5): the one-thread benchmarks pinned to one vCPU (STREAMSAFE_LOCK_CPU, default
# 3), the 8-thread ones to 9 fixed vCPUs (8 threads and the stats() monitor). Benchmarks:
# same_stream_pair 512 B, threads_own_stream (1 and 8 threads), and the same two with a thread
# calling stats() every millisecond (stream_lock_bench.cpp). Writes into $OUT (default ./out):
# lock_compare.md (medians, min-max spread, spin/biased ratio, from bench/stream_lock_compare.py);
# the raw lock_<variant>_<rep>_*.json go to $STREAMSAFE_LOCK_JSON_DIR (default $OUT).
# STREAMSAFE_LOCK_BIASED_BUILD: a build directory whose bench/streamsafe_bench is already the
# biased variant (the default lock), used instead of building one.
#   usage (GPU machine, project root):  bash bench/stream_lock_compare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
OUT=${OUT:-$root/out}
mkdir -p "$OUT"
reps=${STREAMSAFE_LOCK_REPS:-5}
cpu=${STREAMSAFE_LOCK_CPU:-3}
[ -f .device-deps/env.sh ] && source .device-deps/env.sh
json=${STREAMSAFE_LOCK_JSON_DIR:-$OUT}
mkdir -p "$json"
declare -A bench_of
for variant in biased spin; do
  b=$root/build-lock-$variant
  if [ "$variant" = biased ] && [ -n "${STREAMSAFE_LOCK_BIASED_BUILD:-}" ]; then
    bench_of[$variant]=$STREAMSAFE_LOCK_BIASED_BUILD/bench/streamsafe_bench
    continue
  fi
  bench_of[$variant]=$b/bench/streamsafe_bench
  cmake -S . -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DSTREAMSAFE_BUILD_TESTS=OFF -DSTREAMSAFE_BUILD_EXAMPLES=OFF -DSTREAMSAFE_BUILD_BENCHMARKS=ON \
    -DSTREAMSAFE_BENCH_TORCH=OFF -DSTREAMSAFE_TORCH_EXT=OFF -DSTREAMSAFE_STREAM_LOCK=$variant > "$json/lock_configure_$variant.log" 2>&1
  cmake --build "$b" -j "$(nproc)" --target streamsafe_bench > "$json/lock_build_$variant.log" 2>&1
done
one='same_stream_pair/streamsafe_expandable/bytes:512/|threads_own_stream/streamsafe_expandable/real_time/threads:1$|monitored_pair/streamsafe_expandable|monitored_threads_own_stream/streamsafe_expandable/real_time/threads:1$'
eight='threads_own_stream/streamsafe_expandable/real_time/threads:8$|monitored_threads_own_stream/streamsafe_expandable/real_time/threads:8$'
unset CUDA_DEVICE_MAX_CONNECTIONS
for rep in $(seq 1 "$reps"); do
  for variant in biased spin; do
    bin=${bench_of[$variant]}
    taskset -c "$cpu" "$bin" --benchmark_min_time=0.2 --benchmark_filter="$one" \
      --benchmark_out="$json/lock_${variant}_${rep}_one.json" --benchmark_out_format=json > /dev/null
    taskset -c "$((cpu + 1))-$((cpu + 9))" "$bin" --benchmark_min_time=0.2 --benchmark_filter="$eight" \
      --benchmark_out="$json/lock_${variant}_${rep}_eight.json" --benchmark_out_format=json > /dev/null
    echo "rep $rep $variant done"
  done
done
python3 bench/stream_lock_compare.py "$json" | tee "$OUT/lock_compare.md"
