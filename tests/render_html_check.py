#!/usr/bin/env python3
"""Checks the screenshot of a streamsafe-replay HTML report (tests/render_html.sh makes it).

    python3 tests/render_html_check.py OUT.png --html IN.html [--size 1400,1000]

Decodes the PNG with the standard library (zlib; 8-bit greyscale, RGB or RGBA, not interlaced)
and asserts what a person would see:
  - the picture has the window's size and is not blank (at most 90% one colour, >= 16 colours);
  - the bytes-over-time plot is drawn: its allocated fill (#a9c0dc) and its reserved fill
    (#fbd5ad) each cover at least 0.5% of the picture;
  - the segment map is drawn: bands of pixel rows at least 60% covered by the active colour of
    stream 0 (#4e79a7) or the inactive colour (#d3d3d3), one band per full map row; their number
    matches the report's "N mapped" / "Each row is R" (full rows; all of them when the map ends
    inside the window);
  - the colours appear in the report's proportion: within the bands, inactive pixels / (active +
    inactive pixels) is within 0.01 (absolute) or a third (relative) of the report's inactive
    bytes / (active + pending free + inactive bytes).
Exit 0 when all hold, 1 with the reasons otherwise.
"""

import argparse
import collections
import re
import struct
import sys
import zlib

ACTIVE0 = (0x4E, 0x79, 0xA7)
INACTIVE = (0xD3, 0xD3, 0xD3)
ALLOCATED_FILL = (0xA9, 0xC0, 0xDC)
RESERVED_FILL = (0xFB, 0xD5, 0xAD)
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def read_png(path):
    """(width, height, rows): rows[y] is a bytes object of RGB triples."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    pos, idat, ihdr = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    if ihdr is None:
        raise ValueError("no IHDR chunk")
    width, height, depth, colour, _, _, interlace = ihdr
    channels = {0: 1, 2: 3, 4: 2, 6: 4}.get(colour)
    if depth != 8 or channels is None or interlace:
        raise ValueError(f"unsupported PNG: depth {depth}, colour type {colour}, interlace {interlace}")
    raw = zlib.decompress(b"".join(idat))
    bpp, stride = channels, width * channels
    if len(raw) != height * (stride + 1):
        raise ValueError("truncated image data")
    prev = bytearray(stride)
    rows = []
    for y in range(height):
        start = y * (stride + 1)
        ftype = raw[start]
        line = bytearray(raw[start + 1 : start + 1 + stride])
        if ftype == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 0xFF
        elif ftype == 2:
            line = bytearray((a + b) & 0xFF for a, b in zip(line, prev))
        elif ftype == 3:
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 0xFF
        elif ftype == 4:
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b = prev[i]
                c = prev[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        elif ftype != 0:
            raise ValueError(f"bad filter type {ftype} on row {y}")
        prev = line
        if channels == 3:
            rows.append(bytes(line))
        elif channels == 4:
            rgb = bytearray(width * 3)
            rgb[0::3], rgb[1::3], rgb[2::3] = line[0::4], line[1::4], line[2::4]
            rows.append(bytes(rgb))
        else:
            grey = line[0::channels]
            rgb = bytearray(width * 3)
            rgb[0::3] = rgb[1::3] = rgb[2::3] = grey
            rows.append(bytes(rgb))
    return width, height, rows


def bytes_of(text):
    number, unit = text.split()
    return float(number.replace(",", "")) * UNITS[unit]


def report_facts(html):
    """Mapped bytes, row bytes and active/pending/inactive bytes from the map's note."""
    size = r"([\d.,]+ (?:B|KiB|MiB|GiB|TiB))"
    m = re.search(size + r" mapped: active " + size + r", pending free " + size + r", inactive " + size, html)
    row = re.search(r"Each row is " + size, html)
    if not m or not row:
        raise ValueError("the HTML has no segment-map note ('... mapped: active ..., inactive ...; Each row is ...')")
    mapped, active, pending, inactive = (bytes_of(g) for g in m.groups())
    return mapped, bytes_of(row.group(1)), active, pending, inactive


def check(png, html_path, size):
    problems = []
    width, height, rows = read_png(png)
    if size and (width, height) != size:
        problems.append(f"the picture is {width} x {height}, not {size[0]} x {size[1]}")
    counts = collections.Counter()
    per_row = []
    for row in rows:
        c = collections.Counter(row[i : i + 3] for i in range(0, len(row), 3))
        per_row.append(c)
        counts.update(c)
    total = width * height
    top = max(counts.values())
    if top > 0.9 * total:
        problems.append(f"blank: one colour covers {100 * top / total:.1f}% of the picture")
    if len(counts) < 16:
        problems.append(f"blank: only {len(counts)} colours")
    for name, colour in (("allocated fill", ALLOCATED_FILL), ("reserved fill", RESERVED_FILL)):
        share = counts.get(bytes(colour), 0) / total
        if share < 0.005:
            problems.append(f"the plot's {name} #{bytes(colour).hex()} covers {100 * share:.2f}% (< 0.5%)")

    with open(html_path, encoding="utf-8") as f:
        try:
            mapped, row_bytes, active_b, pending_b, inactive_b = report_facts(f.read())
        except ValueError as e:
            return problems + [str(e)], ""
    active_px, inactive_px = bytes(ACTIVE0), bytes(INACTIVE)
    bands, in_band, last_band_end = [], False, 0
    a_count = i_count = 0
    for y, c in enumerate(per_row):
        a, n = c[active_px], c[inactive_px]
        if a + n >= 0.6 * width:
            a_count += a
            i_count += n
            if not in_band:
                bands.append(y)
            in_band = True
            last_band_end = y
        else:
            in_band = False
    full_rows = int(mapped // row_bytes)
    cut_off = last_band_end > height - 40  # the map may go on below the window
    if not bands:
        problems.append("no segment map: no band of rows in the active/inactive colours")
    elif len(bands) > full_rows + 1 or (not cut_off and len(bands) < max(1, full_rows - 1)):
        problems.append(f"{len(bands)} map bands drawn; the report maps {mapped:.0f} B in rows of {row_bytes:.0f} B "
                        f"({full_rows} full rows)")
    if bands:
        expected = inactive_b / max(1.0, active_b + pending_b + inactive_b)
        seen = i_count / max(1, a_count + i_count)
        if abs(seen - expected) > max(0.01, expected / 3):
            problems.append(f"inactive share of the map: {seen:.4f} of its pixels, {expected:.4f} of its bytes")
    summary = (f"{width} x {height}, {len(counts)} colours, {len(bands)} map bands "
               f"({full_rows} full rows mapped), inactive share {i_count / max(1, a_count + i_count):.4f} of "
               f"pixels vs {inactive_b / max(1.0, active_b + pending_b + inactive_b):.4f} of bytes")
    return problems, summary


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("png")
    ap.add_argument("--html", required=True, help="the HTML report the picture shows")
    ap.add_argument("--size", help="WIDTH,HEIGHT the picture must have")
    args = ap.parse_args()
    size = tuple(int(v) for v in args.size.split(",")) if args.size else None
    try:
        problems, summary = check(args.png, args.html, size)
    except (OSError, ValueError, zlib.error) as e:
        print(f"render_html_check: {args.png}: {e}", file=sys.stderr)
        return 1
    if problems:
        for p in problems:
            print(f"render_html_check: {args.png}: {p}", file=sys.stderr)
        return 1
    print(f"render_html_check: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
