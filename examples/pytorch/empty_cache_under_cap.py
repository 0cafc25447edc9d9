#!/usr/bin/env python3
"""The seed under a memory cap: empty_cache() for headroom, then a large buffer at once.

Why people call torch.cuda.empty_cache() right after optimizer.step() is headroom: the memory the
gradients held is needed at once for something else (an FP8 gather before the weight broadcast,
a generation engine sharing the GPU under a fixed memory fraction). This example checks that the
headroom is there, under torch.cuda.set_per_process_memory_fraction:

  cap        CAP GiB (default 35) as set_per_process_memory_fraction(CAP / device total)
  params     N x M MiB float32 parameters (default 256 x 64 MiB = 16 GiB)
  each step  N x M MiB gradients allocated on a side stream (FSDP2's reduce-scatter output);
             per-parameter SignSGD on the compute stream reading them, one small kernel pair per
             gradient (p.add_(g.sign(), alpha=-lr)), no record_stream; `del grads` (the loop
             variable `g` keeps the last gradient alive, as in real code); empty_cache(); then at
             once one B GiB buffer (default 16) on the compute stream, written once. The buffer
             is freed (not emptied) at the end of the step, so the next step's gradients may be
             carved from it.
  --busy-stream  an unrelated stream runs long matrix products during the step
  --record-stream  the optimizer runs on a stream of its own: each gradient is read there and
             freed with g.record_stream(optimizer_stream) while the optimizer's tail still runs;
             the compute stream waits for the optimizer only after the buffer is written, so the
             buffer's request meets memory still pending another stream's work
  --thread   a second Python thread allocates and frees on a stream of its own throughout the step
             (1 to 2 gradient sizes each, at most 4 alive), as a data loader or a logger would

--scale S multiplies every size (cap, parameters, gradients, buffer) so the run fits any GPU and
runs fast (--scale 0.125: 8 MiB gradients, a 2 GiB buffer under a 4.375 GiB cap).

Per step it prints: whether the buffer fits (or the OutOfMemoryError), peak reserved
(max_memory_reserved, reset at the start of every step) against the cap, torch.cuda.memory_stats()'s
num_ooms at the end of the row (out-of-memory errors the allocator raised, the thread's included), the time inside
empty_cache(), the time to allocate the buffer, the time until the driver sees the freed memory
(cudaMemGetInfo polled from the moment empty_cache() returned until the process holds no more
than its allocated bytes plus a slack, with a timeout), and the step time (host, the compute
stream's work finished; the busy stream is not waited for).

Rows (each in its own process, under a time limit, so that a fault, an OOM or a hang ends only
its row):
  pytorch-expandable            PyTorch's allocator, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  pytorch-default               PyTorch's allocator, default settings
  streamsafe-cuda_malloc-defer  streamsafe.torch.install("backend:cuda_malloc,empty_cache:defer")
  streamsafe-cuda_malloc-wait   ... empty_cache:wait
  streamsafe-expandable-defer   streamsafe.torch.install("backend:expandable,empty_cache:defer")
  streamsafe-expandable-wait    ... empty_cache:wait
each without and with the busy stream (--busy-stream off|on|both). The output is markdown: a
table of every step, then a summary table per row.

  python3 examples/pytorch/empty_cache_under_cap.py [--scale 1] [--steps 4] [--busy-stream both]
                                                    [--rows pytorch-default,streamsafe-expandable-defer]
  python3 examples/pytorch/empty_cache_under_cap.py --record-stream --thread [--scale 0.25]
  python3 examples/pytorch/empty_cache_under_cap.py --child streamsafe-expandable-defer --busy 1

streamsafe must be importable (pip install --no-build-isolation . from the repository, or
PYTHONPATH=allocator/python with STREAMSAFE_TORCH_EXT_LIB pointing at a built extension).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time

RESULT = "RESULT "
GIB = 1 << 30
MIB = 1 << 20

ROWS = {  # name -> (label, PYTORCH_CUDA_ALLOC_CONF or None, streamsafe configuration or None)
    "pytorch-expandable": ("PyTorch, expandable segments", "expandable_segments:True", None),
    "pytorch-default": ("PyTorch, default", None, None),
    "streamsafe-cuda_malloc-defer": ("streamsafe cuda_malloc, defer", None, "backend:cuda_malloc,empty_cache:defer"),
    "streamsafe-cuda_malloc-wait": ("streamsafe cuda_malloc, wait", None, "backend:cuda_malloc,empty_cache:wait"),
    "streamsafe-expandable-defer": ("streamsafe expandable, defer", None, "backend:expandable,empty_cache:defer"),
    "streamsafe-expandable-wait": ("streamsafe expandable, wait", None, "backend:expandable,empty_cache:wait"),
}


def one_line(text, limit=400):
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def busy_size(args):
    """The busy stream's matrix side: its memory scales with --scale like every other size."""
    return max(256, int(args.busy_n * args.scale ** 0.5) // 64 * 64)


# ---- one row (child process) --------------------------------------------------------------------

def child(args):
    label, _, conf = ROWS[args.child]
    sst = None
    if conf is not None:
        import streamsafe.torch as sst  # imports torch
        sst.install(conf)
    import torch

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    total = torch.cuda.get_device_properties(dev).total_memory
    cap = int(args.cap_gib * GIB * args.scale)
    fraction = min(1.0, cap / total)
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    grad_bytes = int(args.grad_mib * MIB * args.scale) // 4 * 4
    n = grad_bytes // 4  # float32 elements per parameter and per gradient
    buffer_bytes = int(args.buffer_gib * GIB * args.scale)
    slack = int(args.settle_slack_mib * MIB * max(args.scale, 1 / 16))
    lr = 1e-3

    side = torch.cuda.Stream()
    busy = torch.cuda.Stream()
    opt = torch.cuda.Stream() if args.record_stream else None
    compute = torch.cuda.current_stream()
    # Warm-up: cuBLAS handles and workspaces of both streams, the kernels used below; then the
    # driver's view of this process without the example's memory.
    torch.manual_seed(0)
    w = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    with torch.cuda.stream(busy):
        w @ w
    w @ w
    x = torch.randn(1024, device=dev)
    x.add_(x.mul(1e-3).add_(1).sign(), alpha=-lr)
    del x
    del w
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    time.sleep(0.05)
    if sst is not None:
        sst.reclaim()
    driver_base_free = torch.cuda.mem_get_info(dev)[0]
    allocated_base = torch.cuda.memory_allocated(dev)

    params = [torch.randn(n, device=dev) for _ in range(args.params)]
    busy_n = busy_size(args)
    a = torch.randn(busy_n, busy_n, device=dev, dtype=torch.bfloat16) if args.busy else None
    torch.cuda.synchronize()

    def driver_used():
        """Bytes the driver sees this process hold beyond the base (cudaMemGetInfo only: cheap)."""
        return driver_base_free - torch.cuda.mem_get_info(dev)[0]

    def is_oom(e):
        return type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower()

    thread_ooms = [0]

    def thread_body(stop, seed):
        """The second thread: its own stream, 1-2 gradient sizes per tensor, at most 4 alive."""
        rng = random.Random(seed)
        mine = torch.cuda.Stream()
        held = []
        with torch.cuda.stream(mine):
            while not stop.is_set():
                nbytes = rng.randint(grad_bytes, 2 * grad_bytes) // 4 * 4
                try:
                    t = torch.empty(nbytes // 4, device=dev)
                    t.fill_(1.0)
                    held.append(t)
                except RuntimeError as e:
                    if not is_oom(e):
                        raise
                    thread_ooms[0] += 1
                if len(held) > 4 or (held and rng.random() < 0.3):
                    held.pop(0)
                time.sleep(0.0005)
            held.clear()
            mine.synchronize()

    live = {"g": None}  # the loop variable of the optimizer loop, alive until the next step rebinds it

    def run_step(step):
        """One step; the second thread (--thread) allocates throughout it and is joined after it."""
        stop, worker = threading.Event(), None
        if args.thread:
            worker = threading.Thread(target=thread_body, args=(stop, step), daemon=True)
        try:
            return step_body(step, worker)
        finally:
            if worker is not None and worker.is_alive():
                stop.set()
                worker.join()

    def step_body(step, worker):
        torch.cuda.reset_peak_memory_stats(dev)
        if args.busy:
            with torch.cuda.stream(busy):  # unrelated work, busy for a long time
                for _ in range(args.busy_matmuls):
                    a @ a
        if worker is not None:
            worker.start()
        t0 = time.perf_counter()
        side.wait_stream(compute)
        with torch.cuda.stream(side):  # FSDP2: the reduce-scatter output on its own stream
            grads = [p.mul(1e-3).add_(step) for p in params]
        if opt is not None:
            opt.wait_stream(side)
            with torch.no_grad(), torch.cuda.stream(opt):  # the optimizer's own stream
                for p, g in zip(params, grads):
                    p.add_(g.sign(), alpha=-lr)
                    g.record_stream(opt)
                    live["g"] = g
        else:
            compute.wait_stream(side)
            with torch.no_grad():
                for p, g in zip(params, grads):  # per-parameter SignSGD, no record_stream
                    p.add_(g.sign(), alpha=-lr)
                    live["g"] = g  # as a plain loop variable would: the last gradient stays alive
        del grads, g
        in_use = torch.cuda.memory_allocated(dev) - allocated_base  # read outside the timed calls
        t1 = time.perf_counter()
        torch.cuda.empty_cache()
        t2 = time.perf_counter()
        # The driver's view right at empty_cache()'s return (one cudaMemGetInfo, microseconds).
        excess = driver_used() - in_use
        pending = sst.pending_release_bytes() if sst is not None else 0
        t_first = time.perf_counter()
        buf, oom = None, ""
        try:
            buf = torch.empty(buffer_bytes, dtype=torch.uint8, device=dev)  # at once, compute stream
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            if not is_oom(e):
                raise
            oom = one_line(e, 700)
        t3 = time.perf_counter()
        if buf is not None:
            buf.fill_(1)
        if opt is not None:
            compute.wait_stream(opt)  # the next step's forward reads the updated parameters
        compute.synchronize()
        t4 = time.perf_counter()
        # Then poll until this process holds no more than it has allocated (plus the slack), or
        # the timeout. Settled at the first poll: "at return".
        settle_ms, at_return = None, excess <= slack
        if at_return:
            settle_ms = (t_first - t2) * 1e3
        else:
            in_use = torch.cuda.memory_allocated(dev) - allocated_base
            deadline = t2 + args.settle_timeout_ms / 1e3
            while True:
                excess = driver_used() - in_use
                now = time.perf_counter()
                if excess <= slack:
                    settle_ms = (now - t2) * 1e3
                    break
                if now >= deadline:
                    break
                time.sleep(0.0005)
        r = dict(step=step, fits=buf is not None, oom=oom,
                 peak_reserved=torch.cuda.max_memory_reserved(dev),
                 peak_allocated=torch.cuda.max_memory_allocated(dev),
                 reserved_end=torch.cuda.memory_reserved(dev),
                 empty_cache_ms=(t2 - t1) * 1e3, buffer_ms=(t3 - t_first) * 1e3, step_ms=(t4 - t0) * 1e3,
                 settle_ms=settle_ms, settled_at_first_poll=at_return,
                 excess_at_timeout=None if settle_ms is not None else excess, pending_release=pending)
        del buf  # freed, not emptied: the next step's gradients may be carved from it
        return r

    steps = []
    outcome = "ok"
    checksum = None
    try:
        for step in range(args.steps):
            try:
                r = run_step(step)
            except RuntimeError as e:  # torch.OutOfMemoryError is one
                if not is_oom(e):
                    raise
                # Out of memory before the buffer (the gradients, the optimizer): the step failed.
                r = dict(step=step, fits=False, oom="before the buffer: " + one_line(e, 700),
                         peak_reserved=torch.cuda.max_memory_reserved(dev),
                         peak_allocated=torch.cuda.max_memory_allocated(dev),
                         reserved_end=torch.cuda.memory_reserved(dev), empty_cache_ms=None, buffer_ms=None,
                         step_ms=None, settle_ms=None, settled_at_first_poll=False, excess_at_timeout=None,
                         pending_release=0)
            steps.append(r)
            print(f"step {step}: {json.dumps(r)}", flush=True)
            torch.cuda.synchronize()  # the next step starts from an idle device
        live["g"] = None
        checksum = float(sum(float(p.double().sum()) for p in params))
    except Exception as e:  # a fault (the context may be gone): report what was measured
        outcome = "fault: " + one_line(e, 200)
    try:
        num_ooms = int(torch.cuda.memory_stats(dev).get("num_ooms", 0))
    except Exception:  # the context may be gone after a fault
        num_ooms = None
    r = dict(row=args.child, label=label, busy=args.busy, outcome=outcome, checksum=checksum, steps=steps,
             num_ooms=num_ooms, thread_ooms=thread_ooms[0],
             cap=cap, device_total=total, fraction=fraction, grad_bytes=grad_bytes, params=args.params,
             buffer_bytes=buffer_bytes, slack=slack, torch=torch.__version__,
             config=sst.config() if sst is not None else os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "(default)"))
    print(RESULT + json.dumps(r), flush=True)
    return 0


# ---- the table (parent process) -----------------------------------------------------------------

def num(v, digits):
    return "-" if v is None else f"{v:.{digits}f}"


def fmt_range(values, digits):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    if f"{lo:.{digits}f}" == f"{hi:.{digits}f}":
        return f"{lo:.{digits}f}"
    return f"{lo:.{digits}f}-{hi:.{digits}f}"


def steps_text(idx):
    return ("step " if len(idx) == 1 else "steps ") + ", ".join(str(i) for i in idx)


def fits_text(r):
    steps = r["steps"]
    bad = [s for s in steps if not s["fits"]]
    if not steps:
        return "-"
    if not bad:
        return "every step" if len(steps) == r["n_steps"] else f"{steps_text([s['step'] for s in steps])} (then stopped)"
    good = [s["step"] for s in steps if s["fits"]]
    oom = bad[0]["oom"]
    # PyTorch's message: keep the part that says what was allocated and reserved.
    key = oom
    for marker in ("Of the allocated memory", "Including non-PyTorch memory", "allocated"):
        i = oom.find(marker)
        if i >= 0:
            key = oom[i:]
            break
    key = one_line(key, 160)
    head = f"{steps_text(good)}; " if good else ""
    return f"{head}{steps_text([s['step'] for s in bad])}: `OutOfMemoryError`, \"{key}\""


def settle_text(r, timeout_ms):
    parts = []
    at_return = [s["step"] for s in r["steps"] if s["settled_at_first_poll"]]
    timed = [s for s in r["steps"] if s["settle_ms"] is not None and not s["settled_at_first_poll"]]
    never = [s for s in r["steps"] if s["settle_ms"] is None and s["empty_cache_ms"] is not None]
    if at_return:
        parts.append("at return" + ("" if len(at_return) == len(r["steps"]) else f" on {steps_text(at_return)}"))
    if timed:
        t = f"{fmt_range([s['settle_ms'] for s in timed], 1)} ms"
        parts.append(t + ("" if len(timed) == len(r["steps"]) else f" on {steps_text([s['step'] for s in timed])}"))
    if never:
        excess = max(s["excess_at_timeout"] or 0 for s in never) / GIB
        parts.append(f"never (> {timeout_ms} ms; {excess:.2f} GiB still held) on {steps_text([s['step'] for s in never])}")
    return "; ".join(parts) if parts else "-"


def parent(args):
    rows = args.rows.split(",") if args.rows else list(ROWS)
    for row in rows:
        if row not in ROWS:
            sys.exit(f"unknown row {row!r}; rows: {', '.join(ROWS)}")
    busy_modes = {"off": [0], "on": [1], "both": [0, 1]}[args.busy_stream]
    cap_gib = args.cap_gib * args.scale
    print(f"# The seed under a memory cap (scale {args.scale})\n")
    print(f"Cap {cap_gib:.3f} GiB (set_per_process_memory_fraction); {args.params} x "
          f"{args.grad_mib * args.scale:g} MiB parameters and gradients per step (gradients on a side stream), "
          + ("per-parameter SignSGD on an optimizer stream, each gradient freed with record_stream to it, "
             if args.record_stream else "per-parameter SignSGD on the compute stream without record_stream, ")
          + ("a second thread allocating on its own stream, " if args.thread else "")
          + f"`del`, `empty_cache()`, then at "
          f"once a {args.buffer_gib * args.scale:g} GiB buffer; {args.steps} steps; busy stream: "
          f"{args.busy_matmuls} bf16 {busy_size(args)}^2 matrix products per step. Times in ms. 'driver settled': "
          f"from empty_cache()'s return until cudaMemGetInfo shows the process holding at most its allocated "
          f"bytes + {args.settle_slack_mib * max(args.scale, 1 / 16):g} MiB (polled at once, then after the buffer; "
          f"timeout {args.settle_timeout_ms} ms).\n", flush=True)
    results = []
    started = time.time()
    print("| allocator | busy | step | buffer | peak reserved GiB | peak allocated GiB | empty_cache ms | "
          "buffer alloc ms | driver settled ms | step ms | queued GiB after empty_cache |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for busy in busy_modes:
        for row in rows:
            label, pt_conf, _ = ROWS[row]
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            env.pop("PYTORCH_ALLOC_CONF", None)
            env.pop("STREAMSAFE_ALLOC_CONF", None)
            if pt_conf:
                env["PYTORCH_CUDA_ALLOC_CONF"] = pt_conf
            cmd = [sys.executable, os.path.abspath(__file__), "--child", row, "--busy", str(busy),
                   "--scale", str(args.scale), "--cap-gib", str(args.cap_gib), "--params", str(args.params),
                   "--grad-mib", str(args.grad_mib), "--buffer-gib", str(args.buffer_gib), "--steps", str(args.steps),
                   "--busy-matmuls", str(args.busy_matmuls), "--busy-n", str(args.busy_n),
                   "--settle-timeout-ms", str(args.settle_timeout_ms), "--settle-slack-mib", str(args.settle_slack_mib),
                   "--record-stream", str(int(args.record_stream)), "--thread", str(int(args.thread))]
            t0 = time.time()
            r, stdout, stderr = None, "", ""
            timeout = args.timeout
            if args.budget:
                timeout = min(timeout, int(args.budget - (t0 - started)))
                if timeout < args.min_row_s:
                    r = dict(outcome=f"skipped: the time budget ({args.budget} s) is spent", steps=[])
                    r.update(row=row, label=label, busy=busy, n_steps=args.steps, seconds=0.0)
                    results.append(r)
                    print(f"| {label} | {busy} | - | {r['outcome']} | | | | | | | |", flush=True)
                    continue
            try:
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
                stdout, stderr = p.stdout, p.stderr
                lines = [l for l in stdout.splitlines() if l.startswith(RESULT)]
                if lines:
                    r = json.loads(lines[-1][len(RESULT):])
                else:
                    last = (stderr.strip().splitlines() or stdout.strip().splitlines() or [""])[-1]
                    r = dict(outcome=f"exit {p.returncode}: {one_line(last, 200)}", steps=[])
            except subprocess.TimeoutExpired as e:
                stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
                steps = [json.loads(l.split(": ", 1)[1]) for l in stdout.splitlines() if l.startswith("step ")]
                r = dict(outcome=f"timeout after {timeout} s", steps=steps)
            r.update(row=row, label=label, busy=busy, n_steps=args.steps, seconds=time.time() - t0)
            results.append(r)
            for s in r["steps"]:
                if s["empty_cache_ms"] is None:
                    settle = "-"
                elif s["settle_ms"] is not None:
                    settle = f"{s['settle_ms']:.1f}" + (" (at return)" if s["settled_at_first_poll"] else "")
                else:
                    settle = f"never (> {args.settle_timeout_ms}; {(s['excess_at_timeout'] or 0) / GIB:.2f} GiB held)"
                over = " **over the cap**" if s["peak_reserved"] > r.get("cap", float("inf")) else ""
                print(f"| {label} | {busy} | {s['step']} | {'fits' if s['fits'] else 'OOM'} | "
                      f"{s['peak_reserved'] / GIB:.2f}{over} | {s['peak_allocated'] / GIB:.2f} | "
                      f"{num(s['empty_cache_ms'], 3)} | {num(s['buffer_ms'], 2)} | {settle} | {num(s['step_ms'], 1)} | "
                      f"{s['pending_release'] / GIB:.2f} |", flush=True)
            if r["outcome"] != "ok" or not r["steps"]:
                print(f"| {label} | {busy} | - | {one_line(r['outcome'], 200)} | | | | | | | |", flush=True)
                tail = [l for l in stderr.strip().splitlines() if l.strip()][-8:]
                if tail:
                    print("\n```\n" + "\n".join(tail) + "\n```\n", flush=True)
    # The OOM messages in full, once per row.
    ooms = [(r, s) for r in results for s in r["steps"] if not s["fits"]]
    if ooms:
        print("\nOut-of-memory messages (first per row):\n")
        seen = set()
        for r, s in ooms:
            if (r["row"], r["busy"]) in seen:
                continue
            seen.add((r["row"], r["busy"]))
            print(f"- {r['label']}, busy {r['busy']}, step {s['step']}: {s['oom']}")
    print("\n<!-- summary -->")
    extra = "".join([", record_stream to the optimizer's stream" if args.record_stream else "",
                     ", a second allocating thread" if args.thread else ""])
    print(f"\n### The seed under a {cap_gib:g} GiB cap (scale {args.scale}, {args.steps} steps{extra})\n")
    print(f"| allocator | busy stream | buffer fits | peak reserved GiB (cap {cap_gib:.2f}) | num_ooms | empty_cache ms | "
          f"buffer alloc ms | driver sees the memory free after | step ms | outcome |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        peak = max((s["peak_reserved"] for s in r["steps"]), default=None)
        peak_text = "-" if peak is None else f"{peak / GIB:.2f}"
        if peak is not None and peak > r.get("cap", float("inf")):
            peak_text = f"**{peak_text}** (over the cap)"
        ooms = "-" if r.get("num_ooms") is None else str(r["num_ooms"])
        print(f"| {r['label']} | {'yes' if r['busy'] else 'no'} | {fits_text(r)} | {peak_text} | {ooms} | "
              f"{fmt_range([s['empty_cache_ms'] for s in r['steps']], 2)} | "
              f"{fmt_range([s['buffer_ms'] for s in r['steps']], 1)} | {settle_text(r, args.settle_timeout_ms)} | "
              f"{fmt_range([s['step_ms'] for s in r['steps']], 0)} | {one_line(r['outcome'], 80)} |")
    sums = {r.get("checksum") for r in results if r.get("checksum") is not None}
    print(f"\nParameter checksums: {'equal in every row that finished' if len(sums) <= 1 else 'DIFFER: ' + str(sorted(sums))}.")
    failed = [r for r in results if r["outcome"] != "ok"]
    return 1 if failed or len(sums) > 1 else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=list(ROWS), help=argparse.SUPPRESS)
    ap.add_argument("--busy", type=int, default=0, help="(child) 1: the unrelated busy stream runs")
    ap.add_argument("--busy-stream", default="both", choices=["off", "on", "both"],
                    help="rows without, with, or both without and with the busy stream (default both)")
    ap.add_argument("--record-stream", type=int, nargs="?", const=1, default=0,
                    help="the optimizer on its own stream, gradients freed with record_stream to it")
    ap.add_argument("--thread", type=int, nargs="?", const=1, default=0,
                    help="a second Python thread allocating and freeing on its own stream")
    ap.add_argument("--rows", default="", help="comma-separated rows (default: all): " + ", ".join(ROWS))
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every size (default 1: the H200 sizes)")
    ap.add_argument("--cap-gib", type=float, default=35.0, help="the memory cap before --scale (default 35)")
    ap.add_argument("--params", type=int, default=256, help="parameters and gradients per step (default 256)")
    ap.add_argument("--grad-mib", type=float, default=64.0, help="MiB per parameter / gradient before --scale (64)")
    ap.add_argument("--buffer-gib", type=float, default=16.0, help="the buffer after empty_cache, GiB before --scale (16)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--busy-matmuls", type=int, default=300)
    ap.add_argument("--busy-n", type=int, default=8192)
    ap.add_argument("--settle-timeout-ms", type=int, default=2000)
    ap.add_argument("--settle-slack-mib", type=float, default=512.0,
                    help="what the process may hold beyond its allocated bytes and still count as settled "
                         "(MiB at scale 1; scaled, at least 1/16 of it)")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per row (default 120)")
    ap.add_argument("--budget", type=int, default=0,
                    help="seconds for the whole table (0: no limit): rows that would start with less than "
                         "--min-row-s left are skipped, and the summary is still printed")
    ap.add_argument("--min-row-s", type=int, default=12, help="see --budget (default 12)")
    args = ap.parse_args()
    if args.child:
        return child(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
