#!/usr/bin/env python3
"""Turns the JSON of a streamsafe benchmark run into readable results.

Reads the output of streamsafe_bench or streamsafe_bench_sim (--benchmark_out=FILE, JSON) and
writes, into --out-dir:
  <prefix>_scenario1.svg   scenario 1: ns per same-stream pair by size, one line per allocator
  <prefix>_scenario3.svg   scenario 3: million pairs/s against threads (own stream: solid; one
                           shared stream: dashed)
  <prefix>_scenario1.png, <prefix>_scenario3.png   the same, when matplotlib is importable
                           (--formats picks which; a PNG without matplotlib becomes an SVG)
  <prefix>_results.md      the tables: absolute numbers, ratios of each baseline to streamsafe,
                           and the targets of the issue checked against this run (GPU runs only)
The SVGs are drawn by hand (standard library only), so the script runs anywhere.

usage: python3 bench/plot.py RESULT.json [--out-dir DIR] [--prefix NAME] [--formats svg,png]
"""

import argparse
import json
import math
import os
import sys

SIZE_LABELS = {512: "512 B", 65536: "64 KiB", 1048576: "1 MiB", 67108864: "64 MiB"}
TIME_TO_NS = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}
# Display order and colours (streamsafe first).
ORDER = ["streamsafe_cuda_malloc", "streamsafe_expandable", "sim_streamsafe_cuda_malloc",
         "sim_streamsafe_expandable", "pytorch_c10", "cub", "cuda_malloc_async", "cuda_malloc"]
COLORS = {
    "streamsafe_cuda_malloc": "#1f77b4", "streamsafe_expandable": "#2ca02c",
    "sim_streamsafe_cuda_malloc": "#1f77b4", "sim_streamsafe_expandable": "#2ca02c",
    "pytorch_c10": "#d62728", "cub": "#9467bd", "cuda_malloc_async": "#ff7f0e",
    "cuda_malloc": "#7f7f7f",
}


def is_streamsafe(name):
    return name.startswith("streamsafe") or name.startswith("sim_streamsafe")


def order_key(name):
    return (ORDER.index(name) if name in ORDER else len(ORDER), name)


# ---- reading -----------------------------------------------------------------------------------

class Run:
    """One benchmark entry: scenario/allocator/params, times in ns, counters."""

    def __init__(self, entry):
        parts = entry["name"].split("/")
        self.scenario = parts[0]
        self.allocator = parts[1] if len(parts) > 1 else ""
        self.params = {}
        for p in parts[2:]:
            if ":" in p:
                key, value = p.split(":", 1)
                try:
                    self.params[key] = int(value)
                except ValueError:
                    self.params[key] = value
        self.threads = int(entry.get("threads", 1))
        scale = TIME_TO_NS.get(entry.get("time_unit", "ns"), 1.0)
        self.real_ns = float(entry.get("real_time", float("nan"))) * scale
        self.cpu_ns = float(entry.get("cpu_time", float("nan"))) * scale
        self.error = entry.get("error_message") if entry.get("error_occurred") else None
        self.entry = entry

    def counter(self, key):
        value = self.entry.get(key)
        return float(value) if isinstance(value, (int, float)) else None


def load(path):
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        # A run stopped early (a timeout) leaves the benchmarks array open: keep the entries that
        # are complete (Google Benchmark closes each with a line "    }") and close it.
        cut = text.rfind("\n    }")
        if cut < 0:
            raise
        data = json.loads(text[:cut] + "\n    }\n  ]\n}\n")
        print(f"{path}: incomplete JSON (the run stopped early); read what it holds", file=sys.stderr)
    # With --benchmark_repetitions, each benchmark is read as its median (Google Benchmark's
    # "median" aggregate, counters included); a benchmark without aggregates as its first entry.
    entries = data.get("benchmarks", [])
    medians = {e.get("run_name"): e for e in entries
               if e.get("run_type") == "aggregate" and e.get("aggregate_name") == "median"}
    runs, seen = [], set()
    for e in entries:
        if e.get("run_type", "iteration") != "iteration":
            continue
        key = e.get("run_name", e["name"])
        if key in seen:
            continue
        seen.add(key)
        if key in medians:
            e = dict(medians[key], name=key)
        runs.append(Run(e))
    return data.get("context", {}), runs


