#!/usr/bin/env bash
# Installs the Debian packages streamsafe builds with (CUDA itself is expected under /usr/local/cuda).
set -euo pipefail
pkgs=(cmake ninja-build g++ catch2 libspdlog-dev libfmt-dev libbenchmark-dev zlib1g-dev)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "streamsafe needs the CUDA Toolkit 13 at /usr/local/cuda (nvcc not found)" >&2
  exit 1
fi
