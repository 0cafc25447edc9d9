#!/usr/bin/env python3
"""FSDP2 (fully_shard) training of a small GPT on streamsafe and on PyTorch's allocator.

The GPT of train_gpt.py (built from a config, synthetic tokens, no downloads) is wrapped with
torch.distributed.fsdp.fully_shard per block and at the root, trained with per-parameter SignSGD
or AdamW, torch.cuda.empty_cache() after every step. Each (allocator, optimizer) pair runs in its
own torchrun process (--nproc-per-node=1 here); the parent prints median step time, peak
reserved and peak allocated memory and the final loss. With deterministic algorithms the final
losses of the two allocators must be identical.

  python3 examples/pytorch/fsdp_train.py [--steps 20] [--allocators pytorch,streamsafe] [--opts signsgd,adamw]
  torchrun --nproc-per-node=1 examples/pytorch/fsdp_train.py --child streamsafe --opt adamw

streamsafe: streamsafe.torch.install(STREAMSAFE_ALLOC_CONF, default "backend:expandable,empty_cache:defer").
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
RESULT = "RESULT "


def child(args):
    if args.child == "streamsafe":
        import streamsafe.torch as sst
        sst.install(os.environ.get("STREAMSAFE_ALLOC_CONF") or "backend:expandable,empty_cache:defer")
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from train_gpt import batch, build_model, signsgd_step

    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    device = torch.device("cuda", local_rank)
    cfg = dict(vocab=args.vocab, block=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.embd,
               batch=args.batch)
    torch.manual_seed(0)
    model = build_model(torch, cfg).to(device)
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True) if args.opt == "adamw" else None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, loss = [], None
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = batch(torch, cfg, step, device)
        loss = model(x, y)
        loss.backward()
        if opt is None:
            signsgd_step(torch, list(model.parameters()), 1e-3, 0.1)
        else:
            opt.step()
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    r = dict(step_ms=statistics.median(times[2:] or times), peak_reserved=torch.cuda.max_memory_reserved(),
             peak_allocated=torch.cuda.max_memory_allocated(), loss=float(loss))
    if dist.get_rank() == 0:
        print(RESULT + json.dumps(r), flush=True)
    dist.destroy_process_group()


def parent(args):
    print(f"FSDP2 GPT: {args.layers} layers, n_embd {args.embd}, batch {args.batch} x {args.block}, "
          f"{args.steps} steps, empty_cache() every step")
    header = f"{'allocator':<11} {'optimizer':<8} {'step ms':>8} {'peak reserved MiB':>18} {'peak allocated MiB':>19}  final loss"
    print(header)
    print("-" * len(header))
    losses = {}
    rc = 0
    port = 29511
    for opt in args.opts.split(","):
        for alloc in args.allocators.split(","):
            port += 1
            env = dict(os.environ)
            env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={port}",
                   os.path.abspath(__file__), "--child", alloc, "--opt", opt, "--steps", str(args.steps)]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            line = [l for l in p.stdout.splitlines() if l.startswith(RESULT)]
            if not line:
                print(f"{alloc:<11} {opt:<8} failed (exit {p.returncode}): {(p.stderr.strip().splitlines() or [''])[-1][:80]}")
                rc = 1
                continue
            r = json.loads(line[-1][len(RESULT):])
            losses.setdefault(opt, set()).add(r["loss"])
            print(f"{alloc:<11} {opt:<8} {r['step_ms']:8.2f} {r['peak_reserved'] / 2**20:18.1f} "
                  f"{r['peak_allocated'] / 2**20:19.1f}  {r['loss']!r}", flush=True)
    for opt, ls in losses.items():
        print(f"{opt}: final losses {'identical' if len(ls) == 1 else 'DIFFER'}")
        rc |= len(ls) != 1
    return rc


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child")
    ap.add_argument("--opt", default="signsgd")
    ap.add_argument("--opts", default="signsgd,adamw")
    ap.add_argument("--allocators", default="pytorch,streamsafe")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--timeout", type=int, default=240)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
