#!/usr/bin/env python3
"""Summarises bench/stream_lock_compare.sh: for each benchmark, the median over the repetitions
of ns_per_pair for the biased and the spin build, the min-max spread of each, and spin/biased.
Usage: python3 bench/stream_lock_compare.py OUT_DIR   (reads OUT_DIR/lock_<variant>_<rep>_*.json)"""
import glob
import json
import os
import statistics
import sys
from collections import defaultdict


def main(out_dir):
    runs = defaultdict(lambda: defaultdict(list))  # benchmark -> variant -> [ns]
    for path in sorted(glob.glob(os.path.join(out_dir, "lock_*_*_*.json"))):
        variant = os.path.basename(path).split("_")[1]
        with open(path) as f:
            for b in json.load(f).get("benchmarks", []):
                if b.get("run_type") != "iteration" or "ns_per_pair" not in b:
                    continue
                name = b["name"].replace("/real_time", "")
                runs[name][variant].append(b["ns_per_pair"])
    print("| benchmark | biased ns/pair (median, min-max) | spin ns/pair (median, min-max) | spin / biased | runs |")
    print("| --- | --- | --- | --- | --- |")
    for name in sorted(runs):
        cells = []
        med = {}
        for v in ("biased", "spin"):
            xs = runs[name][v]
            if not xs:
                cells.append("-")
                continue
            med[v] = statistics.median(xs)
            cells.append(f"{med[v]:.1f} ({min(xs):.1f}-{max(xs):.1f})")
        ratio = f"{med['spin'] / med['biased']:.3f}" if len(med) == 2 else "-"
        n = min(len(runs[name]["biased"]), len(runs[name]["spin"]))
        print(f"| {name} | {cells[0]} | {cells[1]} | {ratio} | {n} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out")
