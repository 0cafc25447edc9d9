#!/usr/bin/env python3
"""FSDP2 (fully_shard) training of a GPT on streamsafe and on PyTorch's allocator, world size 1.

The GPT of train_gpt.py (built from a config, synthetic tokens, no downloads; parameters created
on the GPU) is wrapped with torch.distributed.fsdp.fully_shard per block and at the root, trained
with per-parameter SignSGD or AdamW (foreach), torch.cuda.empty_cache() after every step. Each
(row, optimizer) pair runs in its own process, one rank: the script sets RANK, WORLD_SIZE,
MASTER_ADDR and a free MASTER_PORT and calls torch.distributed.init_process_group (NCCL; gloo if
NCCL cannot start). Per step it records peak reserved and peak allocated memory
(reset_peak_memory_stats at the start of each step), the step time (host, the step's work
finished, empty_cache included) and the time inside empty_cache(). The parent prints every step,
then one table: a chosen step (--report-step, default 7) and the median of steps
--median-from (default 3) to the last, with the final loss. With deterministic algorithms the
final losses of all rows of one optimizer must be identical.

Rows:
  pytorch                       PyTorch's allocator, default settings
  pytorch-expandable            PyTorch's allocator, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  streamsafe                    streamsafe.torch.install(STREAMSAFE_ALLOC_CONF, default
                                "backend:expandable,empty_cache:defer")
  streamsafe-cuda_malloc-defer  streamsafe.torch.install("backend:cuda_malloc,empty_cache:defer")
  streamsafe-cuda_malloc-wait   ... empty_cache:wait
  streamsafe-expandable-defer   streamsafe.torch.install("backend:expandable,empty_cache:defer")
  streamsafe-expandable-wait    ... empty_cache:wait

  python3 examples/pytorch/fsdp_train.py [--steps 20] [--rows pytorch,streamsafe] [--opts signsgd,adamw]
  # the H200 size: a 24-layer GPT-2 of width 2048 (1.3 B parameters), batch 4 x 512
  python3 examples/pytorch/fsdp_train.py --layers 24 --embd 2048 --heads 16 --vocab 50257 --block 512 \\
      --batch 4 --steps 10 --rows pytorch-expandable,pytorch,streamsafe-cuda_malloc-defer,\\
streamsafe-expandable-defer,streamsafe-expandable-wait
  torchrun --nproc-per-node=1 examples/pytorch/fsdp_train.py --child streamsafe --opt adamw
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
RESULT = "RESULT "
GIB = 1 << 30

ROWS = {  # name -> (label, PYTORCH_CUDA_ALLOC_CONF or None, streamsafe configuration or None)
    "pytorch": ("PyTorch, default", None, None),
    "pytorch-expandable": ("PyTorch, expandable segments", "expandable_segments:True", None),
    "streamsafe": ("streamsafe (STREAMSAFE_ALLOC_CONF)", None, ""),
    "streamsafe-cuda_malloc-defer": ("streamsafe cuda_malloc, defer", None, "backend:cuda_malloc,empty_cache:defer"),
    "streamsafe-cuda_malloc-wait": ("streamsafe cuda_malloc, wait", None, "backend:cuda_malloc,empty_cache:wait"),
    "streamsafe-expandable-defer": ("streamsafe expandable, defer", None, "backend:expandable,empty_cache:defer"),
    "streamsafe-expandable-wait": ("streamsafe expandable, wait", None, "backend:expandable,empty_cache:wait"),
}
MODEL_ARGS = ("vocab", "block", "layers", "heads", "embd", "batch", "steps")


def child(args):
    _, _, conf = ROWS[args.child]
    sst = None
    if conf is not None:
        import streamsafe.torch as sst
        sst.install(conf or os.environ.get("STREAMSAFE_ALLOC_CONF") or "backend:expandable,empty_cache:defer")
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from train_gpt import batch, build_model, signsgd_step

    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    backend = args.dist_backend
    try:
        if backend == "nccl":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group(backend)
    except Exception as e:  # no NCCL here: gloo (CUDA collectives staged through the host)
        if backend != "nccl":
            raise
        print(f"fsdp_train: nccl failed ({e}); using gloo", file=sys.stderr, flush=True)
        backend = "gloo"
        dist.init_process_group("gloo")
    cfg = dict(vocab=args.vocab, block=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.embd,
               batch=args.batch)
    torch.manual_seed(0)
    with torch.device(device):  # parameters created and initialised on the GPU: no host round trip
        model = build_model(torch, cfg)
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True) if args.opt == "adamw" else None
    torch.cuda.synchronize()
    steps, loss = [], None
    for step in range(args.steps):
        torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        x, y = batch(torch, cfg, step, device)
        loss = model(x, y)
        loss.backward()
        if opt is None:
            signsgd_step(torch, list(model.parameters()), 1e-3, 0.1)
        else:
            opt.step()
        model.zero_grad(set_to_none=True)
        del x, y
        t1 = time.perf_counter()
        torch.cuda.empty_cache()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        steps.append(dict(step=step, step_ms=(t3 - t0) * 1e3, empty_cache_ms=(t2 - t1) * 1e3,
                          peak_reserved=torch.cuda.max_memory_reserved(device),
                          peak_allocated=torch.cuda.max_memory_allocated(device),
                          pending_release=sst.pending_release_bytes() if sst is not None else 0))
    r = dict(steps=steps, loss=float(loss), params=n_params, dist_backend=backend, torch=torch.__version__,
             config=sst.config() if sst is not None else os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "(default)"),
             step_ms=statistics.median([s["step_ms"] for s in steps[2:]] or [s["step_ms"] for s in steps]),
             peak_reserved=max(s["peak_reserved"] for s in steps), peak_allocated=max(s["peak_allocated"] for s in steps))
    if dist.get_rank() == 0:
        print(RESULT + json.dumps(r), flush=True)
    dist.destroy_process_group()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(args, row, opt, timeout):
    _, pt_conf, _ = ROWS[row]
    env = dict(os.environ, PYTHONUNBUFFERED="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    if pt_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = pt_conf
    if row != "streamsafe":
        env.pop("STREAMSAFE_ALLOC_CONF", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", row, "--opt", opt,
           "--dist-backend", args.dist_backend]
    for k in MODEL_ARGS:
        cmd += [f"--{k}", str(getattr(args, k))]
    if not args.deterministic:
        cmd.append("--no-deterministic")
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return dict(outcome=f"timeout after {timeout} s", stderr=err)
    line = [l for l in p.stdout.splitlines() if l.startswith(RESULT)]
    if not line:
        last = [l for l in (p.stderr or p.stdout).strip().splitlines() if l.strip()]
        return dict(outcome=f"exit {p.returncode}: {(last or [''])[-1][:160]}", stderr=p.stderr)
    r = json.loads(line[-1][len(RESULT):])
    r.update(outcome="ok" if p.returncode == 0 else f"exit {p.returncode}", seconds=time.time() - t0)
    return r


def parent(args):
    rows = (args.rows or args.allocators).split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        sys.exit(f"unknown rows {unknown}; rows: {', '.join(ROWS)}")
    k, lo = args.report_step, args.median_from
    hi = args.steps - 1
    print(f"# FSDP2, world size 1: GPT {args.layers} layers, n_embd {args.embd}, {args.heads} heads, vocab "
          f"{args.vocab}, batch {args.batch} x {args.block}, {args.steps} steps, empty_cache() every step\n")
    print("| allocator | optimizer | step | peak reserved GiB | peak allocated GiB | step ms | empty_cache ms | "
          "queued GiB at the step's end |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    results = []
    started = time.time()
    for opt in args.opts.split(","):
        for row in rows:
            timeout = args.timeout
            if args.budget:
                timeout = min(timeout, int(args.budget - (time.time() - started)))
            if timeout < args.min_row_s:
                r = dict(outcome=f"skipped: the time budget ({args.budget} s) is spent")
            else:
                r = run_one(args, row, opt, timeout)
            r.update(row=row, label=ROWS[row][0], opt=opt)
            results.append(r)
            for s in r.get("steps", []):
                print(f"| {r['label']} | {opt} | {s['step']} | {s['peak_reserved'] / GIB:.2f} | "
                      f"{s['peak_allocated'] / GIB:.2f} | {s['step_ms']:.1f} | {s['empty_cache_ms']:.3f} | "
                      f"{s['pending_release'] / GIB:.2f} |", flush=True)
            if r["outcome"] != "ok":
                print(f"| {r['label']} | {opt} | - | {r['outcome']} | | | | |", flush=True)
                tail = [l for l in (r.get("stderr") or "").strip().splitlines() if l.strip()][-10:]
                if tail:
                    print("\n```\n" + "\n".join(tail) + "\n```\n", flush=True)

    def at(r, key, scale=1.0):
        s = [s for s in r.get("steps", []) if s["step"] == k]
        return f"{s[0][key] / scale:.{2 if scale != 1.0 else 1}f}" if s else "-"

    def median(r, key, scale=1.0, digits=1):
        v = [s[key] for s in r.get("steps", []) if lo <= s["step"] <= hi]
        return f"{statistics.median(v) / scale:.{digits}f}" if v else "-"

    n_params = next((r["params"] for r in results if "params" in r), None)
    print("\n<!-- summary -->")
    print(f"\n### FSDP2, world size 1 ({args.layers} layers, width {args.embd}"
          + (f", {n_params / 1e9:.2f} B parameters" if n_params else "")
          + f", batch {args.batch} x {args.block}, empty_cache() every step)\n")
    print(f"Step {k}, and in brackets the median of steps {lo}-{hi}. Peak reserved: max_memory_reserved() "
          f"within the step.\n")
    print("| allocator | optimizer | peak reserved GiB | step ms | empty_cache ms | peak allocated GiB | "
          "peak reserved GiB, whole run | final loss | outcome |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        empty_k = [s["empty_cache_ms"] for s in r.get("steps", []) if s["step"] == k]
        empty_text = f"{empty_k[0]:.2f}" if empty_k else "-"
        whole = f"{r['peak_reserved'] / GIB:.2f}" if "peak_reserved" in r else "-"
        print(f"| {r['label']} | {r['opt']} | {at(r, 'peak_reserved', GIB)} ({median(r, 'peak_reserved', GIB, 2)}) | "
              f"{at(r, 'step_ms')} ({median(r, 'step_ms')}) | {empty_text} ({median(r, 'empty_cache_ms', 1.0, 2)}) | "
              f"{at(r, 'peak_allocated', GIB)} | {whole} | {r['loss'] if 'loss' in r else '-'} | {r['outcome']} |")
    rc = 0
    for opt in args.opts.split(","):
        losses = {r["loss"] for r in results if r["opt"] == opt and "loss" in r}
        if args.deterministic and losses:
            print(f"\n{opt}: final losses {'identical' if len(losses) == 1 else 'DIFFER: ' + str(sorted(losses))} "
                  f"across the rows that finished")
            rc |= len(losses) != 1
    rc |= any(r["outcome"] != "ok" for r in results)
    return int(rc)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=list(ROWS), help=argparse.SUPPRESS)
    ap.add_argument("--opt", default="signsgd", choices=["signsgd", "adamw"])
    ap.add_argument("--opts", default="signsgd,adamw")
    ap.add_argument("--rows", default="", help="comma-separated rows: " + ", ".join(ROWS))
    ap.add_argument("--allocators", default="pytorch,streamsafe", help="the rows when --rows is not given")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--report-step", type=int, default=7, help="the step of the summary table (default 7)")
    ap.add_argument("--median-from", type=int, default=3, help="the median runs from this step to the last (default 3)")
    ap.add_argument("--dist-backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                    help="deterministic algorithms, so that the final losses must agree exactly (default: on)")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per run (default 240)")
    ap.add_argument("--budget", type=int, default=0,
                    help="seconds for the whole table (0: no limit): runs that would start with less than "
                         "--min-row-s left are skipped, and the summary is still printed")
    ap.add_argument("--min-row-s", type=int, default=15, help="see --budget (default 15)")
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
