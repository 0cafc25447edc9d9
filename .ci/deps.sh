#!/usr/bin/env bash
# Installs the Debian packages streamsafe builds with (CUDA itself is expected under /usr/local/cuda).
#   bash .ci/deps.sh                  the packages of the main build, and checks for nvcc
#   bash .ci/deps.sh --host-only P..  only the named packages (host-only builds: sanitizers, fuzzing)
set -euo pipefail
need_cuda=1
if [ "${1:-}" = "--host-only" ]; then
  shift
  need_cuda=0
  pkgs=("$@")
else
  pkgs=(cmake ninja-build g++ catch2 libspdlog-dev libfmt-dev libbenchmark-dev zlib1g-dev
        chromium fonts-liberation python3 "$@")  # chromium: the rendered HTML picture test
fi
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if [ "$need_cuda" = 1 ] && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "streamsafe needs the CUDA Toolkit 13 at /usr/local/cuda (nvcc not found)" >&2
  exit 1
fi
