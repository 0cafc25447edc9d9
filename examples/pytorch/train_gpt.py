#!/usr/bin/env python3
"""Train a small GPT-style model on streamsafe and on PyTorch's own allocator, side by side.

The model is built from a config (no downloads) and trained on synthetic tokens with a
per-parameter SignSGD optimizer (decoupled weight decay, one in-place update per parameter, as
in the race that DESIGN.md describes) and torch.cuda.empty_cache() after every step. Each
allocator runs in its own process, on the same model, data and seed:

  pytorch     PyTorch's CUDACachingAllocator (default settings)
  streamsafe  torch.cuda.memory.CUDAPluggableAllocator over libstreamsafe_torch.so; its cache is
              emptied after every step too (torch.cuda.empty_cache() does not reach a pluggable
              allocator, so the script also calls streamsafe_torch_empty_cache through ctypes)
  preload     PYTORCH_NO_CUDA_MEMORY_CACHING=1 under LD_PRELOAD=libstreamsafe_preload.so: every
              tensor is a cudaMalloc/cudaFree that the interposer serves

and the parent prints step time (median and mean over the measured steps; a step includes the
empty_cache call), the host time spent inside empty_cache (it waits for the step's GPU work in
every mode), peak reserved and peak allocated memory, driver allocations and the final loss. With deterministic
algorithms (the default) the final losses must agree exactly: a block handed out while a
kernel still used it would show as a different loss.

  python3 examples/pytorch/train_gpt.py --build build [--steps 30] [--modes pytorch,streamsafe,preload]
  python3 examples/pytorch/train_gpt.py --child streamsafe --torch-lib build/allocator/libstreamsafe_torch.so

Configuration of streamsafe: STREAMSAFE_ALLOC_CONF (e.g. "backend:expandable"). Exit status 0
when every run finished with a finite loss (and, deterministic, the same one).
"""

import argparse
import ctypes
import json
import math
import os
import statistics
import subprocess
import sys
import time

RESULT_TAG = "RESULT "


# ---- the model (imported lazily: the parent process needs no torch) -----------------------------

def build_model(torch, cfg):
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(cfg["n_embd"])
            self.qkv = nn.Linear(cfg["n_embd"], 3 * cfg["n_embd"])
            self.proj = nn.Linear(cfg["n_embd"], cfg["n_embd"])
            self.ln2 = nn.LayerNorm(cfg["n_embd"])
            self.fc = nn.Linear(cfg["n_embd"], 4 * cfg["n_embd"])
            self.fc_out = nn.Linear(4 * cfg["n_embd"], cfg["n_embd"])

        def forward(self, x):
            b, t, c = x.shape
            h = cfg["n_head"]
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, h, c // h).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(cfg["vocab"], cfg["n_embd"])
            self.pos = nn.Embedding(cfg["block"], cfg["n_embd"])
            self.blocks = nn.ModuleList(Block() for _ in range(cfg["n_layer"]))
            self.ln_f = nn.LayerNorm(cfg["n_embd"])
            self.head = nn.Linear(cfg["n_embd"], cfg["vocab"], bias=False)
            self.head.weight = self.tok.weight  # tied, as in GPT-2

        def forward(self, idx, targets):
            t = idx.shape[1]
            x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    model = GPT()
    for m in model.modules():  # GPT-2's initialisation
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    return model


def signsgd_step(torch, params, lr, weight_decay):
    """Per-parameter SignSGD with decoupled weight decay: one pair of kernels per parameter."""
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                continue
            p.mul_(1 - lr * weight_decay)
            p.add_(p.grad.sign(), alpha=-lr)


def batch(torch, cfg, step, device):
    """Synthetic tokens with learnable structure: the next token is a fixed function of the last."""
    g = torch.Generator(device=device)
    g.manual_seed(1000 + step)
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["block"]), device=device, generator=g)
    y = (x * 31 + 7) % cfg["vocab"]
    return x, y