# ---- formatting --------------------------------------------------------------------------------

def fmt_ns(ns):
    if ns is None or math.isnan(ns):
        return "-"
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.2f} us"
    return f"{ns:.1f} ns"


def fmt_num(x, digits=2):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def fmt_ratio(x):
    if x is None or math.isnan(x) or x <= 0:
        return "-"
    return f"{x:.1f}x" if x >= 10 else f"{x:.2f}x"


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def join(lines):
    """Joins the lines of a section, dropping the empty parts (a ratio table with no baseline)
    so that no run of blank lines is left."""
    out = []
    for line in lines:
        if line == "" and (not out or out[-1] == ""):
            continue
        out.append(line)
    return "\n".join(out)


def ok(runs):
    return [r for r in runs if r.error is None]


def allocators_of(runs):
    return sorted({r.allocator for r in runs}, key=order_key)


def ratio_table(cases, allocs, value, higher_is_better=False):
    """Rows: cases; columns: each baseline; cell: baseline/streamsafe (time) or the inverse
    (throughput) for every streamsafe variant, 'cuda_malloc backend / expandable backend'."""
    ours = [a for a in allocs if is_streamsafe(a)]
    baselines = [a for a in allocs if not is_streamsafe(a)]
    if not ours or not baselines:
        return ""
    header = ["case"] + [f"vs {b}" for b in baselines]
    rows = []
    for case_label, case_key in cases:
        row = [case_label]
        for b in baselines:
            vb = value(b, case_key)
            cells = []
            for o in ours:
                vo = value(o, case_key)
                if vb is None or vo is None or vo <= 0 or vb <= 0:
                    cells.append("-")
                else:
                    cells.append(fmt_ratio(vo / vb if higher_is_better else vb / vo))
            row.append(" / ".join(cells))
        rows.append(row)
    note = ("Ratio = baseline time / streamsafe time (higher: streamsafe faster)"
            if not higher_is_better else
            "Ratio = streamsafe throughput / baseline throughput (higher: streamsafe faster)")
    return f"{note}; cells read `{' / '.join(ours)}`.\n\n" + table(header, rows)


def mpairs(r):
    """Million pairs per second of all threads: the Mpairs_per_s counter, else items_per_second."""
    if r is None:
        return None
    if r.counter("Mpairs_per_s"):
        return r.counter("Mpairs_per_s")
    ips = r.counter("items_per_second")
    return ips / 1e6 if ips else None


def lookup(runs, scenario, allocator, **params):
    for r in runs:
        if r.scenario == scenario and r.allocator == allocator and r.error is None and all(
                r.params.get(k) == v for k, v in params.items() if k != "threads") and (
                "threads" not in params or r.threads == params["threads"]):
            return r
    return None


# ---- the tables ---------------------------------------------------------------------------------

def section_pairs(runs):
    rs = [r for r in ok(runs) if r.scenario == "same_stream_pair"]
    if not rs:
        return "", {}
    allocs = allocators_of(rs)
    sizes = sorted({r.params.get("bytes") for r in rs})
    values = {}
    rows = []
    for size in sizes:
        row = [SIZE_LABELS.get(size, str(size))]
        for a in allocs:
            r = lookup(rs, "same_stream_pair", a, bytes=size)
            values[(a, size)] = r.real_ns if r else None
            row.append(fmt_ns(r.real_ns) if r else "-")
        rows.append(row)
    text = ["### Scenario 1: same-stream allocate + free pair (host time per pair)", "",
            table(["size"] + allocs, rows), ""]
    events = []
    for a in allocs:
        per = [lookup(rs, "same_stream_pair", a, bytes=s) for s in sizes]
        ev = [r.counter("events_per_pair") for r in per if r and r.counter("events_per_pair") is not None]
        if ev:
            events.append(f"`{a}`: {max(ev):g}")
    if events:
        text += ["Events recorded per pair (max over sizes): " + ", ".join(events) + ".", ""]
    text += [ratio_table([(SIZE_LABELS.get(s, str(s)), s) for s in sizes], allocs,
                         lambda a, s: values.get((a, s))), ""]
    return join(text), values


