#!/usr/bin/env bash
# Sets up (Debian packages), builds everything and runs the tests. Host tests run on the
# simulated device anywhere; [gpu] tests run where a GPU is present and skip with a message
# otherwise. Usage: bash tests/run.sh
#   STREAMSAFE_PRESET    the configure preset of CMakePresets.json (default: default; CI: werror)
#   STREAMSAFE_BUILD_DIR the build directory (default: build/)
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/deps.sh
preset=${STREAMSAFE_PRESET:-default}
build=${STREAMSAFE_BUILD_DIR:-build}
cmake --preset "$preset" -B "$build"
cmake --build "$build" -j "$(nproc)"
ctest --test-dir "$build" --output-on-failure
