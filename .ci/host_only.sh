#!/usr/bin/env bash
# CI: the host-only build (preset host-only: STREAMSAFE_ENABLE_CUDA=OFF) configured, built and
# tested with no CUDA compiler reachable (PATH without /usr/local/cuda/bin): the core, the
# simulated device, the host tests and the replay tool on the simulated device.
# Usage: bash .ci/host_only.sh   (build directory: build-host-only/)
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/deps.sh --host-only cmake ninja-build g++ catch2 libspdlog-dev libfmt-dev zlib1g-dev
env PATH=/usr/bin:/bin cmake --preset host-only
env PATH=/usr/bin:/bin cmake --build --preset host-only -j "$(nproc)"
env PATH=/usr/bin:/bin ctest --preset host-only