def section_random(runs):
    rs = [r for r in ok(runs) if r.scenario == "random_allocations"]
    if not rs:
        return "", {}
    allocs = allocators_of(rs)
    lives = sorted({r.params.get("live") for r in rs})
    values = {}
    rows = []
    for live in lives:
        row = [f"{live:,} live"]
        for a in allocs:
            r = lookup(rs, "random_allocations", a, live=live)
            values[(a, live)] = r.real_ns if r else None
            row.append(fmt_ns(r.real_ns) if r else "-")
        rows.append(row)
    if len(lives) >= 2:
        lo, hi = lives[0], lives[-1]
        row = [f"{hi:,} / {lo:,}"]
        for a in allocs:
            vl, vh = values.get((a, lo)), values.get((a, hi))
            row.append(fmt_ratio(vh / vl) if vl and vh else "-")
        rows.append(row)
    text = ["### Scenario 2: random allocations (host time per operation)", "",
            table(["live allocations"] + allocs, rows), "",
            ratio_table([(f"{lv:,} live", lv) for lv in lives], allocs, lambda a, lv: values.get((a, lv))), ""]
    return join(text), values


def section_threads(runs):
    rs = [r for r in ok(runs) if r.scenario in ("threads_own_stream", "threads_shared_stream")]
    if not rs:
        return "", {}
    allocs = allocators_of(rs)
    threads = sorted({r.threads for r in rs})
    values = {}
    text = ["### Scenario 3: threads, 4 KiB pairs (million pairs per second, all threads)", ""]
    for scenario, title in (("threads_own_stream", "each thread on its own stream"),
                            ("threads_shared_stream", "all threads on one shared stream")):
        rows = []
        for n in threads:
            row = [str(n)]
            for a in allocs:
                r = lookup(rs, scenario, a, threads=n)
                values[(scenario, a, n)] = v = mpairs(r)
                row.append(fmt_num(v))
            rows.append(row)
        if 1 in threads and 8 in threads:
            row = ["8 / 1"]
            for a in allocs:
                v1, v8 = values.get((scenario, a, 1)), values.get((scenario, a, 8))
                row.append(fmt_ratio(v8 / v1) if v1 and v8 else "-")
            rows.append(row)
        text += [f"{title.capitalize()}:", "", table(["threads"] + allocs, rows), "",
                 ratio_table([(f"{n} thread{'s' if n > 1 else ''}", n) for n in threads], allocs,
                             lambda a, n, sc=scenario: values.get((sc, a, n)), higher_is_better=True), ""]
    return join(text), values


def section_cross(runs):
    rs = [r for r in ok(runs) if r.scenario in ("record_stream_free", "free_on_other_stream")]
    if not rs:
        return "", {}
    allocs = allocators_of(rs)
    values = {}
    rows = []
    for scenario in ("record_stream_free", "free_on_other_stream"):
        row = [scenario]
        for a in allocs:
            r = lookup(rs, scenario, a)
            values[(a, scenario)] = r.real_ns if r else None
            cell = fmt_ns(r.real_ns) if r else "-"
            if r and r.counter("events_per_pair") is not None:
                cell += f" ({r.counter('events_per_pair'):g} ev)"
            row.append(cell)
        rows.append(row)
    text = ["### Scenario 4: cross-stream (host time per allocate + cross-stream use + free)", "",
            "`(n ev)`: events streamsafe recorded per iteration. Baselines without record_stream run "
            "the hand-written equivalent (event record + stream wait); see bench/allocators.hpp.", "",
            table(["case"] + allocs, rows), "",
            ratio_table([(s, s) for s in ("record_stream_free", "free_on_other_stream")], allocs,
                        lambda a, s: values.get((a, s))), ""]
    return join(text), values


