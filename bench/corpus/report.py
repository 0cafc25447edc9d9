#!/usr/bin/env python3
"""Replays every corpus trace with streamsafe's two backends and prints one table beside
PyTorch's own ratios (peak reserved / peak allocated) recorded when the trace was captured.

    python3 bench/corpus/report.py --replay build/bench/replay/streamsafe-replay
    python3 bench/corpus/report.py --check            (the ctest: exit 1 above a ceiling)
    python3 bench/corpus/report.py --write-doc docs/corpus.md
    python3 bench/corpus/report.py --update-ceilings  (ceilings := today's ratios + 0.1%)
    python3 bench/corpus/report.py --repeat 4         (also the steady state: each trace 4 times
                                                        back to back, streamsafe-replay --repeat)
    python3 bench/corpus/report.py --conf expandable_chunk_mb:2   (other settings, same table)

The traces are bench/traces/corpus/NAME.csv.gz; ratios.csv beside this file lists each one
with its split (tuning or held-out), PyTorch's peaks from capture.sh (default settings and
expandable_segments:True) and the ceilings --check holds. The replay runs on the simulated
device (its ratios equal --gpu's); events/s is allocator CPU time on this machine, the best of
--passes. Targets: expandable <= min(PyTorch expandable, 1.01), cuda_malloc <=
min(PyTorch default, 1.05); they are printed as met or missed, and only the ceilings fail
--check.
"""

import argparse
import csv
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
DEFAULT_RATIOS = os.path.join(HERE, "ratios.csv")
DEFAULT_TRACES = os.path.join(ROOT, "bench", "traces", "corpus")
REPLAY_CANDIDATES = [
    os.path.join(ROOT, "build", "allocator", "tools", "replay", "streamsafe-replay"),
    os.path.join(ROOT, "build", "bench", "replay", "streamsafe-replay"),
]
BACKENDS = ("expandable", "cuda_malloc")
EXPANDABLE_TARGET, CUDA_MALLOC_TARGET = 1.01, 1.05
CEILING_MARGIN = 1.001
SPLITS = ("tuning", "held-out")
EXTRA_CONF = ""  # --conf: options after backend:B, for comparing settings (not with the ceilings)
FIELDS = ["trace", "split", "pytorch_default_reserved", "pytorch_default_allocated", "pytorch_default_ratio",
          "pytorch_expandable_reserved", "pytorch_expandable_allocated", "pytorch_expandable_ratio",
          "ceiling_expandable", "ceiling_cuda_malloc"]
TABLE_BEGIN, TABLE_END = "<!-- corpus-table:begin -->", "<!-- corpus-table:end -->"
STEADY_BEGIN, STEADY_END = "<!-- corpus-steady:begin -->", "<!-- corpus-steady:end -->"
REPETITION = re.compile(r"^repetition (\d+)\s+([\d,]+) alloc/map, ([\d,]+) free/unmap; .*ratio ([\d.]+)(?:, [\d.]+ ms)?$")


def read_ratios(path):
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(line for line in f if not line.startswith("#"))]
    for r in rows:
        if r["split"] not in SPLITS:
            raise SystemExit(f"{path}: trace {r['trace']}: split {r['split']!r} is not one of {SPLITS}")
    return rows


def write_ratios(path, rows):
    with open(path) as f:
        comments = [line for line in f if line.startswith("#")]
    with open(path, "w", newline="") as f:
        f.writelines(comments)
        w = csv.DictWriter(f, fieldnames=FIELDS, lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS})


def run_replay(tool, trace, backend, *args):
    """streamsafe-replay's stdout for one trace and backend (--strict), or RuntimeError."""
    conf = f"backend:{backend}" + (f",{EXTRA_CONF}" if EXTRA_CONF else "")
    cmd = [tool, trace, "--conf", conf, "--strict", *args]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.strip()[:400]}")
    return cmd, p.stdout


def steady(tool, trace, backend, repeat):
    """The trace `repeat` times back to back: per repetition, driver calls and ratio."""
    cmd, stdout = run_replay(tool, trace, backend, "--passes", "1", "--repeat", str(repeat))
    reps = []
    for line in stdout.splitlines():
        m = REPETITION.match(line.strip())
        if m:
            reps.append({"calls": int(m.group(2).replace(",", "")) + int(m.group(3).replace(",", "")),
                         "ratio": float(m.group(4))})
    if len(reps) != repeat:
        raise RuntimeError(f"{' '.join(cmd)}: expected {repeat} repetition lines:\n{stdout}")
    return reps


