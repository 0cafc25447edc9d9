#!/bin/bash
# GPU check of every front end: build, front-end [gpu] tests, the C and CUB examples, the
# LD_PRELOAD loop (with and without, and under memcheck), the PyTorch GPT run. Logs under $OUT.
# On the GPU machine, from the project root: bash examples/frontends_gpu_check.sh
set -u
: "${OUT:=out}"; mkdir -p "$OUT"
[ -f .device-deps/env.sh ] && source .device-deps/env.sh

B=build-gpu
( cmake -S . -B $B -G Ninja -DSTREAMSAFE_BUILD_BENCHMARKS=OFF && cmake --build $B -j16 ) > /tmp/build.log 2>&1; echo "build rc=$?"; tail -3 /tmp/build.log
$B/tests/streamsafe_tests "[frontend],[capi],[adapters],[preload]" > $OUT/frontend_tests.log 2>&1; echo "frontend tests rc=$?"; tail -2 $OUT/frontend_tests.log
{ $B/examples/c_api/streamsafe_c_example; echo "c_api rc=$?"; $B/examples/cub/cub_example --iterations 200; echo "cub rc=$?"; } > $OUT/examples.log 2>&1
grep -E "rc=|passed|FAILED|us per" $OUT/examples.log
{ echo "== cuda_malloc backend"; bash examples/preload/run.sh $B;
  echo "== memcheck"; STREAMSAFE_LOG_LEVEL=warn timeout 60 compute-sanitizer --tool memcheck --target-processes all env LD_PRELOAD=$PWD/$B/allocator/libstreamsafe_preload.so $B/examples/preload/preload_loop --iterations 100; echo "sanitizer rc=$?"; } > $OUT/preload.log 2>&1
grep -E "^==|contract|identical|time with|time without|driver allocations|ERROR SUMMARY|rc=" $OUT/preload.log
timeout 150 python3 examples/pytorch/train_gpt.py --build $B --steps 12 --warmup 3 --json $OUT/gpt.json > $OUT/pytorch.log 2>&1; echo "pytorch rc=$?"; tail -8 $OUT/pytorch.log
