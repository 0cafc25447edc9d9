#!/usr/bin/env bash
# Sets up (Debian packages), builds and runs the race reproduction: on the GPU when there is
# one, on the simulated device otherwise (it says which). Extra arguments go to race_repro.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash .ci/deps.sh
build=${STREAMSAFE_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja >/dev/null
cmake --build "$build" --target race_repro -j "$(nproc)" >/dev/null
exec "$build/examples/race_repro/race_repro" "$@"
