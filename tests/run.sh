#!/usr/bin/env bash
# Sets up (Debian packages), builds everything and runs the tests. Host tests run on the
# simulated device anywhere; [gpu] tests run where a GPU is present and skip with a message
# otherwise. Usage: bash tests/run.sh   (build directory: build/, or $STREAMSAFE_BUILD_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/deps.sh
build=${STREAMSAFE_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DSTREAMSAFE_WERROR=${STREAMSAFE_WERROR:-OFF}
cmake --build "$build" -j "$(nproc)"
ctest --test-dir "$build" --output-on-failure