def section_floor(runs):
    rs = [r for r in ok(runs) if r.scenario == "driver_floor"]
    if not rs:
        return ""
    rows = [[r.allocator, fmt_ns(r.real_ns)] for r in rs]
    return join(["### Driver-call floor (host time per call or pair, no kernel)", "",
                 "The CUDA calls a cross-stream path is made of, alone (bench/driver_floor_bench.cpp); "
                 "`cu_*` through the driver API, the rest through the runtime.", "",
                 table(["calls", "time"], rows), ""])


def section_empty_cache(runs):
    rs = [r for r in ok(runs) if r.scenario == "empty_cache"]
    if not rs:
        return "", {}
    conds = sorted({(r.params.get("unrelated_ms", 0), r.params.get("fenced_ms", 0)) for r in rs})
    strategies = sorted({r.allocator for r in rs},
                        key=lambda s: (0 if is_streamsafe(s) else 1, order_key(s)))
    values = {}
    rows = []
    for s in strategies:
        row = [s]
        for (u, f) in conds:
            r = lookup(rs, "empty_cache", s, unrelated_ms=u, fenced_ms=f)
            values[(s, u, f)] = r
            if r is None:
                row.append("-")
                continue
            cell = fmt_ns(r.real_ns)
            done = r.counter("unrelated_done_at_return")
            if done is not None:
                cell += " (waited)" if done >= 0.5 else " (did not wait)"
            row.append(cell)
        rows.append(row)
    header = ["release"] + [("nothing pending" if u == 0 and f == 0 else
                             f"unrelated {u} ms" + (f" + fenced {f} ms" if f else "")) for (u, f) in conds]
    text = ["### Scenario 5: empty_cache (host time of the release call)", "",
            "`(waited)`: the unrelated kernel had finished when the call returned (the call waited "
            "for work that never touched the released memory).", "",
            table(header, rows), ""]
    return join(text), values


def section_replay(runs):
    rs = [r for r in ok(runs) if r.scenario == "replay"]
    if not rs:
        return "", {}
    allocs = allocators_of(rs)
    rows = []
    values = {}
    for a in allocs:
        r = lookup(rs, "replay", a)
        if r is None:
            continue
        values[a] = r.counter("ns_per_event")
        rows.append([a, fmt_ns(r.counter("ns_per_event")), fmt_ns(r.counter("cold_ns_per_event")),
                     fmt_num(r.counter("peak_reserved_GiB"), 3), fmt_num(r.counter("peak_allocated_GiB"), 3),
                     fmt_num(r.counter("reserved_over_allocated"), 3)])
    text = ["### Scenario 6: replay of gpt2_fixed_adamw (26,077 events)", "",
            table(["allocator", "host time per event (warm)", "per event (cold, incl. driver)",
                   "peak reserved GiB", "peak allocated GiB", "reserved / allocated"], rows), "",
            "Peak allocated: the trace's own live requests rounded to 512 B (PyTorch's allocated "
            "statistic, 8.09 GiB, also counts unsplit block tails). PyTorch's own run: 1.079 "
            "(default), 1.005 (expandable segments) with its statistic.", "",
            ratio_table([("warm replay, per event", None)], allocs, lambda a, _k: values.get(a)), ""]
    return join(text), values


# ---- the targets of the issue (GPU runs) -------------------------------------------------------