def replay(tool, trace, backend, passes):
    cmd, stdout = run_replay(tool, trace, backend, "--passes", str(passes))
    facts = {}
    for line in stdout.splitlines():
        key, _, value = line.partition("  ")
        facts[key.strip()] = value.strip()
    ops = [int(n.replace(",", "")) for n in re.findall(r"([\d,]+) segment_", facts.get("segment ops", ""))]
    if len(ops) != 4 or "ratio" not in facts:
        raise RuntimeError(f"{' '.join(cmd)}: unexpected output:\n{stdout}")
    return {
        "ratio": float(facts["ratio"].split()[0]),
        "events_per_s": float(facts["events/s"].split()[0]) * 1e6,
        "driver_calls": sum(ops),
        "ops": ops,
        "ooms": facts.get("out of memory", ""),
    }


def target_text(value, target):
    if value <= target + 5e-5:
        return "met"
    return f"missed by {100 * (value / target - 1):.1f}%"


def measure(rows, tool, traces_dir, passes, repeat):
    results = []
    for r in rows:
        path = os.path.join(traces_dir, r["trace"] + ".csv.gz")
        m = {b: replay(tool, path, b, passes) for b in BACKENDS}
        if repeat > 1:
            for b in BACKENDS:
                m[b]["steady"] = steady(tool, path, b, repeat)
        pt_default, pt_exp = float(r["pytorch_default_ratio"]), float(r["pytorch_expandable_ratio"])
        m["expandable_target"] = min(pt_exp, EXPANDABLE_TARGET)
        m["cuda_malloc_target"] = min(pt_default, CUDA_MALLOC_TARGET)
        results.append((r, m))
    return results


def table(results):
    head = ("| trace | split | streamsafe expandable | PyTorch expandable | streamsafe cuda_malloc | "
            "PyTorch default | driver calls (exp. / c_m) | events/s, M (exp. / c_m) | expandable target | "
            "cuda_malloc target |")
    lines = [head, "| " + " | ".join(["---"] * 10) + " |"]
    for split in SPLITS:
        for r, m in results:
            if r["split"] != split:
                continue
            e, c = m["expandable"], m["cuda_malloc"]
            lines.append(
                f"| {r['trace']} | {split} | {e['ratio']:.4f} | {float(r['pytorch_expandable_ratio']):.4f} | "
                f"{c['ratio']:.4f} | {float(r['pytorch_default_ratio']):.4f} | {e['driver_calls']} / "
                f"{c['driver_calls']} | {e['events_per_s'] / 1e6:.1f} / {c['events_per_s'] / 1e6:.1f} | "
                f"{target_text(e['ratio'], m['expandable_target'])} | {target_text(c['ratio'], m['cuda_malloc_target'])} |")
    return lines


def summary(results):
    out = []
    for split in SPLITS + ("all",):
        sel = [(r, m) for r, m in results if split == "all" or r["split"] == split]
        if not sel:
            continue
        exp_met = sum(m["expandable"]["ratio"] <= m["expandable_target"] + 5e-5 for _, m in sel)
        cm_met = sum(m["cuda_malloc"]["ratio"] <= m["cuda_malloc_target"] + 5e-5 for _, m in sel)
        worst_e = max(m["expandable"]["ratio"] for _, m in sel)
        worst_c = max(m["cuda_malloc"]["ratio"] for _, m in sel)
        out.append(f"{split}: {len(sel)} traces; expandable target met on {exp_met}, cuda_malloc target met on "
                   f"{cm_met}; worst ratio {worst_e:.4f} (expandable), {worst_c:.4f} (cuda_malloc)")
    return out


def steady_table(results, repeat):
    head = ("| trace | split | expandable: ratio, pass 1 / pass " + str(repeat) + " | expandable: driver calls, pass 1 / "
            "passes 2-" + str(repeat) + " each | cuda_malloc: ratio, pass 1 / pass " + str(repeat) + " | cuda_malloc: "
            "driver calls, pass 1 / passes 2-" + str(repeat) + " each |")
    lines = [head, "| " + " | ".join(["---"] * 6) + " |"]
    for split in SPLITS:
        for r, m in results:
            if r["split"] != split:
                continue
            cells = []
            for b in BACKENDS:
                st = m[b]["steady"]
                cells.append(f"{st[0]['ratio']:.4f} / {st[-1]['ratio']:.4f}")
                cells.append(f"{st[0]['calls']} / " + ", ".join(str(x["calls"]) for x in st[1:]))
            lines.append(f"| {r['trace']} | {split} | " + " | ".join(cells) + " |")
    for split in SPLITS:
        sel = [m for r, m in results if r["split"] == split]
        parts = []
        for b in BACKENDS:
            first = sum(m[b]["steady"][0]["ratio"] for m in sel) / len(sel)
            last = sum(m[b]["steady"][-1]["ratio"] for m in sel) / len(sel)
            later = sum(x["calls"] for m in sel for x in m[b]["steady"][1:])
            parts.append(f"{b} mean ratio {first:.4f} in pass 1, {last:.4f} in pass {repeat}, "
                         f"{later} driver calls in passes 2-{repeat}")
        lines.append(f"- {split}: " + "; ".join(parts))
    return lines


