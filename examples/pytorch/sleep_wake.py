#!/usr/bin/env python3
"""Sleep and wake for colocated RL, in PyTorch: a loop that alternates a training phase and a
generation phase on one GPU, pausing each side at every switch (docs/sleep.md).

Training phase: weights (tag "weights") and SignSGD momentum (tag "optim"), gradients and the
step's temporaries (tag "grads"); the per-parameter SignSGD step runs on a side stream, one
parameter at a time, and is still running when the phase ends. Generation phase: a KV cache (tag
"kv_cache") that grows and shrinks block by block. At the switch to generation the training tags
are paused (weights and optim: offload to pinned host memory; grads: discard) and kv_cache is
resumed; at the switch back kv_cache is paused (discard) and the training tags resumed.

Rows (each in its own process: a fault poisons the CUDA context):
  streamsafe-defer  pause(wait=False): fenced, never blocks; the release worker unmaps;
                    resume(wait=False) + wait_resumed before the next step: the worker maps
  streamsafe-wait   pause(wait=True): the host waits on exactly the fence events
  sync-then-unmap   torch.cuda.synchronize() first, then pause (what careful tools do)
  unmap-no-wait     release_fence:allocation_stream: the fence ignores the side stream (what the
                    crashing tool does); expected to fault or corrupt the weights
Reported per row: free device memory before and after each pause (after the call returned and
once everything was back), pause host time and how long after it everything was back, resume host
time, the phase switch time (host time of the pause and resume calls), the outcome, and a checksum
of the weights at the end (equal in every row that computed correctly). The first cycle pins the
host memory of the offload; the table gives the median of the later cycles, each cycle is listed.

  python3 examples/pytorch/sleep_wake.py [--params 64] [--mib 64] [--cycles 3] [--rows ...]
  python3 examples/pytorch/sleep_wake.py --child streamsafe-defer ...

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
ROWS = ["streamsafe-defer", "streamsafe-wait", "sync-then-unmap", "unmap-no-wait"]
CONF = {
    "streamsafe-defer": "backend:expandable,empty_cache:defer",
    "streamsafe-wait": "backend:expandable,empty_cache:wait",
    "sync-then-unmap": "backend:expandable,empty_cache:wait",
    "unmap-no-wait": "backend:expandable,empty_cache:defer,release_fence:allocation_stream",
}
TRAIN_TAGS = (("weights", "offload"), ("optim", "offload"), ("grads", "discard"))


def child(args):
    import torch
    import streamsafe.torch as sst

    sst.install(CONF[args.child])
    dev = torch.device("cuda", 0)
    wait = args.child != "streamsafe-defer" and args.child != "unmap-no-wait"
    defer_resume = args.child == "streamsafe-defer"  # resume(wait=False), then wait_resumed
    torch.manual_seed(0)
    n = (args.mib << 20) // 4
    compute = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    with sst.tag("weights"):
        params = [torch.randn(n, device=dev) for _ in range(args.params)]
    with sst.tag("optim"):
        moms = [torch.zeros(n, device=dev) for _ in range(args.params)]
    gib = lambda b: b / (1 << 30)  # noqa: E731
    free = lambda: gib(torch.cuda.mem_get_info()[0])  # noqa: E731

    def settle(tags, limit_s=20.0):
        # Until every tag is back with the driver; side.query() raises once a fault (an illegal
        # address in the tail) has poisoned the context.
        t0 = time.perf_counter()
        while any(sst.tag_status(t)["phase"] != "paused" for t in tags):
            side.query()
            if time.perf_counter() - t0 > limit_s:
                raise RuntimeError(f"pause of {tags} did not finish in {limit_s} s")
            time.sleep(0.0005)
        return time.perf_counter() - t0

    def pause_all(tags_modes):
        if args.child == "sync-then-unmap":
            torch.cuda.synchronize()
        for t, mode in tags_modes:
            sst.pause(t, mode=mode, wait=wait)

    rows = []
    outcome = "ok"
    try:
        for cycle in range(args.cycles):
            # ---- training: gradients, then the SignSGD tail on the side stream -------------
            with sst.tag("grads"):
                grads = [torch.randn(n, device=dev) * 0.01 for _ in range(args.params)]
                side.wait_stream(compute)
                with torch.cuda.stream(side):
                    for p, m, g in zip(params, moms, grads):
                        torch.cuda._sleep(args.tail_cycles)  # a slow kernel per parameter
                        m.mul_(0.9).add_(g, alpha=0.1)
                        p.add_(torch.sign(m), alpha=-1e-3)
                del grads  # freed from the host while the tail still reads them
            # ---- switch to generation ---------------------------------------------------------
            before = free()
            t0 = time.perf_counter()
            pause_all(TRAIN_TAGS)
            pause_s = time.perf_counter() - t0
            after_call = free()
            settle_s = settle([t for t, _ in TRAIN_TAGS])
            after_settle = free()
            t0 = time.perf_counter()
            sst.resume("kv_cache")
            resume_kv_s = time.perf_counter() - t0
            switch_s = pause_s + resume_kv_s  # host time the switch costs the caller
            # ---- generation: the KV cache grows and shrinks -----------------------------------
            with sst.tag("kv_cache"):
                kv = []
                for i in range(args.kv_blocks):
                    kv.append(torch.empty(((i % 7) + 1) * (args.kv_mib << 20) // 2, dtype=torch.float16,
                                          device=dev).fill_(1.0))
                    if i % 3 == 2:
                        kv.pop(len(kv) // 2)
                kv_sum = float(sum(t.float().sum().item() for t in kv[:2]))
                del kv
            # ---- switch back to training -----------------------------------------------------
            t_back = time.perf_counter()
            pause_all((("kv_cache", "discard"),))
            pause_kv_s = time.perf_counter() - t_back
            t0 = time.perf_counter()
            for t, _ in TRAIN_TAGS:
                sst.resume(t, wait=not defer_resume)
            resume_s = time.perf_counter() - t0
            back_s = time.perf_counter() - t_back
            # streamsafe-defer: the worker maps while the caller goes on; wait before the step.
            t0 = time.perf_counter()
            if defer_resume:
                for t, _ in TRAIN_TAGS:
                    st = sst.wait_resumed(t)
                    if st["phase"] != "active":
                        raise RuntimeError(f"resume of {t}: {st}")
            wait_resumed_s = time.perf_counter() - t0
            rows.append(dict(cycle=cycle, free_before_gib=before, free_after_call_gib=after_call,
                             free_after_settle_gib=after_settle, pause_ms=pause_s * 1e3,
                             settle_ms=settle_s * 1e3, resume_kv_ms=resume_kv_s * 1e3,
                             switch_ms=switch_s * 1e3, pause_kv_ms=pause_kv_s * 1e3,
                             resume_ms=resume_s * 1e3, back_ms=back_s * 1e3,
                             wait_resumed_ms=wait_resumed_s * 1e3, kv_sum=kv_sum))
        torch.cuda.synchronize()
        checksum = float(sum(p.double().sum().item() for p in params))
    except Exception as e:  # noqa: BLE001 - the outcome is the report
        outcome = f"fault: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        checksum = None
    print(RESULT + json.dumps(dict(row=args.child, outcome=outcome, checksum=checksum, cycles=rows)),
          flush=True)


def parent(args):
    results = []
    for row in args.rows.split(","):
        cmd = [sys.executable, __file__, "--child", row, "--params", str(args.params), "--mib",
               str(args.mib), "--cycles", str(args.cycles), "--tail-cycles", str(args.tail_cycles),
               "--kv-blocks", str(args.kv_blocks), "--kv-mib", str(args.kv_mib)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        got = [json.loads(line[len(RESULT):]) for line in proc.stdout.splitlines()
               if line.startswith(RESULT)]
        if got:
            r = got[0]
        else:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:120]
            r = dict(row=row, outcome=f"crashed (exit {proc.returncode}): {tail}", checksum=None,
                     cycles=[])
        r["wall_s"] = time.perf_counter() - t0
        results.append(r)
        if args.verbose:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
    # Steady state: the cycles after the first (which pins the host memory of the offload).
    med = lambda r, k: statistics.median([c[k] for c in r["cycles"][1:] or r["cycles"]]) if r["cycles"] else float("nan")  # noqa: E731
    print(f"{args.params} parameters x {args.mib} MiB per tag (weights, optim, grads), "
          f"{args.cycles} cycles; medians over cycles 2..{args.cycles}; GiB free on the device")
    print("| row | outcome | free before pause | after the call | once back | pause ms | "
          "back after ms | switch ms (pause + resume kv) | resume ms (3 tags) | switch back ms | "
          "checksum |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['row']} | {r['outcome']} | {med(r, 'free_before_gib'):.2f} | "
              f"{med(r, 'free_after_call_gib'):.2f} | {med(r, 'free_after_settle_gib'):.2f} | "
              f"{med(r, 'pause_ms'):.2f} | {med(r, 'settle_ms'):.2f} | {med(r, 'switch_ms'):.2f} | "
              f"{med(r, 'resume_ms'):.2f} | {med(r, 'back_ms'):.2f} | {r['checksum']} |")
    for r in results:
        for c in r["cycles"]:
            print(f"  {r['row']} cycle {c['cycle']}: pause {c['pause_ms']:.2f} ms, back after "
                  f"{c['settle_ms']:.2f} ms more, free {c['free_before_gib']:.2f} -> "
                  f"{c['free_after_call_gib']:.2f} -> {c['free_after_settle_gib']:.2f} GiB, resume kv "
                  f"{c['resume_kv_ms']:.2f} ms, pause kv {c['pause_kv_ms']:.2f} ms, resume 3 tags "
                  f"{c['resume_ms']:.2f} ms (then wait_resumed {c['wait_resumed_ms']:.2f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--params", type=int, default=64)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--tail-cycles", type=int, default=200000, help="torch.cuda._sleep per parameter")
    ap.add_argument("--kv-blocks", type=int, default=48)
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--json")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