def targets(runs, pairs, random_v, threads_v, cross_v, empty_v):
    ours = sorted({r.allocator for r in runs if is_streamsafe(r.allocator) and r.scenario != "empty_cache"},
                  key=order_key)
    rows = []

    def verdict(value, good):
        if value is None:
            return "not measured"
        return "PASS" if good else "FAIL"

    for a in ours:
        vals = [v for (al, _s), v in pairs.items() if al == a and v is not None]
        worst = max(vals) if vals else None
        rows.append([f"1: <= 50 ns per pair at every size ({a})", fmt_ns(worst),
                     verdict(worst, worst is not None and worst <= 50)])
    for a in ours:
        v1, v10 = random_v.get((a, 1000)), random_v.get((a, 10000))
        q = v10 / v1 if v1 and v10 else None
        rows.append([f"2: 10,000 live within 2x of 1,000 live ({a})", fmt_ratio(q) if q else "-",
                     verdict(q, q is not None and q <= 2)])
    for a in ours:
        v1, v8 = threads_v.get(("threads_own_stream", a, 1)), threads_v.get(("threads_own_stream", a, 8))
        q = v8 / v1 if v1 and v8 else None
        rows.append([f"3: 8 threads on 8 streams >= 6x one thread ({a})", fmt_ratio(q) if q else "-",
                     verdict(q, q is not None and q >= 6)])
    for a in ours:
        evs = [r.counter("events_per_pair") for r in runs
               if r.scenario == "same_stream_pair" and r.allocator == a and r.error is None]
        evs = [e for e in evs if e is not None]
        worst = max(evs) if evs else None
        rows.append([f"4: no event record on a same-stream free ({a})",
                     "-" if worst is None else f"{worst:g} per pair", verdict(worst, worst == 0)])
        v = cross_v.get((a, "record_stream_free"))
        rows.append([f"4: record_stream + free <= 1 us ({a})", fmt_ns(v), verdict(v, v is not None and v <= 1000)])
    for s in sorted({k[0] for k in empty_v if is_streamsafe(k[0])}, key=order_key):
        if s.endswith("_defer"):
            r = empty_v.get((s, 50, 0))
            v = r.real_ns if r else None
            rows.append([f"5: defer returns <= 1 ms with the unrelated kernel pending ({s})", fmt_ns(v),
                         verdict(v, v is not None and v <= 1e6)])
        if s.endswith("_wait"):
            for f in (0, 5):
                r = empty_v.get((s, 50, f))
                if r is None:
                    continue
                done = r.counter("unrelated_done_at_return")
                rows.append([f"5: wait does not wait for the unrelated kernel, fenced {f} ms ({s})",
                             fmt_ns(r.real_ns), verdict(done, done is not None and done < 0.5)])
    return table(["target", "this run", "verdict"], rows)


# ---- SVG (by hand) -----------------------------------------------------------------------------

