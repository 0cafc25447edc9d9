#!/usr/bin/env python3
"""A HuggingFace transformers GPT-2, built from its config (no downloads), trained a few steps
and then run through generate(), on streamsafe and on PyTorch's allocator.

Each allocator runs in its own process with the same seed and data; the parent prints median step
time, peak reserved and peak allocated memory, the final loss and the generated tokens (identical
for both allocators with deterministic algorithms). torch.cuda.empty_cache() after every step.

  python3 examples/pytorch/hf_train_generate.py [--steps 20] [--allocators pytorch,streamsafe]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

RESULT = "RESULT "


def child(args):
    if args.child == "streamsafe":
        import streamsafe.torch as sst
        sst.install(os.environ.get("STREAMSAFE_ALLOC_CONF") or "backend:expandable,empty_cache:defer")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    cfg = GPT2Config(vocab_size=args.vocab, n_positions=args.block, n_embd=args.embd, n_layer=args.layers,
                     n_head=args.heads, attn_implementation="eager")
    model = GPT2LMHeadModel(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    g = torch.Generator(device=dev)
    torch.cuda.reset_peak_memory_stats()
    times, loss = [], None
    for step in range(args.steps):
        g.manual_seed(100 + step)
        x = torch.randint(0, args.vocab, (args.batch, args.block), device=dev, generator=g)
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    model.eval()
    prompt = torch.arange(8, device=dev).unsqueeze(0)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    r = dict(step_ms=statistics.median(times[2:] or times), peak_reserved=torch.cuda.max_memory_reserved(),
             peak_allocated=torch.cuda.max_memory_allocated(), loss=float(loss), tokens=out[0].tolist()[8:])
    print(RESULT + json.dumps(r), flush=True)


def parent(args):
    print(f"transformers GPT2LMHeadModel: {args.layers} layers, n_embd {args.embd}, batch {args.batch} x "
          f"{args.block}, {args.steps} AdamW steps, then generate(16 tokens, greedy)")
    header = f"{'allocator':<11} {'step ms':>8} {'peak reserved MiB':>18} {'peak allocated MiB':>19}  {'final loss':<20} generated"
    print(header)
    print("-" * len(header))
    seen = set()
    rc = 0
    for alloc in args.allocators.split(","):
        env = dict(os.environ)
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", alloc, "--steps", str(args.steps)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        line = [l for l in p.stdout.splitlines() if l.startswith(RESULT)]
        if not line:
            print(f"{alloc:<11} failed (exit {p.returncode}): {(p.stderr.strip().splitlines() or [''])[-1][:80]}")
            rc = 1
            continue
        r = json.loads(line[-1][len(RESULT):])
        seen.add((r["loss"], tuple(r["tokens"])))
        print(f"{alloc:<11} {r['step_ms']:8.2f} {r['peak_reserved'] / 2**20:18.1f} {r['peak_allocated'] / 2**20:19.1f}  "
              f"{r['loss']!r:<20} {r['tokens']}", flush=True)
    print("final loss and generated tokens " + ("identical" if len(seen) == 1 else "DIFFER"))
    return rc | (len(seen) != 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child")
    ap.add_argument("--allocators", default="pytorch,streamsafe")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
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