# ---- one run (child process) --------------------------------------------------------------------

def child(args):
    lib = None
    if args.child == "streamsafe":
        import torch
        alloc = torch.cuda.memory.CUDAPluggableAllocator(
            args.torch_lib, "streamsafe_torch_alloc", "streamsafe_torch_free")
        torch.cuda.memory.change_current_allocator(alloc)  # before any CUDA allocation
        lib = ctypes.CDLL(args.torch_lib)  # the same copy of the library
        lib.streamsafe_torch_empty_cache.restype = ctypes.c_size_t
        lib.streamsafe_torch_stats_json.restype = ctypes.c_int
        lib.streamsafe_torch_stats_json.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    else:
        import torch
    if args.child == "preload":
        if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") != "1":
            sys.exit("preload mode needs PYTORCH_NO_CUDA_MEMORY_CACHING=1 (the parent sets it)")
        lib = ctypes.CDLL(args.preload_lib)  # already loaded by LD_PRELOAD: same handle
        lib.streamsafe_preload_stats_json.restype = ctypes.c_int
        lib.streamsafe_preload_stats_json.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        lib.streamsafe_preload_empty_cache.restype = ctypes.c_size_t
        if lib.streamsafe_preload_active() != 1:
            sys.exit("the interposer is not active (STREAMSAFE_PRELOAD=0?)")

    cfg = dict(vocab=args.vocab, block=args.block, n_layer=args.layers, n_head=args.heads,
               n_embd=args.embd, batch=args.batch)
    device = torch.device("cuda", 0)
    if args.deterministic:
        # Same kernels, same order: the runs' losses must then agree to the last bit, which
        # checks that no allocator handed out memory still in use.
        # (warn_only=False: cuDNN attention's backward is non-deterministic unless asked strictly.)
        torch.use_deterministic_algorithms(True, warn_only=False)
    torch.manual_seed(0)
    model = build_model(torch, cfg).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)

    def empty_cache():
        torch.cuda.empty_cache()
        if args.child == "streamsafe":
            lib.streamsafe_torch_empty_cache()
        elif args.child == "preload":
            lib.streamsafe_preload_empty_cache()

    times, empty_ms = [], []
    loss_value = float("nan")
    for step in range(args.warmup + args.steps):
        x, y = batch(torch, cfg, step, device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        signsgd_step(torch, params, args.lr, args.weight_decay)
        model.zero_grad(set_to_none=True)
        before_empty = time.perf_counter()
        empty_cache()  # right after the optimizer step: the race's trigger
        after_empty = time.perf_counter()
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
            empty_ms.append((after_empty - before_empty) * 1e3)
        loss_value = loss.item()
        del loss, x, y

    result = dict(mode=args.child, params=n_params, loss=loss_value,
                  step_ms_median=statistics.median(times), step_ms_mean=statistics.fmean(times),
                  empty_cache_ms_mean=statistics.fmean(empty_ms), steps=len(times))
    buf = ctypes.create_string_buffer(8192)
    if args.child == "pytorch":
        s = torch.cuda.memory_stats(device)
        result.update(peak_reserved=s.get("reserved_bytes.all.peak", 0),
                      peak_allocated=s.get("allocated_bytes.all.peak", 0),
                      device_allocs=s.get("num_device_alloc", -1))
    elif args.child == "streamsafe":
        lib.streamsafe_torch_stats_json(0, buf, len(buf))
        s = json.loads(buf.value.decode())
        result.update(peak_reserved=s["reserved_bytes.all.peak"], peak_allocated=s["allocated_bytes.all.peak"],
                      device_allocs=s["num_device_alloc"], streamsafe=s)
    else:
        lib.streamsafe_preload_stats_json(0, buf, len(buf))
        s = json.loads(buf.value.decode())
        result.update(peak_reserved=s["reserved_bytes_peak"], peak_allocated=s["allocated_bytes_peak"],
                      device_allocs=s["num_device_alloc"], preload=s)
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0 if math.isfinite(loss_value) else 1


# ---- the comparison (parent process) --------------------------------------------------------------

def parent(args):
    torch_lib = args.torch_lib or os.path.join(args.build, "allocator", "libstreamsafe_torch.so")
    preload_lib = args.preload_lib or os.path.join(args.build, "allocator", "libstreamsafe_preload.so")
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--vocab", str(args.vocab),
              "--block", str(args.block), "--layers", str(args.layers), "--heads", str(args.heads),
              "--embd", str(args.embd), "--batch", str(args.batch), "--lr", str(args.lr),
              "--weight-decay", str(args.weight_decay),
              "--torch-lib", os.path.abspath(torch_lib), "--preload-lib", os.path.abspath(preload_lib)]
    if args.deterministic:
        common.append("--deterministic")
    results, ok = [], True
    for mode in args.modes.split(","):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if args.deterministic:
            env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if mode == "preload":
            env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
            env["LD_PRELOAD"] = os.path.abspath(preload_lib)
            env.setdefault("STREAMSAFE_LOG_LEVEL", "info")
        if mode in ("streamsafe", "preload") and not os.path.exists(torch_lib if mode == "streamsafe" else preload_lib):
            print(f"{mode}: library not found ({torch_lib if mode == 'streamsafe' else preload_lib}); build it first")
            ok = False
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode] + common
        print(f"== {mode}: {' '.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        found = None
        for line in proc.stdout.splitlines():
            if line.startswith(RESULT_TAG):
                found = json.loads(line[len(RESULT_TAG):])
            else:
                print(f"   {line}")
        if proc.returncode != 0 or found is None:
            print(f"{mode}: FAILED (exit status {proc.returncode})")
            ok = False
        if found:
            results.append(found)

    if results:
        mib = 1024.0 * 1024.0
        print()
        print(f"GPT, {results[0]['params'] / 1e6:.1f} M parameters, per-parameter SignSGD, "
              f"empty_cache after every step, {args.steps} measured steps")
        print(f"{'allocator':<12} {'step ms (median)':>17} {'step ms (mean)':>15} {'in empty_cache ms':>18} "
              f"{'peak reserved MiB':>18} {'peak allocated MiB':>19} {'reserved/alloc':>15} {'driver allocs':>14} "
              f"{'final loss':>11}")
        for r in results:
            ratio = r["peak_reserved"] / r["peak_allocated"] if r["peak_allocated"] else float("nan")
            print(f"{r['mode']:<12} {r['step_ms_median']:>17.2f} {r['step_ms_mean']:>15.2f} "
                  f"{r['empty_cache_ms_mean']:>18.2f} {r['peak_reserved'] / mib:>18.1f} {r['peak_allocated'] / mib:>19.1f} {ratio:>15.3f} "
                  f"{r['device_allocs']:>14} {r['loss']:>11.4f}")
        losses = {r["loss"] for r in results}
        if args.deterministic and len(results) > 1:
            same = len(losses) == 1
            print(f"final losses {'identical' if same else 'DIFFER'} across allocators "
                  f"(deterministic algorithms){'' if same else ': memory reuse corrupted a run?'}")
            ok = ok and same
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build", help="build directory holding allocator/libstreamsafe_*.so")
    ap.add_argument("--torch-lib", help="path of libstreamsafe_torch.so (default: BUILD/allocator/...)")
    ap.add_argument("--preload-lib", help="path of libstreamsafe_preload.so (default: BUILD/allocator/...)")
    ap.add_argument("--modes", default="pytorch,streamsafe,preload")
    ap.add_argument("--child", choices=["pytorch", "streamsafe", "preload"], help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                    help="deterministic algorithms, so that the losses must agree exactly (default: on)")
    args = ap.parse_args()
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