def svg_line_chart(path, title, x_labels, series, y_label, log_y=False, hline=None):
    """series: list of (name, color, dashed, [y or None per x]); hline: (y, label) or None."""
    width, height = 980, 480
    left, right, top, bottom = 80, 330, 50, 60
    pw, ph = width - left - right, height - top - bottom
    ys = [y for _, _, _, vals in series for y in vals if y is not None and y > 0]
    if not ys:
        return False
    if hline is not None:
        ys.append(hline[0])
    if log_y:
        lo = 10 ** math.floor(math.log10(min(ys)))
        hi = 10 ** math.ceil(math.log10(max(ys)))
        if hi <= lo:
            hi = lo * 10

        def ty(y):
            return top + ph - (math.log10(y) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * ph
        decades = int(round(math.log10(hi / lo)))
        steps = (1, 2, 5) if decades <= 3 else (1,)
        ticks = [lo * 10 ** d * m for d in range(decades + 1) for m in steps if lo * 10 ** d * m <= hi * 1.0001]
    else:
        lo, hi = 0.0, max(ys) * 1.1
        step = 10 ** math.floor(math.log10(hi / 5)) if hi > 0 else 1
        for m in (1, 2, 5, 10):
            if hi / (step * m) <= 8:
                step *= m
                break

        def ty(y):
            return top + ph - (y - lo) / (hi - lo) * ph
        ticks = [i * step for i in range(int(hi / step) + 1)]
    n = len(x_labels)

    def tx(i):
        return left + (i + 0.5) * pw / n

    def esc(s):
        return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left + pw / 2}" y="25" text-anchor="middle" font-size="15">{esc(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>']
    for t in ticks:
        y = ty(t)
        label = (f"{t:g}" if not log_y else (f"{t:g}" if 1e-3 <= t < 1e6 else f"1e{int(round(math.log10(t)))}"))
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    for i, label in enumerate(x_labels):
        out.append(f'<text x="{tx(i):.1f}" y="{top + ph + 20}" text-anchor="middle">{esc(label)}</text>')
    out.append(f'<text x="18" y="{top + ph / 2}" text-anchor="middle" '
               f'transform="rotate(-90 18 {top + ph / 2})">{esc(y_label)}</text>')
    if hline is not None:
        y = ty(hline[0])
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#c00" '
                   f'stroke-dasharray="2 3"/>')
        out.append(f'<text x="{left + 6}" y="{y - 5:.1f}" fill="#c00">{esc(hline[1])}</text>')
    for k, (name, color, dashed, vals) in enumerate(series):
        pts = [(tx(i), ty(v)) for i, v in enumerate(vals) if v is not None and v > 0]
        dash = ' stroke-dasharray="6 4"' if dashed else ""
        if len(pts) > 1:
            d = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            out.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        for x, y in pts:
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{color}"/>')
        ly = top + 14 + k * 18
        lx = left + pw + 15
        out.append(f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 24}" y2="{ly - 4}" stroke="{color}" '
                   f'stroke-width="2"{dash}/>')
        out.append(f'<text x="{lx + 30}" y="{ly}">{esc(name)}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return True


def png_line_chart(path, title, x_labels, series, y_label, log_y=False, hline=None):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # matplotlib missing: the SVG is the plot
        return False
    fig, ax = plt.subplots(figsize=(11, 5))
    for name, color, dashed, vals in series:
        xs = [i for i, v in enumerate(vals) if v is not None and v > 0]
        ax.plot(xs, [vals[i] for i in xs], marker="o", color=color, linestyle="--" if dashed else "-",
                label=name)
    if hline is not None:
        ax.axhline(hline[0], color="#c00", linestyle=":", linewidth=1)
        ax.annotate(hline[1], (0, hline[0]), color="#c00", fontsize=8, xytext=(2, 3), textcoords="offset points")
    ax.set_xticks(range(len(x_labels)))
    ax.set_xticklabels(x_labels)
    if log_y:
        ax.set_yscale("log")
    ax.set_ylabel(y_label)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plots(runs, out_dir, prefix, device, sim, formats):
    """Writes the two plots in each format of `formats` ("svg", "png"); a PNG needs matplotlib,
    and when it is missing an SVG is written instead."""
    written = []
    renderers = []
    if "png" in formats:
        renderers.append(("png", png_line_chart))
    if "svg" in formats or not renderers:
        renderers.append(("svg", svg_line_chart))

    def render(name, args):
        done = False
        for ext, fn in renderers:
            p = os.path.join(out_dir, f"{prefix}_{name}.{ext}")
            if fn(p, *args):
                written.append(p)
                done = True
        if not done and all(ext != "svg" for ext, _ in renderers):
            p = os.path.join(out_dir, f"{prefix}_{name}.svg")
            if svg_line_chart(p, *args):
                written.append(p)

    rs = [r for r in ok(runs) if r.scenario == "same_stream_pair"]
    if rs:
        sizes = sorted({r.params.get("bytes") for r in rs})
        series = []
        for a in allocators_of(rs):
            vals = []
            for s in sizes:
                r = lookup(rs, "same_stream_pair", a, bytes=s)
                vals.append(r.real_ns if r else None)
            series.append((a, COLORS.get(a, "#000000"), False, vals))
        args = (f"Scenario 1: same-stream allocate + free ({device})",
                [SIZE_LABELS.get(s, str(s)) for s in sizes], series, "ns per pair (log)", True,
                None if sim else (50.0, "target: 50 ns"))
        render("scenario1", args)
    rs = [r for r in ok(runs) if r.scenario in ("threads_own_stream", "threads_shared_stream")]
    if rs:
        threads = sorted({r.threads for r in rs})
        series = []
        for a in allocators_of(rs):
            for scenario, dashed, suffix in (("threads_own_stream", False, "own streams"),
                                             ("threads_shared_stream", True, "shared stream")):
                vals = []
                for n in threads:
                    vals.append(mpairs(lookup(rs, scenario, a, threads=n)))
                if any(v is not None for v in vals):
                    series.append((f"{a}, {suffix}", COLORS.get(a, "#000000"), dashed, vals))
        args = (f"Scenario 3: 4 KiB pairs, all threads together ({device})",
                [str(n) for n in threads], series, "million pairs per second (log)", True)
        render("scenario3", args)
    return written


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", help="output of --benchmark_out (JSON)")
    parser.add_argument("--out-dir", default=None, help="where to write (default: beside the JSON)")
    parser.add_argument("--prefix", default=None, help="file name prefix (default: the JSON's name)")
    parser.add_argument("--formats", default="svg,png",
                        help="plot formats, comma-separated: svg, png (png needs matplotlib; "
                             "without it an svg is written instead); 'none' for no plot")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or os.path.dirname(os.path.abspath(args.json))
    prefix = args.prefix or os.path.splitext(os.path.basename(args.json))[0]
    os.makedirs(out_dir, exist_ok=True)
    context, runs = load(args.json)
    sim = "simulated" in str(context.get("streamsafe_suite", ""))
    device = "simulated device" if sim else str(context.get("device", "GPU"))

    s1, pairs = section_pairs(runs)
    s2, random_v = section_random(runs)
    s3, threads_v = section_threads(runs)
    s4, cross_v = section_cross(runs)
    s5, empty_v = section_empty_cache(runs)
    s6, _ = section_replay(runs)
    s0 = section_floor(runs)
    errors = [r for r in runs if r.error is not None]

    md = [f"## Results: {device}", ""]
    ctx_keys = ("date", "host_name", "num_cpus", "mhz_per_cpu", "device", "device_memory_GiB", "cuda_driver",
                "cuda_runtime", "pytorch", "cub_version", "streamsafe_version", "streamsafe_build_type",
                "library_build_type")
    md += [f"- {k}: {context[k]}" for k in ctx_keys if k in context]
    md += [""]
    if sim:
        md += ["Simulated device: these numbers are the allocator's bookkeeping alone on this host's "
               "CPU; the targets of the issue are for the H200 and are not checked here.", ""]
    md += [s for s in (s1, s2, s3, s4, s0, s5, s6) if s]
    if not sim:
        md += ["### Targets (H200, this run)", "", targets(runs, pairs, random_v, threads_v, cross_v, empty_v), ""]
    if errors:
        md += ["### Skipped or failed", ""] + [f"- `{r.entry['name']}`: {r.error}" for r in errors] + [""]
    formats = {f.strip() for f in args.formats.split(",") if f.strip()}
    written = [] if "none" in formats else plots(runs, out_dir, prefix, device, sim, formats)
    md_path = os.path.join(out_dir, f"{prefix}_results.md")
    with open(md_path, "w") as f:
        f.write("\n".join(md))
    for p in written + [md_path]:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
