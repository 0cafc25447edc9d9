#!/usr/bin/env bash
# Checks that every tracked C, C++ and CUDA file is formatted as .clang-format says (clang-format
# 14, the Debian 12 package). Changes nothing; exits non-zero and names the files that differ.
#   bash .ci/format.sh            check
#   bash .ci/format.sh --fix      reformat the files in place (for the author, not for CI)
# The formatter: $CLANG_FORMAT, else clang-format-14, else clang-format.
set -euo pipefail
cd "$(dirname "$0")/.."
fix=0
case "${1:-}" in
  "") ;;
  --fix) fix=1 ;;
  *) echo "usage: bash .ci/format.sh [--fix]" >&2; exit 2 ;;
esac

formatter=${CLANG_FORMAT:-}
if [ -z "$formatter" ]; then
  command -v clang-format-14 >/dev/null 2>&1 || command -v clang-format >/dev/null 2>&1 ||
    bash .ci/deps.sh --host-only clang-format
  if command -v clang-format-14 >/dev/null 2>&1; then formatter=clang-format-14; else formatter=clang-format; fi
fi
echo "format: $("$formatter" --version)"

mapfile -t files < <(git ls-files -- '*.c' '*.cc' '*.cpp' '*.cxx' '*.h' '*.hh' '*.hpp' '*.cu' '*.cuh')
[ ${#files[@]} -gt 0 ] || { echo "format: no files"; exit 0; }

if [ "$fix" = 1 ]; then
  "$formatter" -i --style=file "${files[@]}"
  echo "format: reformatted ${#files[@]} files"
  exit 0
fi

bad=()
for f in "${files[@]}"; do
  "$formatter" --dry-run -Werror --style=file "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "format: ${#bad[@]} of ${#files[@]} files differ from .clang-format:" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "format: see one with: $formatter --dry-run --style=file FILE; fix all with: bash .ci/format.sh --fix" >&2
  exit 1
fi
echo "format: ${#files[@]} files clean"
