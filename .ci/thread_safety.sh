#!/usr/bin/env bash
# CI: the lock contracts checked by the compiler. Builds the host-only tree (core, simulated
# device, host tests) with clang and -Wthread-safety -Werror (preset thread-safety): a function
# marked REQUIRES(lock) called without it, or a GUARDED_BY member touched without its lock, fails
# the build (src/core/common/thread_annotations.hpp).
#   bash .ci/thread_safety.sh   (build directory: build-thread-safety/)
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/deps.sh --host-only clang cmake ninja-build catch2 libspdlog-dev libfmt-dev zlib1g-dev
env PATH=/usr/bin:/bin cmake --preset thread-safety
env PATH=/usr/bin:/bin cmake --build --preset thread-safety -j "$(nproc)"