def replace_between(text, begin, end, body, path):
    if begin not in text or end not in text:
        raise SystemExit(f"report.py: {path} has no {begin} ... {end} markers")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return head + begin + "\n" + body + "\n" + end + tail


def find_tool(given):
    if given:
        return given
    for c in REPLAY_CANDIDATES:
        if os.access(c, os.X_OK):
            return c
    raise SystemExit("report.py: no streamsafe-replay found; build it (cmake --build build --target "
                     "streamsafe-replay) or pass --replay PATH")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replay", help="the streamsafe-replay executable (default: build/.../streamsafe-replay)")
    ap.add_argument("--traces", default=DEFAULT_TRACES, help="directory of NAME.csv.gz (default %(default)s)")
    ap.add_argument("--ratios", default=DEFAULT_RATIOS, help="the ratios and ceilings file (default %(default)s)")
    ap.add_argument("--passes", type=int, default=3, help="timed passes per replay, the fastest counts (default 3)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a ratio is above its ceiling")
    ap.add_argument("--write-doc", metavar="FILE", help=f"replace the table between {TABLE_BEGIN} and {TABLE_END}")
    ap.add_argument("--update-ceilings", action="store_true", help="set every ceiling to today's ratio + 0.1%%")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="also replay each trace N times back to back and print the steady-state table (default 1: off)")
    ap.add_argument("--conf", default="", metavar="KEY:VALUE,...",
                    help="options added after backend:B in every replay, such as expandable_chunk_mb:2 "
                         "(not with --check, --update-ceilings or --write-doc, which hold the defaults)")
    args = ap.parse_args()
    if args.conf and (args.check or args.update_ceilings or args.write_doc):
        ap.error("--conf compares other settings; the ceilings and the doc hold the defaults")
    keys = {item.partition(":")[0].strip().lower() for item in args.conf.split(",") if item.strip()}
    if keys & {"backend", "expandable_segments"}:
        ap.error("--conf: the report replays both backends itself; leave backend and "
                 "expandable_segments out")
    global EXTRA_CONF
    EXTRA_CONF = args.conf

    tool = find_tool(args.replay)
    rows = read_ratios(args.ratios)
    listed = {r["trace"] for r in rows}
    present = {f[: -len(".csv.gz")] for f in os.listdir(args.traces) if f.endswith(".csv.gz")}
    problems = []
    if listed - present:
        problems.append(f"traces listed in {args.ratios} but absent from {args.traces}: {sorted(listed - present)}")
    if present - listed:
        problems.append(f"traces in {args.traces} with no row in {args.ratios}: {sorted(present - listed)}")
    if problems:
        for p in problems:
            print(f"report.py: {p}", file=sys.stderr)
        return 1

    try:
        results = measure(rows, tool, args.traces, args.passes, args.repeat)
    except RuntimeError as e:
        print(f"report.py: {e}", file=sys.stderr)
        return 1
    lines = table(results)
    print("\n".join(lines))
    print()
    print("\n".join(summary(results)))
    if args.repeat > 1:
        print()
        print("\n".join(steady_table(results, args.repeat)))

    failed = []
    ooms = []
    for r, m in results:
        for b in BACKENDS:
            if m[b]["ooms"]:
                ooms.append(f"{r['trace']} {b}: out of memory in the replay: {m[b]['ooms']}")
            ceiling = r.get(f"ceiling_{b}", "")
            if ceiling and m[b]["ratio"] > float(ceiling):
                failed.append(f"{r['trace']} {b}: ratio {m[b]['ratio']:.4f} is above its ceiling {float(ceiling):.4f}")
    if ooms:  # a ratio of a replay that failed allocations means nothing
        print("\nFAILED (allocations failed, so the ratios above are not comparable):")
        print("\n".join(f"  {x}" for x in ooms))
        return 1
    if args.update_ceilings:
        for r, m in results:
            for b in BACKENDS:
                r[f"ceiling_{b}"] = f"{m[b]['ratio'] * CEILING_MARGIN + 0.00005:.4f}"
        write_ratios(args.ratios, rows)
        print(f"\nceilings updated in {args.ratios}")
    if args.write_doc:
        with open(args.write_doc) as f:
            text = f.read()
        body = "\n".join(lines + [""] + [f"- {s}" for s in summary(results)])
        text = replace_between(text, TABLE_BEGIN, TABLE_END, body, args.write_doc)
        if args.repeat > 1:
            text = replace_between(text, STEADY_BEGIN, STEADY_END, "\n".join(steady_table(results, args.repeat)),
                                   args.write_doc)
        with open(args.write_doc, "w") as f:
            f.write(text)
        print(f"\ntable written to {args.write_doc}")
    if args.check:
        if failed:
            print("\nFAILED (a ratio rose above its ceiling in " + os.path.relpath(args.ratios) + "):")
            print("\n".join(f"  {x}" for x in failed))
            return 1
        print(f"\nok: all {len(results)} traces within their ceilings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
