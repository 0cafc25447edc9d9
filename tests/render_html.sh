#!/usr/bin/env bash
# Renders an HTML file to a PNG with headless Chromium (Debian's `chromium` package), the way a
# person's browser shows it, and checks the picture with tests/render_html_check.py: its size,
# that it is not blank, that the plot's fills are drawn, and that the segment map shows one band
# per mapped row with its colours in the proportion of the report's active and inactive bytes.
#
# Usage: tests/render_html.sh IN.html OUT.png [WIDTH,HEIGHT]   (default 1400,1000)
# Exit: 0 rendered and checked; 77 skipped (Chromium or python3 absent: the message says how to
#       install it); 1 the input is missing, Chromium failed, or the PNG is missing, not a PNG,
#       blank or not the picture the report describes.
# Chromium gets a throw-away profile and no network features; --no-sandbox because CI runs as
# root. A blank 1400x1000 page compresses to a few KiB; a page with text and plots to far more.
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 IN.html OUT.png [WIDTH,HEIGHT]" >&2
  exit 1
fi
in=$1
out=$2
size=${3:-1400,1000}
min_png_bytes=${STREAMSAFE_MIN_PNG_BYTES:-20000}

browser=""
for candidate in chromium chromium-browser google-chrome; do
  if command -v "$candidate" >/dev/null 2>&1; then
    browser=$candidate
    break
  fi
done
if [ -z "$browser" ]; then
  echo "skipped: Chromium is not installed (Debian: apt-get install -y chromium)"
  exit 77
fi
if ! command -v python3 >/dev/null 2>&1; then
  echo "skipped: python3 is not installed (Debian: apt-get install -y python3)"
  exit 77
fi
if [ ! -f "$in" ]; then
  echo "render_html: no such file: $in" >&2
  exit 1
fi

profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
in_abs=$(realpath "$in")
out_abs=$(realpath -m "$out")
mkdir -p "$(dirname "$out_abs")"
rm -f "$out_abs"

if ! timeout 120 "$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$profile" --hide-scrollbars --screenshot="$out_abs" --window-size="$size" \
    "file://$in_abs" >"$profile/chromium.log" 2>&1; then
  echo "render_html: $browser failed:" >&2
  cat "$profile/chromium.log" >&2
  exit 1
fi
if [ ! -s "$out_abs" ]; then
  echo "render_html: $browser wrote no screenshot; its log:" >&2
  cat "$profile/chromium.log" >&2
  exit 1
fi
if [ "$(head -c 8 "$out_abs" | od -An -tx1 | tr -d ' \n')" != "89504e470d0a1a0a" ]; then
  echo "render_html: $out_abs is not a PNG" >&2
  exit 1
fi
# Width and height from the IHDR chunk (big-endian at bytes 16..23).
dims=$(od -An -tu1 -j16 -N8 "$out_abs" | awk '{printf "%d x %d", $1*16777216+$2*65536+$3*256+$4, $5*16777216+$6*65536+$7*256+$8}')
bytes=$(stat -c %s "$out_abs")
if [ "$bytes" -lt "$min_png_bytes" ]; then
  echo "render_html: $out_abs ($dims, $bytes bytes) looks blank (fewer than $min_png_bytes bytes)" >&2
  exit 1
fi
if ! python3 "$(dirname "$0")/render_html_check.py" "$out_abs" --html "$in_abs" --size "$size"; then
  echo "render_html: $out_abs ($dims, $bytes bytes) is not the picture $in describes" >&2
  exit 1
fi
echo "rendered $in -> $out_abs ($dims pixels, $bytes bytes) with $browser"
