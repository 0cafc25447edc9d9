#!/usr/bin/env python3
"""The seed's race, in PyTorch: gradients of a side stream freed while the compute stream still
reads them, then torch.cuda.empty_cache() right after optimizer.step().

Each step: the gradients are allocated on a side stream, as FSDP2's reduce-scatter output is; the
compute stream waits for that stream and runs the optimizer (per-parameter SignSGD, or AdamW with
foreach) reading them, without record_stream; the gradients are freed (del) while those kernels
may still run; then torch.cuda.empty_cache(). Optionally a stream of long matrix products runs
on an unrelated stream meanwhile. An allocator that gives the gradients' memory back to the driver
before the optimizer's kernels finished makes them fault (illegal address) or read garbage.

Rows (each in its own process, a fault poisons the CUDA context):
  pytorch            PyTorch's allocator, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  pytorch+sync       the same, torch.cuda.synchronize() before empty_cache()
  streamsafe-wait    streamsafe.torch.install("backend:expandable,empty_cache:wait")
  streamsafe-defer   streamsafe.torch.install("backend:expandable,empty_cache:defer")
and, with --rows, also
  pytorch-default               PyTorch's allocator with its default settings
  streamsafe-cuda_malloc-wait   streamsafe.torch.install("backend:cuda_malloc,empty_cache:wait")
  streamsafe-cuda_malloc-defer  streamsafe.torch.install("backend:cuda_malloc,empty_cache:defer")
for each optimizer (signsgd, adamw) and without / with the busy unrelated stream (--busy-modes).
The table gives the outcome, the median step time (host, the step's work finished on the compute
stream, including empty_cache), the median time inside empty_cache, and a checksum of the
parameters (equal in every row that computed correctly). --per-step adds a markdown table of every
step's time, row beside row.

  python3 examples/pytorch/seed_race.py [--params 256] [--mib 64] [--steps 4] [--rows ...] [--opts signsgd,adamw]
  python3 examples/pytorch/seed_race.py --steps 6 --opts signsgd --busy-modes 0 --per-step \
      --rows pytorch,pytorch-default,streamsafe-defer,streamsafe-wait,streamsafe-cuda_malloc-defer,streamsafe-cuda_malloc-wait
  python3 examples/pytorch/seed_race.py --child streamsafe-defer --opt signsgd --busy 1 ...

streamsafe must be importable (pip install --no-build-isolation . from the repository).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

RESULT = "RESULT "
ALLOCATORS = ["pytorch", "pytorch+sync", "streamsafe-wait", "streamsafe-defer"]
MORE_ROWS = ["pytorch-default", "streamsafe-cuda_malloc-wait", "streamsafe-cuda_malloc-defer"]


def child(args):
    if args.child.startswith("pytorch"):
        os.environ.pop("PYTORCH_ALLOC_CONF", None)
        if args.child == "pytorch-default":
            os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        else:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        import torch
    else:
        import torch
        import streamsafe.torch as sst
        backend = "cuda_malloc" if "-cuda_malloc-" in args.child else "expandable"
        sst.install(f"backend:{backend},empty_cache:" + args.child.rsplit("-", 1)[1])
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    n = (args.mib << 20) // 4  # float32 elements per parameter
    params = [torch.randn(n, device=dev) for _ in range(args.params)]
    side = torch.cuda.Stream()
    busy = torch.cuda.Stream()
    compute = torch.cuda.current_stream()
    a = torch.randn(args.busy_n, args.busy_n, device=dev, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True) if args.opt == "adamw" else None
    torch.cuda.synchronize()
    steps, caches, pending = [], [], []
    outcome = "ok"
    try:
        for step in range(args.steps):
            if args.busy:
                with torch.cuda.stream(busy):  # unrelated work, busy for a long time
                    for _ in range(args.busy_matmuls):
                        a @ a
            t0 = time.perf_counter()
            side.wait_stream(compute)
            with torch.cuda.stream(side):  # FSDP2: reduce-scatter output on its own stream
                grads = [p.mul(1e-3).add_(step) for p in params]
            compute.wait_stream(side)
            with torch.no_grad():
                if opt is None:  # per-parameter SignSGD, decoupled weight decay
                    for p, g in zip(params, grads):
                        p.mul_(1 - 1e-3 * 0.1)
                        p.add_(g.sign(), alpha=-1e-3)
                else:
                    for p, g in zip(params, grads):
                        p.grad = g
                    opt.step()
                    for p in params:
                        p.grad = None
            del grads  # freed while the compute stream may still read them (no record_stream)
            if args.child == "pytorch+sync":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            torch.cuda.empty_cache()
            t2 = time.perf_counter()
            if args.child.startswith("streamsafe"):
                pending.append(sst.pending_release_bytes())
            compute.synchronize()
            t3 = time.perf_counter()
            steps.append((t3 - t0) * 1e3)
            caches.append((t2 - t1) * 1e3)
            torch.cuda.synchronize()  # the next step starts from an idle device
        checksum = float(sum(float(p.double().sum()) for p in params))
    except Exception as e:  # a fault: report it (the context is gone)
        outcome = "fault: " + str(e).splitlines()[0][:60]
        checksum = None
    meas = slice(1, None) if len(steps) > 1 else slice(None)
    r = dict(outcome=outcome, checksum=checksum,
             step_ms=statistics.median(steps[meas]) if steps else None,
             empty_cache_ms=statistics.median(caches[meas]) if caches else None,
             empty_cache_ms_all=[round(c, 3) for c in caches], step_ms_all=[round(t, 2) for t in steps],
             pending_mib=[round(p / (1 << 20), 1) for p in pending])
    print(RESULT + json.dumps(r), flush=True)


def parent(args):
    rows = args.rows.split(",") if args.rows else ALLOCATORS
    unknown = [r for r in rows if r not in ALLOCATORS + MORE_ROWS]
    if unknown:
        sys.exit(f"unknown rows {unknown}; rows: {', '.join(ALLOCATORS + MORE_ROWS)}")
    busy_modes = [int(b) for b in args.busy_modes.split(",")]
    print(f"seed race: {args.params} x {args.mib} MiB gradients, {args.steps} steps (first not measured), "
          f"busy stream: {args.busy_matmuls} bf16 {args.busy_n}^2 matmuls per step")
    header = f"{'allocator':<28} {'optimizer':<8} {'busy':<4} {'outcome':<28} {'step ms':>9} {'empty_cache ms':>15}  checksum"
    print(header)
    print("-" * len(header))
    ok = True
    per_step = []
    started = time.time()
    for opt in args.opts.split(","):
        for busy in busy_modes:
            for row in rows:
                cmd = [sys.executable, os.path.abspath(__file__), "--child", row, "--opt", opt, "--busy", str(busy),
                       "--params", str(args.params), "--mib", str(args.mib), "--steps", str(args.steps),
                       "--busy-matmuls", str(args.busy_matmuls), "--busy-n", str(args.busy_n)]
                timeout = args.timeout
                if args.budget:
                    timeout = min(timeout, int(args.budget - (time.time() - started)))
                    if timeout < args.min_row_s:
                        r = dict(outcome="skipped: time budget spent")
                        per_step.append((row, opt, busy, r))
                        print(f"{row:<28} {opt:<8} {busy:<4} {r['outcome']}", flush=True)
                        continue
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
                    line = [l for l in p.stdout.splitlines() if l.startswith(RESULT)]
                    r = json.loads(line[-1][len(RESULT):]) if line else dict(
                        outcome=f"exit {p.returncode}: " + (p.stderr.strip().splitlines() or [""])[-1][:40])
                except subprocess.TimeoutExpired:
                    r = dict(outcome="timeout")
                per_step.append((row, opt, busy, r))
                f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
                print(f"{row:<28} {opt:<8} {busy:<4} {r['outcome']:<28} {f(r.get('step_ms')):>9} "
                      f"{f(r.get('empty_cache_ms'), 3):>15}  {f(r.get('checksum'), 1)}", flush=True)
                if args.verbose:
                    print("    step ms per step:", r.get("step_ms_all"), "empty_cache ms per step:",
                          r.get("empty_cache_ms_all"), "pending MiB:", r.get("pending_mib"))
                if row.startswith("streamsafe") and r["outcome"] != "ok":
                    ok = False
    if args.per_step:
        print_per_step(args, per_step)
    return 0 if ok else 1


def print_per_step(args, results):
    """Every step's time, one row per (allocator, optimizer, busy): markdown."""
    n = args.steps
    print("\n<!-- summary -->")
    print(f"\n### The seed example, every step (ms; {args.params} x {args.mib} MiB gradients, step 0 included)\n")
    print("| allocator | optimizer | busy | " + " | ".join(f"step {i}" for i in range(n)) +
          " | median of steps 1+ | empty_cache ms, each step | outcome |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in range(n)) + " | --- | --- | --- |")
    for row, opt, busy, r in results:
        times = r.get("step_ms_all") or []
        cells = [f"{t:.1f}" for t in times] + ["-"] * (n - len(times))
        median = f"{r['step_ms']:.1f}" if r.get("step_ms") is not None else "-"
        caches = ", ".join(f"{c:g}" for c in r.get("empty_cache_ms_all") or []) or "-"
        print(f"| {row} | {opt} | {busy} | " + " | ".join(cells) + f" | {median} | {caches} | {r['outcome']} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child")
    ap.add_argument("--opt", default="signsgd", choices=["signsgd", "adamw"])
    ap.add_argument("--busy", type=int, default=0)
    ap.add_argument("--params", type=int, default=256)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--busy-matmuls", type=int, default=300)
    ap.add_argument("--busy-n", type=int, default=8192)
    ap.add_argument("--rows", default="")
    ap.add_argument("--opts", default="signsgd,adamw", help="optimizers of the table (parent)")
    ap.add_argument("--busy-modes", default="0,1", help="busy-stream settings of the table (parent): 0, 1 or 0,1")
    ap.add_argument("--per-step", action="store_true", help="(parent) also a markdown table of every step's time")
    ap.add_argument("--timeout", type=int, default=180)
    ap.add_argument("--budget", type=int, default=0,
                    help="(parent) seconds for the whole table (0: no limit): rows that would start with less "
                         "than --min-row-s left are skipped")
    ap.add_argument("--min-row-s", type=int, default=8, help="see --budget (default 8)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
