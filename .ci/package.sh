#!/usr/bin/env bash
# Package check (no GPU needed): installs streamsafe into a temporary prefix, then builds and runs
# against the INSTALLED tree (1) examples/consumer with CMake's find_package(streamsafe), and
# (2) examples/consumer/main.c with pkg-config, as a C user outside CMake would.
#   usage: bash .ci/package.sh [BUILD_DIR]   (default: $STREAMSAFE_BUILD_DIR or build; configured
#          here with the preset $STREAMSAFE_PRESET (default: default) if it is not, built
#          incrementally either way)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-${STREAMSAFE_BUILD_DIR:-build}}
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake --preset "${STREAMSAFE_PRESET:-default}" -B "$build"
fi
cmake --build "$build" -j "$(nproc)"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"
cmake --install "$build" --prefix "$prefix" > "$work/install.log"
echo "installed into a temporary prefix: $(find "$prefix" -type f | wc -l) files"

# (1) CMake: find_package(streamsafe) against the installed tree only.
cmake -S examples/consumer -B "$work/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_FLAGS="-Wall -Wextra -Wpedantic -Werror" \
  -DCMAKE_CXX_FLAGS="-Wall -Wextra -Wpedantic -Werror" > "$work/configure.log" ||
  { cat "$work/configure.log"; exit 1; }
cmake --build "$work/consumer"
ctest --test-dir "$work/consumer" --output-on-failure

# (2) pkg-config: a plain C99 compile and link.
libdir=$(cd "$(dirname "$(find "$prefix" -name streamsafe.pc -print -quit)")/.." && pwd)
export PKG_CONFIG_PATH="$libdir/pkgconfig"
flags=$(pkg-config --cflags --libs streamsafe)
echo "pkg-config --cflags --libs streamsafe: $flags"
# shellcheck disable=SC2086
cc -std=c99 -Wall -Wextra -Wpedantic -Werror examples/consumer/main.c $flags \
  -Wl,-rpath,"$(pkg-config --variable=libdir streamsafe)" -o "$work/consumer_pc"
"$work/consumer_pc"
echo "package check: ok"
