set -uo pipefail
source .device-deps/env.sh
mkdir -p $OUT
( cmake --preset gpu -DSTREAMSAFE_TORCH_EXT=AUTO -DSTREAMSAFE_BENCH_TORCH=OFF > $OUT/build.log 2>&1 && timeout 200 cmake --build build-gpu -j 16 >> $OUT/build.log 2>&1 ) ; echo "build rc $?" | tee $OUT/summary.log
tail -5 $OUT/build.log >> $OUT/summary.log
ext=$(find build-gpu -name 'libstreamsafe_torch_ext.so' | head -1); plug=$(find build-gpu -name 'libstreamsafe_torch.so' | head -1)
export PYTHONPATH=$PWD/allocator/python STREAMSAFE_TORCH_EXT_LIB=$PWD/$ext STREAMSAFE_TORCH_LIB=$PWD/$plug PYTHONUNBUFFERED=1
timeout 60 build-gpu/tests/streamsafe_tests "[gpu]" > $OUT/gpu_tests.log 2>&1; echo "gpu suite rc $?" >> $OUT/summary.log; tail -3 $OUT/gpu_tests.log >> $OUT/summary.log
timeout 150 python3 -m pytest -q -rA --timeout=100 tests/python > $OUT/pytest.log 2>&1; echo "pytest rc $?" >> $OUT/summary.log; tail -25 $OUT/pytest.log >> $OUT/summary.log
timeout 150 python3 examples/pytorch/sleep_wake.py --params 32 --mib 64 --cycles 2 --timeout 70 > $OUT/sleep_wake.log 2>&1; echo "sleep_wake rc $?" >> $OUT/summary.log; cat $OUT/sleep_wake.log >> $OUT/summary.log
