#!/usr/bin/env python3
"""Colocated RL on one GPU (docs/colocated_rl.md): a trainer and a generation engine in two
processes take turns on one GPU, each sleeping while the other works.

Trainer: a GPT-2 built from its config (transformers' GPT2LMHeadModel, fp32), a policy-gradient
step on the engine's rollouts, per-parameter SignSGD (default) or AdamW (foreach) on a side stream,
torch.cuda.empty_cache() after the step. Engine: the same architecture (bf16), batched sampling with
a static KV cache, variable prompt and output lengths, its decode step in a CUDA graph, plus a KV
reserve that stands for the KV block pool an engine sizes to its memory share.

Each RL step: the engine generates and sleeps (KV cache discarded; weights discarded or kept:
--engine-weights); the trainer wakes (weights and optimizer state restored from pinned host memory),
trains on the rollout tokens, hands its new weights to the engine (CUDA IPC of its tensors with
torch.multiprocessing.reductions.reduce_tensor; the engine's copy waits on the device for the
trainer's step tail, the host does not), and sleeps (weights and optimizer state offloaded, gradients
and activations discarded); the engine wakes.

Rows, each in fresh processes:
  reference   one process, PyTorch's allocator, nothing sleeps: the tokens and weights every other
              row must reproduce bit for bit, and the footprints that size the budget
  streamsafe  two processes, streamsafe.torch.install("backend:expandable,empty_cache:defer"),
              pause/resume by tag, no torch.cuda.synchronize() in the loop
  field       two processes, PyTorch's allocator, the field's way: synchronize(), .cpu() offload,
              del, empty_cache() at each switch; the engine's KV cache and CUDA graph made again
  control     streamsafe, but from the second step on neither side sleeps: must run out of memory
  unsafe      (--unsafe-release) streamsafe with release_fence:allocation_stream and no wait for the
              engine's copy: the release runs under the step tail; must fault (or be reported by
              compute-sanitizer)

--hybrid runs each row but the reference with the trainer and the engine in one process (the
hybrid engine of verl, OpenRLHF and slime), switching by the same tags; the weights go over by an
in-process copy. --large is a larger model (1.3 B parameters), meant for about 30 GiB a side.

The budget: a ballast (cuMemAlloc outside both allocators) takes the card down to B bytes for the
two allocators together, B = max(trainer, engine footprint) / --target (0.65), so each awake side
holds about 65% of it and both cannot be awake at once. Each process also caps itself at B with
torch.cuda.set_per_process_memory_fraction (--no-cap to skip).

  python3 examples/pytorch/colocated_rl.py --quick          # under a minute on an H200
  python3 examples/pytorch/colocated_rl.py                  # full: about 3 minutes
  python3 examples/pytorch/colocated_rl.py --unsafe-release --rows reference,unsafe
  compute-sanitizer --tool memcheck --target-processes all \\
      python3 examples/pytorch/colocated_rl.py --sanitize

streamsafe must be importable (pip install --no-build-isolation ., or PYTHONPATH=allocator/python
with STREAMSAFE_TORCH_EXT_LIB), and transformers installed.
"""

import os

# Deterministic cuBLAS (bitwise-equal rows need it); set before torch initialises CUDA.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import ctypes  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import queue as queue_mod  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20

PRESETS = {
    # n_layer, n_embd, n_head, vocab, batch, prompt lengths, output lengths, steps, warm-up steps
    "full": dict(n_layer=8, n_embd=1024, n_head=16, vocab=8192, batch=24, prompt=(16, 128),
                 out=(32, 128), steps=10, warmup=2, row_timeout=150),
    "quick": dict(n_layer=4, n_embd=768, n_head=12, vocab=8192, batch=16, prompt=(8, 64),
                  out=(16, 64), steps=4, warmup=1, row_timeout=60),
    # A larger model (1.3 B parameters, meant for about 30 GiB a side): the cost per GiB of a switch
    "large": dict(n_layer=24, n_embd=2048, n_head=16, vocab=32768, batch=16, prompt=(16, 128),
                  out=(32, 128), steps=6, warmup=2, row_timeout=400),
    "sanitize": dict(n_layer=2, n_embd=128, n_head=4, vocab=512, batch=4, prompt=(4, 16),
                     out=(4, 16), steps=2, warmup=0, row_timeout=600),
}
SS_CONF = "backend:expandable,empty_cache:defer"
UNSAFE_CONF = SS_CONF + ",release_fence:allocation_stream"
TRAIN_TAGS = (("train_weights", "offload"), ("train_optim", "offload"), ("train_grads", "discard"))
ENG_TAGS = ("eng_kv", "eng_graph")  # discarded by the engine's sleep (eng_weights: --engine-weights)


class PeerAbort(RuntimeError):
    pass


def log(role, msg):
    print(f"[{role}] {msg}", flush=True)


def ms(t0):
    return (time.perf_counter() - t0) * 1e3


def free_bytes():
    return torch.cuda.mem_get_info()[0]


def h2d(t, dev):
    """A host tensor to the device without a host wait (pinned, non_blocking)."""
    return t.pin_memory().to(dev, non_blocking=True)


def sha(t_cpu):
    return hashlib.sha256(t_cpu.contiguous().numpy().tobytes()).hexdigest()[:16]


# ---- the model: transformers' GPT-2 modules, our own forward ------------------------------------

def gpt2_config(c):
    from transformers import GPT2Config
    return GPT2Config(vocab_size=c["vocab"], n_positions=c["prompt"][1] + c["out"][1],
                      n_embd=c["n_embd"], n_layer=c["n_layer"], n_head=c["n_head"], resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)


def build_gpt2(c):
    from transformers import GPT2LMHeadModel
    m = GPT2LMHeadModel(gpt2_config(c))
    m.eval()  # no dropout (the probabilities are 0 anyway)
    for name in ("transformer.wte", "transformer.wpe", "transformer.ln_f"):
        if not hasattr(m.transformer, name.split(".")[1]):
            raise RuntimeError(f"transformers' GPT2LMHeadModel has no {name}: unexpected version")
    return m


def mlp(blk, x):
    return blk.mlp.c_proj(blk.mlp.act(blk.mlp.c_fc(x)))


def forward_train(model, ids, n_head):
    """Logits [B, L, V] in fp32. The token embedding is a one-hot matmul: its backward is a GEMM
    (deterministic), where the embedding's backward accumulates with atomics."""
    tr = model.transformer
    B, L = ids.shape
    wte = tr.wte.weight
    V, D = wte.shape
    onehot = torch.zeros(B * L, V, device=ids.device, dtype=wte.dtype).scatter_(1, ids.reshape(-1, 1), 1.0)
    x = (onehot @ wte).view(B, L, D) + tr.wpe.weight[:L]
    del onehot
    causal = torch.ones(L, L, dtype=torch.bool, device=ids.device).tril_()
    H, hd = n_head, D // n_head
    for blk in tr.h:
        h = blk.ln_1(x)
        q, k, v = blk.attn.c_attn(h).split(D, dim=2)
        q, k, v = (t.view(B, L, H, hd).transpose(1, 2) for t in (q, k, v))
        s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(hd))
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        x = x + blk.attn.c_proj((p @ v).transpose(1, 2).reshape(B, L, D))
        x = x + mlp(blk, blk.ln_2(x))
    return tr.ln_f(x) @ wte.t()


# ---- the generation engine ----------------------------------------------------------------------

class Engine:
    """Static KV cache [layers, 2, B, H, Lmax, hd] in the engine's dtype, the decode step of all B
    rows in a CUDA graph (positions per row), sampling by Gumbel-max from a seeded generator."""

    def __init__(self, c, dev, tagger, reserve_bytes, use_graph=True):
        self.c, self.dev, self.tag, self.reserve_bytes = c, dev, tagger, int(reserve_bytes)
        self.B, self.H = c["batch"], c["n_head"]
        self.D = c["n_embd"]
        self.hd = self.D // self.H
        self.Lmax = c["prompt"][1] + c["out"][1]
        self.dtype = torch.bfloat16
        self.use_graph = use_graph
        self.graph = None
        self.graph_note = ""
        self.kv = self.reserve = None
        # One warm-up stream for every capture: a new stream per capture would leave a cuBLAS
        # workspace behind for each (PyTorch keeps one per handle and stream).
        self.warm_stream = torch.cuda.Stream(device=dev)
        torch.manual_seed(c["seed"] + 17)  # the engine's init is overwritten by the first hand-over
        m = build_gpt2(c)
        m.requires_grad_(False)  # inference only: no autograd graph in the decode step or its capture
        with self.tag("eng_weights"):
            self.model = m.to(device=dev, dtype=self.dtype)
        self.params = dict(self.model.named_parameters())
        self.ar = torch.arange(self.B, device=dev)
        self.lrange = torch.arange(self.Lmax, device=dev)
        self.tok = torch.zeros(self.B, dtype=torch.long, device=dev)
        self.pos = torch.zeros(self.B, dtype=torch.long, device=dev)
        self.logits = torch.zeros(self.B, c["vocab"], dtype=torch.float32, device=dev)
        self.gen_noise = torch.Generator(device=dev)
        self.gen_noise.manual_seed(c["seed"] + 1)
        self.gen_prompt = torch.Generator(device=dev)
        self.gen_prompt.manual_seed(c["seed"] + 2)
        self.host_tokens = torch.empty(self.B, self.Lmax, dtype=torch.long, pin_memory=True)

    def alloc_cache(self):
        with self.tag("eng_kv"):
            self.kv = torch.zeros(self.c["n_layer"], 2, self.B, self.H, self.Lmax, self.hd,
                                  dtype=self.dtype, device=self.dev)
            # The KV block pool an engine sizes to its share of the memory (vLLM's
            # gpu_memory_utilization); this decode uses only the static cache above.
            self.reserve = (torch.empty(self.reserve_bytes, dtype=torch.uint8, device=self.dev)
                            if self.reserve_bytes > 0 else None)

    def drop_cache(self):
        if self.graph is not None:
            self.graph.reset()
        self.graph = None
        self.kv = self.reserve = None

    def _decode(self):
        tr = self.model.transformer
        B, H, hd, D = self.B, self.H, self.hd, self.D
        x = F.embedding(self.tok, tr.wte.weight) + F.embedding(self.pos, tr.wpe.weight)
        valid = (self.lrange[None, :] <= self.pos[:, None])[:, None, None, :]
        for li, blk in enumerate(tr.h):
            q, k, v = blk.attn.c_attn(blk.ln_1(x)).split(D, dim=1)
            kc, vc = self.kv[li, 0], self.kv[li, 1]
            kc[self.ar, :, self.pos] = k.view(B, H, hd)
            vc[self.ar, :, self.pos] = v.view(B, H, hd)
            s = (q.view(B, H, 1, hd) @ kc.transpose(-1, -2)) * (1.0 / math.sqrt(hd))
            p = torch.softmax(s.float().masked_fill(~valid, float("-inf")), dim=-1).to(self.dtype)
            x = x + blk.attn.c_proj((p @ vc).reshape(B, D))
            x = x + mlp(blk, blk.ln_2(x))
        self.logits.copy_((tr.ln_f(x) @ tr.wte.weight.t()).float())

    def capture(self):
        """The decode step in a CUDA graph (eager with a printed note if the capture fails). Under
        streamsafe the warm-up and the capture run under the tag eng_graph: the graph's private
        pool (its intermediates and the capture stream's cuBLAS workspace) is then the tag's
        memory, which the engine's sleep discards and its wake maps again at the same addresses
        (every buffer in it is written by the graph before it is read)."""
        self.graph = None
        if not self.use_graph:
            self.graph_note = "eager (--no-graph)"
            return
        try:
            with torch.no_grad(), self.tag("eng_graph"):
                s = self.warm_stream
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(2):
                        self._decode()
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    self._decode()
            self.graph = g
            self.graph_note = "CUDA graph"
        except Exception as e:  # noqa: BLE001 - reported, then eager
            self.graph = None
            self.graph_note = f"eager: the capture failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})"

    def _step(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            with torch.no_grad():
                self._decode()

    def _sample(self):
        u = torch.rand(self.B, self.c["vocab"], generator=self.gen_noise, device=self.dev).clamp_(min=1e-12)
        return torch.argmax(self.logits - torch.log(-torch.log(u)), dim=-1)

    def generate(self, step):
        """Rollouts of one step: returns (host tokens [B, Lmax] once `ready` completes, ready event,
        prompt lengths, output lengths). Enqueues everything; the host does not wait."""
        c = self.c
        rng = random.Random(c["seed"] * 7919 + step)
        plen = [rng.randint(*c["prompt"]) for _ in range(self.B)]
        olen = [rng.randint(*c["out"]) for _ in range(self.B)]
        P, O = max(plen), max(olen)
        tr = self.model.transformer
        B, H, hd, D = self.B, self.H, self.hd, self.D
        with self.tag("eng_kv"), torch.no_grad():
            plen_d = h2d(torch.tensor(plen), self.dev)
            end_d = plen_d + h2d(torch.tensor(olen), self.dev)
            seq = torch.zeros(B, self.Lmax, dtype=torch.long, device=self.dev)
            seq[:, :P] = torch.randint(c["vocab"], (B, P), generator=self.gen_prompt, device=self.dev)
            # prefill (eager), K and V into the static cache
            ids = seq[:, :P]
            x = F.embedding(ids, tr.wte.weight) + tr.wpe.weight[:P]
            causal = torch.ones(P, P, dtype=torch.bool, device=self.dev).tril_()
            for li, blk in enumerate(tr.h):
                q, k, v = blk.attn.c_attn(blk.ln_1(x)).split(D, dim=2)
                q, k, v = (t.view(B, P, H, hd).transpose(1, 2) for t in (q, k, v))
                self.kv[li, 0, :, :, :P] = k
                self.kv[li, 1, :, :, :P] = v
                s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(hd))
                p = torch.softmax(s.float().masked_fill(~causal, float("-inf")), dim=-1).to(self.dtype)
                x = x + blk.attn.c_proj((p @ v).transpose(1, 2).reshape(B, P, D))
                x = x + mlp(blk, blk.ln_2(x))
            last = tr.ln_f(x[self.ar, plen_d - 1])
            self.logits.copy_((last @ tr.wte.weight.t()).float())
            nxt = self._sample()
            self.pos.copy_(plen_d)
            seq[self.ar, self.pos] = nxt
            self.tok.copy_(nxt)
            for _ in range(O - 1):
                self._step()  # logits for position pos + 1
                nxt = self._sample()
                self.pos.add_(1)
                seq[self.ar, self.pos] = nxt
                self.tok.copy_(nxt)
            seq.mul_(self.lrange[None, :] < end_d[:, None])
            self.host_tokens.copy_(seq, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return self.host_tokens, ready, plen, olen

    def weights_hash(self):
        h = hashlib.sha256()
        for n in sorted(self.params):
            h.update(self.params[n].detach().float().cpu().numpy().tobytes())
        return h.hexdigest()[:16]


# ---- the trainer --------------------------------------------------------------------------------

class Trainer:
    def __init__(self, c, dev, tagger):
        self.c, self.dev, self.tag = c, dev, tagger
        torch.manual_seed(c["seed"])  # the same initial weights in every row
        m = build_gpt2(c)
        with self.tag("train_weights"):
            self.model = m.to(dev)
        self.named = list(self.model.named_parameters())
        self.params = [p for _, p in self.named]
        self.opt_stream = torch.cuda.Stream()
        self.mom = None
        self.adamw = None
        if c["opt"] == "adamw":
            self.adamw = torch.optim.AdamW(self.params, lr=c["lr"], weight_decay=0.01, foreach=True)

    def train(self, tokens_cpu, plen, olen):
        """One policy-gradient step on the rollouts; the optimizer runs on a side stream and is
        still running when this returns (the tail)."""
        c, dev = self.c, self.dev
        B = len(plen)
        ends = [p + o for p, o in zip(plen, olen)]
        Lt = max(ends)
        toks = tokens_cpu[:, :Lt].contiguous()
        # reward: the share of generated tokens in the lower half of the vocabulary
        r = torch.tensor([float((toks[i, plen[i]:ends[i]] < c["vocab"] // 2).float().mean()) for i in range(B)])
        adv = r - r.mean()
        compute = torch.cuda.current_stream()
        compute.wait_stream(self.opt_stream)  # the previous step's tail (no-op after a resume)
        with self.tag("train_grads"):
            ids = h2d(toks, dev)
            adv_d = h2d(adv, dev)
            p_d, e_d = h2d(torch.tensor(plen), dev), h2d(torch.tensor(ends), dev)
            logits = forward_train(self.model, ids, c["n_head"])
            logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            del logits
            j = torch.arange(1, Lt, device=dev)[None, :]
            mask = ((j >= p_d[:, None]) & (j < e_d[:, None])).float()
            loss = -(logp * mask * adv_d[:, None]).sum() / mask.sum()
            loss.backward()
            del logp, loss
        self.opt_stream.wait_stream(compute)
        with torch.cuda.stream(self.opt_stream), self.tag("train_optim"), torch.no_grad():
            if self.adamw is not None:
                self.adamw.step()
            else:
                if self.mom is None:
                    self.mom = [torch.zeros_like(p) for p in self.params]
                for p, m in zip(self.params, self.mom):
                    if c["tail_sleep_cycles"]:
                        torch.cuda._sleep(c["tail_sleep_cycles"])
                    if p.grad is None:
                        continue
                    m.mul_(0.9).add_(p.grad, alpha=0.1)
                    p.add_(torch.sign(m), alpha=-c["lr"])
        for p in self.params:  # gradients freed while the tail still reads them: recorded
            if p.grad is not None:
                p.grad.record_stream(self.opt_stream)
                p.grad = None

    def move_state(self, device):
        """The field's way: weights and optimizer state to `device` (.cpu() / .to(cuda))."""
        for p in self.params:
            p.data = p.data.to(device)
        if self.mom is not None:
            self.mom = [m.to(device) for m in self.mom]
        if self.adamw is not None:
            for st in self.adamw.state.values():
                for k, v in list(st.items()):
                    if torch.is_tensor(v) and v.dim() > 0:
                        st[k] = v.to(device)

    def weights_hash(self):
        h = hashlib.sha256()
        for n, p in sorted(self.named, key=lambda t: t[0]):
            h.update(p.detach().cpu().numpy().tobytes())
        return h.hexdigest()[:16]


# ---- process set-up -----------------------------------------------------------------------------

def setup_process(row, role, c):
    """Installs streamsafe (rows other than reference and field) and initialises CUDA."""
    sst = None
    if row in ("streamsafe", "control", "unsafe"):
        import streamsafe.torch as sst
        conf = UNSAFE_CONF if row == "unsafe" else SS_CONF
        sst.install(conf + ("," + c["ss_conf"] if c.get("ss_conf") else ""))
        if sst.installed() != "extension":
            raise RuntimeError("streamsafe.torch.install() did not install the extension")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU")
    with contextlib.suppress(Exception):  # CUDA IPC of expandable memory passes descriptors
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    a = torch.ones(64, 64, device=dev)
    (a @ a).sum()  # the context and cuBLAS's handle, before anything is measured
    return sst, dev


def tagger_for(sst):
    if sst is None:
        return lambda name: contextlib.nullcontext()
    return lambda name: sst.tag(name)


def set_cap(c, role):
    if c["cap_bytes"] and not c["no_cap"]:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, c["cap_bytes"] / total), 0)


def alloc_ballast(nbytes):
    """Device memory outside both allocators (the driver's cuMemAlloc in the primary context, the
    one PyTorch uses), so that what is left of the card stands for the budget. Returns a pointer
    (kept until the process exits)."""
    lib = ctypes.CDLL("libcuda.so.1")
    ptr = ctypes.c_uint64(0)
    rc = lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(nbytes)))
    if rc != 0:  # no current context on this thread: make the device's primary context current
        ctx = ctypes.c_void_p(0)
        rc2 = lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ctypes.c_int(torch.cuda.current_device()))
        rc3 = lib.cuCtxSetCurrent(ctx) if rc2 == 0 else rc2
        rc = lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(nbytes))) if rc3 == 0 else rc3
    if rc != 0:
        raise RuntimeError(f"the ballast: cuMemAlloc_v2({nbytes / GiB:.2f} GiB) failed with CUresult {rc}")
    return ptr.value


def recv(q, kinds, role, what, timeout_s, idle=None):
    """The next message of one of `kinds` from q; `idle()` runs between polls."""
    t0 = time.perf_counter()
    while True:
        try:
            msg = q.get(timeout=0.0005 if idle else 0.5)
        except queue_mod.Empty:
            if idle:
                idle()
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"{role}: no {what} ({'/'.join(kinds)}) from the other process in {timeout_s} s")
            continue
        if msg.get("kind") == "abort":
            raise PeerAbort(f"the other process stopped: {msg.get('why')}")
        if msg.get("kind") not in kinds:
            raise RuntimeError(f"{role}: expected {kinds}, got {msg.get('kind')}")
        return msg


def wait_paused(sst, tags, stream, limit_s=90.0, also=None):
    """Polls (never blocks on the device) until every tag is back with the driver and nothing an
    empty_cache() queued is still waiting for its release. stream.query() raises once a fault (an
    illegal address) has poisoned the context, so a fault is reported rather than waited on."""
    t0 = time.perf_counter()
    while True:
        stream.query()
        sts = [sst.tag_status(t) for t in tags]
        if (all(s["phase"] == "paused" for s in sts) and sst.pending_release_bytes() == 0
                and (also is None or also())):
            return ms(t0)
        if time.perf_counter() - t0 > limit_s:
            raise RuntimeError(f"pause of {tags} not finished after {limit_s} s: {sts}")
        time.sleep(0.0002)


def clear_workspaces():
    """Frees PyTorch's cuBLAS (and cuBLASLt) workspaces, one per handle and stream, which it
    otherwise keeps for the life of the process: before a sleep they would stay resident. The
    next matmul allocates its workspace again (under streamsafe: in the tag open then)."""
    fn = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if fn is not None:
        fn()


def ss_breakdown(sst):
    """What the process still holds on the device (streamsafe's segments), MiB by holder."""
    b = sst.memory_breakdown()
    mib = lambda v: round(v / MiB, 1)  # noqa: E731
    out = {f"tag {t}": mib(v["mapped"]) for t, v in sorted(b["tags"].items()) if v["mapped"]}
    for t, v in sorted(b["graph_pools"].items()):
        if v["mapped"]:
            out[f"graph pool {t or '(untagged)'}"] = mib(v["mapped"])
    out["untagged live"] = mib(b["untagged"]["allocated"])
    out["untagged cached"] = mib(b["untagged"]["mapped"] - b["untagged"]["allocated"])
    out["reserved"] = mib(b["reserved"])
    out["queued for release"] = mib(b["pending_release_bytes"])
    out["ipc exports / imports open / closing"] = f"{b['ipc_exports']} / {b['ipc_imports']} / {b['ipc_closing']}"
    return out


def field_breakdown():
    """The same from PyTorch's allocator (torch.cuda.memory_snapshot), MiB by holder."""
    graph = live = cached = 0
    for seg in torch.cuda.memory_snapshot():
        pool = tuple(seg.get("segment_pool_id") or (0, 0))
        if pool != (0, 0):
            graph += seg["total_size"]
        else:
            live += seg["allocated_size"]
            cached += seg["total_size"] - seg["allocated_size"]
    mib = lambda v: round(v / MiB, 1)  # noqa: E731
    return {"graph pools": mib(graph), "untagged live": mib(live), "untagged cached": mib(cached),
            "reserved": mib(torch.cuda.memory_reserved())}


def breakdown(sst):
    try:
        return ss_breakdown(sst) if sst is not None else field_breakdown()
    except Exception as e:  # noqa: BLE001 - a diagnostic: reported, never fatal
        return {"error": describe(e)}


def resume_all(sst, tags):
    for t in tags:
        st = sst.resume(t)
        if st.get("phase") in ("paused", "pausing", "resuming"):
            raise RuntimeError(f"resume({t}) left it {st}")


def engine_sleep(sst, eng, field, discard_w):
    """The engine's sleep call; returns its ms. streamsafe: clear the cuBLAS workspaces (tagged
    eng_kv after the first step, eng_graph for the graph's), pause the engine's tags (the decode
    graph's replays may still be queued: fenced) and empty the untagged cache (fenced and queued,
    defer mode). The field's way: synchronize, drop the cache and graph (and with discard the
    weights), free the workspaces, empty_cache()."""
    t0 = time.perf_counter()
    if sst is not None:
        clear_workspaces()
        for t in list(ENG_TAGS) + (["eng_weights"] if discard_w else []):
            sst.pause(t, mode="discard", wait=False)
        torch.cuda.empty_cache()
    elif field:
        torch.cuda.synchronize()
        eng.drop_cache()
        if discard_w:
            for p in eng.params.values():
                p.shape_full = p.shape
                p.data = torch.empty(0, dtype=eng.dtype, device=eng.dev)
        clear_workspaces()
        torch.cuda.empty_cache()
    return ms(t0)


def engine_weights_back(sst, eng, field):
    """Before a hand-over with --engine-weights discard: the engine's weights mapped again."""
    if sst is not None:
        resume_all(sst, ["eng_weights"])
    elif field:
        for p in eng.params.values():
            if p.data.numel() == 0:
                p.data = torch.empty(p.shape_full, dtype=eng.dtype, device=eng.dev)


def engine_wake(sst, eng, field):
    """The engine's wake; returns its ms. The field's way allocates the cache and captures the
    decode graph again (the addresses changed)."""
    t0 = time.perf_counter()
    if sst is not None:
        resume_all(sst, list(ENG_TAGS))
    elif field:
        eng.alloc_cache()
        eng.capture()
    return ms(t0)


def describe(e):
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:300]}"


def is_oom(e):
    s = str(e).lower()
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in s


# ---- the trainer process ------------------------------------------------------------------------

def trainer_main(c, row, to_trainer, to_engine, results):
    role = f"{row}/trainer"
    out = dict(role="trainer", row=row, steps=[], ok=False)
    try:
        sst, dev = setup_process(row, "trainer", c)
        ss = sst is not None
        field = row == "field"
        tag = tagger_for(sst)
        hello = recv(to_trainer, ("hello",), role, "hello", c["msg_timeout"])
        copy_done = torch.cuda.Event.from_ipc_handle(dev, hello["copy_done"])
        weights_ready = torch.cuda.Event(interprocess=True)
        # Can this build hand tensors over by CUDA IPC? A round trip with a small tensor.
        path, why = c["handover"], ""
        if path in ("auto", "ipc"):
            from torch.multiprocessing.reductions import reduce_tensor
            probe = torch.arange(1024, dtype=torch.float32, device=dev)
            try:
                to_engine.put(dict(kind="probe", t=reduce_tensor(probe)))
                ans = recv(to_trainer, ("probe",), role, "probe answer", c["msg_timeout"])
                ok, why = ans["ok"], ans.get("why", "")
            except PeerAbort:
                raise
            except Exception as e:  # noqa: BLE001 - decides the path
                to_engine.put(dict(kind="probe", t=None))
                recv(to_trainer, ("probe",), role, "probe answer", c["msg_timeout"])
                ok, why = False, f"reduce_tensor: {describe(e)}"
            if not ok and path == "ipc":
                raise RuntimeError(f"--handover ipc: CUDA IPC of tensors does not work here: {why}")
            path = "ipc" if ok else "host"
            del probe
        host_buf = None
        trainer = Trainer(c, dev, tag)
        n_total = sum(p.numel() for p in trainer.params)
        if path == "host":
            host_buf = torch.empty(n_total, dtype=torch.float32).share_memory_()
            log(role, f"weight hand-over: a shared (pageable) host buffer of {n_total * 4 / MiB:.0f} MiB; "
                      f"CUDA IPC of tensors is not available: {why}")
        else:
            log(role, "weight hand-over: CUDA IPC of the trainer's tensors (reduce_tensor)")
        to_engine.put(dict(kind="hello", path=path, why=why, host_buf=host_buf,
                           weights_ready=weights_ready.ipc_handle()))
        set_cap(c, "trainer")
        compute = torch.cuda.current_stream()
        out.update(path=path, path_why=why)

        inbox = dict(released=True, engine_reserved=0)

        def t_recv(kinds, what):
            """The next message of `kinds`; the engine's "released" notes are taken on the way."""
            while True:
                m = recv(to_trainer, tuple(kinds) + ("released",), role, what, c["msg_timeout"])
                if m["kind"] != "released":
                    return m
                inbox["released"] = True
                inbox["engine_reserved"] = m["reserved"]

        def note_released():
            """Never blocks: True once the engine has dropped its imports of our weights."""
            with contextlib.suppress(queue_mod.Empty):
                while not inbox["released"]:
                    m = to_trainer.get_nowait()
                    if m.get("kind") == "abort":
                        raise PeerAbort(f"the other process stopped: {m.get('why')}")
                    if m.get("kind") != "released":
                        raise RuntimeError(f"{role}: unexpected {m.get('kind')} while waiting for released")
                    inbox["released"] = True
                    inbox["engine_reserved"] = m["reserved"]
            return inbox["released"]

        def hand_over():
            """Weights to the engine; returns (enqueue ms, ms until the engine says copied)."""
            t0 = time.perf_counter()
            inbox["released"] = False
            trainer.opt_stream.wait_stream(compute)  # the initial weights were written on compute
            weights_ready.record(trainer.opt_stream)  # after the step's tail
            if path == "ipc":
                from torch.multiprocessing.reductions import reduce_tensor
                items = [(n, reduce_tensor(p.detach())) for n, p in trainer.named]
                to_engine.put(dict(kind="weights", items=items))
            else:
                off = 0
                with torch.cuda.stream(trainer.opt_stream):  # blocking D2H after the tail
                    for _, p in trainer.named:
                        host_buf[off:off + p.numel()].copy_(p.detach().reshape(-1))
                        off += p.numel()
                to_engine.put(dict(kind="weights", items=None))
            call = ms(t0)
            t1 = time.perf_counter()
            copied = t_recv(("copied",), "copied")
            return call, ms(t1), copied.get("grew", 0)

        def sleep(rec, no_sleep=False):
            """Returns once the trainer's memory is back with the driver (rec gets the times)."""
            rec.setdefault("reserved_before", torch.cuda.memory_reserved())
            if no_sleep:
                return
            if ss:
                if row != "unsafe":
                    compute.wait_event(copy_done)  # the fence then covers the engine's copy
                t0 = time.perf_counter()
                clear_workspaces()  # tagged after the first step: the pause takes them
                for t, mode in TRAIN_TAGS:
                    sst.pause(t, mode=mode, wait=False)
                torch.cuda.empty_cache()  # untagged cache, fenced and queued (defer mode)
                rec["pause_ms"] = ms(t0)
                rec["back_ms"] = wait_paused(sst, [t for t, _ in TRAIN_TAGS], trainer.opt_stream,
                                             also=note_released)
            else:
                while not note_released():
                    time.sleep(0.0002)
                t0 = time.perf_counter()
                torch.cuda.synchronize()
                trainer.move_state("cpu")
                clear_workspaces()
                torch.cuda.ipc_collect()
                torch.cuda.empty_cache()
                rec["pause_ms"] = ms(t0)
                rec["back_ms"] = 0.0
            rec["free_after"] = free_bytes()
            rec["reserved_after"] = torch.cuda.memory_reserved()
            if rec["step"] < c["warmup"]:  # not in the measured steps: a snapshot takes time
                out["left"] = dict(step=rec["step"], **breakdown(sst))

        def wake(rec):
            t0 = time.perf_counter()
            if ss:
                resume_all(sst, [t for t, _ in TRAIN_TAGS])
            elif field:
                trainer.move_state(dev)
            rec["resume_ms"] = ms(t0)

        # initial weights to the engine, then sleep
        rec0 = dict(step=-1)
        _, _, rec0["engine_grew"] = hand_over()
        rec0["free_before"] = free_bytes()
        sleep(rec0)
        to_engine.put(dict(kind="asleep", rec=rec0))
        ballast = None
        for s in range(c["steps"]):
            msg = t_recv(("rollout",), f"rollout of step {s}")
            no_sleep = row == "control" and s >= 1
            rec = dict(step=s)
            t_phase = time.perf_counter()
            if not (row == "control" and s >= 2):
                wake(rec)
            t0 = time.perf_counter()
            trainer.train(msg["tokens"], msg["plen"], msg["olen"])
            rec["train_call_ms"] = ms(t0)
            rec["free_before"] = free_bytes()  # while the trainer is awake, before its cache goes back
            rec["reserved_before"] = torch.cuda.memory_reserved()
            rec["peak_reserved"] = torch.cuda.max_memory_reserved()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.empty_cache()
            # engine_grew: what the engine mapped for the weights meanwhile (its wake of
            # eng_weights), which the trainer's reclaimed share does not count against it
            rec["handover_call_ms"], rec["handover_wait_ms"], rec["engine_grew"] = hand_over()
            sleep(rec, no_sleep=no_sleep)
            rec["phase_ms"] = ms(t_phase)
            if s == 0 and c["budget_bytes"] and not c["no_ballast"]:
                # Both sides asleep now: the ballast leaves B for what the two allocators hold.
                while not note_released():
                    time.sleep(0.0002)
                held = torch.cuda.memory_reserved() + inbox["engine_reserved"]
                nbytes = free_bytes() - (c["budget_bytes"] - held)
                if nbytes <= 0:
                    raise RuntimeError(f"the budget {c['budget_bytes'] / GiB:.2f} GiB is less than what both "
                                       f"hold asleep ({held / GiB:.2f} GiB)")
                ballast = alloc_ballast(nbytes)
                rec["ballast_gib"] = nbytes / GiB
                log(role, f"ballast {nbytes / GiB:.2f} GiB: {free_bytes() / GiB:.2f} GiB free for a budget of "
                          f"{c['budget_bytes'] / GiB:.2f} GiB (both asleep hold {held / GiB:.2f} GiB)")
            out["steps"].append(rec)
            log(role, f"step {s}: " + ", ".join(
                f"{k} {v / GiB:.2f} GiB" if k.startswith(("free", "reserved", "peak")) else f"{k} {v:.2f}"
                for k, v in rec.items() if k != "step"))
            to_engine.put(dict(kind="asleep", rec=rec))
        # the trained weights' hash: weights only, back for a moment (fits beside the engine)
        if ss:
            resume_all(sst, ["train_weights"])
        out["weights_hash"] = trainer.weights_hash()
        out["ok"] = True
        del ballast
    except Exception as e:  # noqa: BLE001 - the outcome is the report
        out["error"] = describe(e)
        out["oom"] = is_oom(e)
        out["trace"] = traceback.format_exc()[-2000:]
        with contextlib.suppress(Exception):
            to_engine.put(dict(kind="abort", why=f"trainer: {out['error']}"))
        log(role, f"stopped: {out['error']}")
    results.put(out)
    time.sleep(0.2)


# ---- the engine process -------------------------------------------------------------------------

def engine_main(c, row, to_trainer, to_engine, results):
    role = f"{row}/engine"
    out = dict(role="engine", row=row, steps=[], ok=False, tokens_hash=[])
    try:
        sst, dev = setup_process(row, "engine", c)
        ss = sst is not None
        field = row == "field"
        tag = tagger_for(sst)
        copy_done = torch.cuda.Event(interprocess=True)
        copy_done.record()
        to_trainer.put(dict(kind="hello", copy_done=copy_done.ipc_handle()))
        path = c["handover"]
        if path in ("auto", "ipc"):
            m = recv(to_engine, ("probe",), role, "probe", c["msg_timeout"])
            if m["t"] is not None:
                try:
                    fn, args = m["t"]
                    t = fn(*args)
                    good = torch.equal(t, torch.arange(1024, dtype=torch.float32, device=dev))
                    del t
                    to_trainer.put(dict(kind="probe", ok=bool(good), why="" if good else "wrong contents"))
                except Exception as e:  # noqa: BLE001 - decides the path
                    to_trainer.put(dict(kind="probe", ok=False, why=f"rebuild_cuda_tensor: {describe(e)}"))
            else:
                to_trainer.put(dict(kind="probe", ok=False, why="trainer side"))
        eng = Engine(c, dev, tag, c["reserve_bytes"] if row != "reference" else 0, use_graph=not c["no_graph"])
        eng.alloc_cache()
        eng.capture()
        torch.cuda.empty_cache()
        log(role, f"decode step: {eng.graph_note}")
        out["graph"] = eng.graph_note
        hello = recv(to_engine, ("hello",), role, "hello", c["msg_timeout"])
        path, host_buf = hello["path"], hello["host_buf"]
        weights_ready = torch.cuda.Event.from_ipc_handle(dev, hello["weights_ready"])
        set_cap(c, "engine")
        cur = torch.cuda.current_stream()
        discard_w = c["engine_weights"] == "discard"
        held = dict(items=None)

        def release_imports():
            if held["items"] is not None and copy_done.query():
                held["items"] = None
                if ss:
                    # The imports' mappings close once their release events completed (the copy
                    # is done): now, rather than at the next allocator call that polls, so that
                    # the trainer's paused weights are not kept alive by this process.
                    sst.reclaim()
                to_trainer.put(dict(kind="released", reserved=torch.cuda.memory_reserved()))

        def take_weights(rec):
            msg = recv(to_engine, ("weights",), role, "weights", c["msg_timeout"])
            t0 = time.perf_counter()
            reserved0 = torch.cuda.memory_reserved()
            if discard_w:
                engine_weights_back(sst, eng, field)
            cur.wait_event(weights_ready)  # the trainer's step tail, on the device
            with torch.no_grad():
                if path == "ipc":
                    srcs = []
                    for name, (fn, args) in msg["items"]:
                        src = fn(*args)
                        eng.params[name].copy_(src)
                        srcs.append(src)
                    held["items"] = srcs
                else:
                    off = 0  # the trainer's named_parameters() order: the same module tree
                    for p in eng.params.values():
                        p.copy_(host_buf[off:off + p.numel()].view(p.shape))
                        off += p.numel()
                    held["items"] = []
            copy_done.record(cur)
            rec["handover_ms"] = ms(t0)
            grew = torch.cuda.memory_reserved() - reserved0
            if field:
                torch.cuda.synchronize()  # the field's way before the trainer may offload
                held["items"] = None
                to_trainer.put(dict(kind="copied", grew=grew))
                to_trainer.put(dict(kind="released", reserved=torch.cuda.memory_reserved()))
            else:
                to_trainer.put(dict(kind="copied", grew=grew))

        def sleep(rec, no_sleep=False):
            rec["reserved_before"] = torch.cuda.memory_reserved()
            rec["free_before"] = free_bytes()
            if no_sleep:
                return
            rec["pause_ms"] = engine_sleep(sst, eng, field, discard_w)

        def wait_back(rec):
            if ss:
                tags = list(ENG_TAGS) + (["eng_weights"] if discard_w else [])
                rec["back_ms"] = wait_paused(sst, tags, cur)
            else:
                rec["back_ms"] = 0.0
            rec["free_after"] = free_bytes()
            rec["reserved_after"] = torch.cuda.memory_reserved()
            if rec["step"] < c["warmup"]:  # not in the measured steps: a snapshot takes time
                out["left"] = dict(step=rec["step"], **breakdown(sst))

        def wake(rec):
            rec["resume_ms"] = engine_wake(sst, eng, field)

        # the initial weights, then wait for the trainer to sleep
        rec0 = dict(step=-1)
        if discard_w and ss:
            sst.pause("eng_weights", mode="discard", wait=False)  # take_weights resumes it
            wait_paused(sst, ["eng_weights"], cur)
        take_weights(rec0)
        recv(to_engine, ("asleep",), role, "trainer asleep", c["msg_timeout"], idle=release_imports)
        release_imports()
        t_step = time.perf_counter()
        for s in range(c["steps"]):
            no_sleep = row == "control" and s >= 1
            rec = dict(step=s)
            t0 = time.perf_counter()
            host_tokens, ready, plen, olen = eng.generate(s)
            rec["gen_call_ms"] = ms(t0)
            sleep(rec, no_sleep)  # the replays may still run: the fence covers them
            t1 = time.perf_counter()
            ready.synchronize()  # the rollouts themselves (host tokens) are the end of generation
            rec["gen_wait_ms"] = ms(t1)
            tokens = host_tokens.clone()
            out["tokens_hash"].append(sha(tokens))
            if not no_sleep:
                wait_back(rec)
            to_trainer.put(dict(kind="rollout", tokens=tokens, plen=plen, olen=olen))
            take_weights(rec)
            t2 = time.perf_counter()
            arec = recv(to_engine, ("asleep",), role, "trainer asleep", c["msg_timeout"], idle=release_imports)["rec"]
            release_imports()
            rec["wait_trainer_ms"] = ms(t2)
            if not no_sleep:
                wake(rec)
            now = time.perf_counter()
            rec["step_ms"] = (now - t_step) * 1e3
            t_step = now
            rec["trainer"] = arec
            out["steps"].append(rec)
            log(role, f"step {s}: step {rec['step_ms']:.1f} ms, gen {rec['gen_call_ms'] + rec['gen_wait_ms']:.1f} ms, "
                      f"pause {rec.get('pause_ms', 0):.2f} ms, back {rec.get('back_ms', 0):.2f} ms, "
                      f"resume {rec.get('resume_ms', 0):.2f} ms, hand-over {rec['handover_ms']:.2f} ms, "
                      f"free {rec['free_before'] / GiB:.2f} -> {rec.get('free_after', 0) / GiB:.2f} GiB, "
                      f"tokens {out['tokens_hash'][-1]}")
        out["weights_hash"] = eng.weights_hash()
        out["ok"] = True
    except Exception as e:  # noqa: BLE001 - the outcome is the report
        out["error"] = describe(e)
        out["oom"] = is_oom(e)
        out["trace"] = traceback.format_exc()[-2000:]
        with contextlib.suppress(Exception):
            to_trainer.put(dict(kind="abort", why=f"engine: {out['error']}"))
        log(role, f"stopped: {out['error']}")
    results.put(out)
    time.sleep(0.2)


# ---- the hybrid engine: trainer and engine in one process ---------------------------------------

def hybrid_main(c, row, results):
    """--hybrid: the trainer and the engine in one process (the hybrid engine of verl, OpenRLHF and
    slime), switching by tags. The engine's sleep pauses its tags and empties the cache that the
    trainer's last step left untagged; the trainer's wake resumes its tags; the weights go over by
    an in-process copy on the compute stream after the optimizer's tail. The field row does the
    same with PyTorch's allocator: synchronize(), .cpu(), empty_cache(). One record per side, in
    the two-process rows' form."""
    role = f"{row}/hybrid"
    eout = dict(role="engine", row=row, steps=[], ok=False, tokens_hash=[])
    tout = dict(role="trainer", row=row, steps=[], ok=False, path="in-process")
    try:
        sst, dev = setup_process(row, "hybrid", c)
        ss = sst is not None
        field = row == "field"
        tag = tagger_for(sst)
        eng = Engine(c, dev, tag, c["reserve_bytes"], use_graph=not c["no_graph"])
        eng.alloc_cache()
        eng.capture()
        torch.cuda.empty_cache()
        log(role, f"decode step: {eng.graph_note}")
        eout["graph"] = eng.graph_note
        trainer = Trainer(c, dev, tag)
        set_cap(c, "hybrid")
        cur = torch.cuda.current_stream()
        discard_w = c["engine_weights"] == "discard"
        e_tags = list(ENG_TAGS) + (["eng_weights"] if discard_w else [])
        t_tags = [t for t, _ in TRAIN_TAGS]

        def hand_over(rec):
            """The engine's weights from the trainer's, after the step's tail; returns what the
            engine mapped for them."""
            t0 = time.perf_counter()
            reserved0 = torch.cuda.memory_reserved()
            if discard_w:
                engine_weights_back(sst, eng, field)
            cur.wait_stream(trainer.opt_stream)
            with torch.no_grad():
                for n, p in trainer.named:
                    eng.params[n].copy_(p)
            rec["handover_ms"] = ms(t0)
            return torch.cuda.memory_reserved() - reserved0

        def t_sleep(trec):
            trec.setdefault("reserved_before", torch.cuda.memory_reserved())
            t0 = time.perf_counter()
            if ss:
                clear_workspaces()
                for t, mode in TRAIN_TAGS:
                    sst.pause(t, mode=mode, wait=False)
                torch.cuda.empty_cache()
                trec["pause_ms"] = ms(t0)
                trec["back_ms"] = wait_paused(sst, t_tags, cur)
            else:
                torch.cuda.synchronize()
                trainer.move_state("cpu")
                clear_workspaces()
                torch.cuda.empty_cache()
                trec["pause_ms"] = ms(t0)
                trec["back_ms"] = 0.0
            trec["free_after"] = free_bytes()
            trec["reserved_after"] = torch.cuda.memory_reserved()
            if trec["step"] < c["warmup"]:
                tout["left"] = dict(step=trec["step"], **breakdown(sst))

        def t_wake(trec):
            t0 = time.perf_counter()
            if ss:
                resume_all(sst, t_tags)
            elif field:
                trainer.move_state(dev)
            trec["resume_ms"] = ms(t0)

        def e_sleep(rec):
            rec["reserved_before"] = torch.cuda.memory_reserved()
            rec["free_before"] = free_bytes()
            rec["pause_ms"] = engine_sleep(sst, eng, field, discard_w)  # the trainer's cache too

        def e_wait_back(rec):
            rec["back_ms"] = wait_paused(sst, e_tags, cur) if ss else 0.0
            rec["free_after"] = free_bytes()
            rec["reserved_after"] = torch.cuda.memory_reserved()
            if rec["step"] < c["warmup"]:
                eout["left"] = dict(step=rec["step"], **breakdown(sst))

        def e_wake(rec):
            rec["resume_ms"] = engine_wake(sst, eng, field)

        # the initial weights, then the trainer sleeps
        if discard_w and ss:
            sst.pause("eng_weights", mode="discard", wait=False)  # hand_over resumes it
            wait_paused(sst, ["eng_weights"], cur)
        trec0 = dict(step=-1)
        trec0["engine_grew"] = hand_over(dict())
        t_sleep(trec0)
        ballast = None
        t_step = time.perf_counter()
        for s in range(c["steps"]):
            no_sleep = row == "control" and s >= 1
            rec, trec = dict(step=s), dict(step=s)
            t0 = time.perf_counter()
            host_tokens, ready, plen, olen = eng.generate(s)
            rec["gen_call_ms"] = ms(t0)
            if no_sleep:
                rec["reserved_before"] = torch.cuda.memory_reserved()
                rec["free_before"] = free_bytes()
            else:
                e_sleep(rec)  # the replays may still run: the fence covers them
            t1 = time.perf_counter()
            ready.synchronize()
            rec["gen_wait_ms"] = ms(t1)
            tokens = host_tokens.clone()
            eout["tokens_hash"].append(sha(tokens))
            if not no_sleep:
                e_wait_back(rec)
            t_phase = time.perf_counter()
            if not (row == "control" and s >= 2):
                t_wake(trec)
            t0 = time.perf_counter()
            trainer.train(tokens, plen, olen)
            trec["train_call_ms"] = ms(t0)
            trec["free_before"] = free_bytes()
            trec["reserved_before"] = torch.cuda.memory_reserved()
            torch.cuda.empty_cache()
            trec["engine_grew"] = hand_over(rec)
            trec["handover_call_ms"], trec["handover_wait_ms"] = rec["handover_ms"], 0.0
            if not no_sleep:
                t_sleep(trec)
            trec["phase_ms"] = ms(t_phase)
            if s == 0 and c["budget_bytes"] and not c["no_ballast"]:
                # Both sides asleep: the ballast leaves B for what the process holds.
                held = torch.cuda.memory_reserved()
                nbytes = free_bytes() - (c["budget_bytes"] - held)
                if nbytes <= 0:
                    raise RuntimeError(f"the budget {c['budget_bytes'] / GiB:.2f} GiB is less than what both "
                                       f"sides hold asleep ({held / GiB:.2f} GiB)")
                ballast = alloc_ballast(nbytes)
                log(role, f"ballast {nbytes / GiB:.2f} GiB: {free_bytes() / GiB:.2f} GiB free for a budget of "
                          f"{c['budget_bytes'] / GiB:.2f} GiB (both asleep hold {held / GiB:.2f} GiB)")
            if not no_sleep:
                e_wake(rec)
            now = time.perf_counter()
            rec["step_ms"] = (now - t_step) * 1e3
            t_step = now
            rec["trainer"] = trec
            eout["steps"].append(rec)
            tout["steps"].append(trec)
            log(role, f"step {s}: step {rec['step_ms']:.1f} ms, engine pause {rec.get('pause_ms', 0):.2f} / back "
                      f"{rec.get('back_ms', 0):.2f} / resume {rec.get('resume_ms', 0):.2f} ms, trainer pause "
                      f"{trec.get('pause_ms', 0):.2f} / back {trec.get('back_ms', 0):.2f} / resume "
                      f"{trec.get('resume_ms', 0):.2f} ms, tokens {eout['tokens_hash'][-1]}")
        if ss:
            resume_all(sst, ["train_weights"])
        elif field:
            trainer.move_state(dev)
        tout["weights_hash"] = trainer.weights_hash()
        eout["weights_hash"] = eng.weights_hash()
        eout["ok"] = tout["ok"] = True
        del ballast
    except Exception as e:  # noqa: BLE001 - the outcome is the report
        eout["error"] = describe(e)
        eout["oom"] = is_oom(e)
        eout["trace"] = traceback.format_exc()[-2000:]
        log(role, f"stopped: {eout['error']}")
    results.put(eout)
    results.put(tout)
    time.sleep(0.2)


# ---- the reference: one process, nothing sleeps -------------------------------------------------

def reference_main(c, results):
    role = "reference"
    out = dict(role="reference", row="reference", steps=[], ok=False, tokens_hash=[])
    try:
        _, dev = setup_process("reference", role, c)
        null = tagger_for(None)
        eng = Engine(c, dev, null, 0, use_graph=not c["no_graph"])
        eng.alloc_cache()
        eng.capture()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        e_static = torch.cuda.memory_reserved()
        trainer = Trainer(c, dev, null)
        with torch.no_grad():
            for n, p in trainer.named:
                eng.params[n].copy_(p)
        t_fp = e_fp = 0
        for s in range(c["steps"]):
            rec = dict(step=s)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            host_tokens, ready, plen, olen = eng.generate(s)
            ready.synchronize()
            rec["gen_ms"] = ms(t0)
            e_fp = max(e_fp, torch.cuda.max_memory_reserved() - (before - e_static))
            tokens = host_tokens.clone()
            out["tokens_hash"].append(sha(tokens))
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            t1 = time.perf_counter()
            trainer.train(tokens, plen, olen)
            torch.cuda.empty_cache()
            torch.cuda.current_stream().wait_stream(trainer.opt_stream)
            with torch.no_grad():
                for n, p in trainer.named:
                    eng.params[n].copy_(p)
            torch.cuda.synchronize()
            rec["train_ms"] = ms(t1)
            t_fp = max(t_fp, torch.cuda.max_memory_reserved() - e_static)
            rec["step_ms"] = rec["gen_ms"] + rec["train_ms"]
            out["steps"].append(rec)
            log(role, f"step {s}: gen {rec['gen_ms']:.1f} ms, train + copy {rec['train_ms']:.1f} ms, "
                      f"tokens {out['tokens_hash'][-1]}")
        out["trainer_footprint"] = t_fp
        out["engine_footprint"] = e_fp
        out["weights_hash"] = trainer.weights_hash()
        out["engine_weights_hash"] = eng.weights_hash()
        out["graph"] = eng.graph_note
        out["ok"] = True
        log(role, f"footprints: trainer {t_fp / GiB:.2f} GiB, engine {e_fp / GiB:.2f} GiB "
                  f"(without its KV reserve); decode step: {eng.graph_note}")
    except Exception as e:  # noqa: BLE001
        out["error"] = describe(e)
        out["trace"] = traceback.format_exc()[-2000:]
        log(role, f"stopped: {out['error']}")
    results.put(out)


# ---- the parent: rows, sizing, report -----------------------------------------------------------

def run_procs(targets, n_results, timeout_s):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    qs = [ctx.Queue(), ctx.Queue()]
    procs = [ctx.Process(target=f, args=a(qs, results)) for f, a in targets]
    for p in procs:
        p.start()
    got, t0 = [], time.perf_counter()
    while len(got) < n_results:
        try:
            got.append(results.get(timeout=0.5))
            continue
        except queue_mod.Empty:
            pass
        if all(not p.is_alive() for p in procs):
            with contextlib.suppress(queue_mod.Empty):
                while True:
                    got.append(results.get(timeout=1.0))
            break
        if time.perf_counter() - t0 > timeout_s:
            got.append(dict(role="parent", ok=False, error=f"row timed out after {timeout_s} s"))
            break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
    codes = [p.exitcode for p in procs]
    return got, codes


def med(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else float("nan")


def summarize(row, res, codes, c, ref):
    by = {r.get("role"): r for r in res}
    eng, tr = by.get("engine", {}), by.get("trainer", {})
    errors = [f"{r.get('role')}: {r['error']}" for r in res if r.get("error")]
    missing = [role for role in ("engine", "trainer") if role not in by]
    if missing:
        errors.append(f"no result from {', '.join(missing)} (exit codes {codes}: a crash, such as an illegal "
                      f"memory access that kills the process)")
    s = dict(row=row, errors=errors, exit_codes=codes, path=tr.get("path"), graph=eng.get("graph"))
    steps = [st for st in eng.get("steps", []) if st["step"] >= c["warmup"]]
    if steps:
        def m(f):
            vals = []
            for st in steps:
                try:
                    vals.append(f(st))
                except (KeyError, TypeError, ZeroDivisionError):
                    vals.append(None)
            return med(vals)
        fp_t = lambda st: st["trainer"].get("reserved_before") or float("nan")  # noqa: E731
        fp_e = lambda st: st.get("reserved_before") or float("nan")  # noqa: E731
        s.update(
            step_ms=m(lambda st: st["step_ms"]),
            e_pause_ms=m(lambda st: st.get("pause_ms")), e_back_ms=m(lambda st: st.get("back_ms")),
            e_resume_ms=m(lambda st: st.get("resume_ms")),
            t_pause_ms=m(lambda st: st["trainer"].get("pause_ms")),
            t_back_ms=m(lambda st: st["trainer"].get("back_ms")),
            t_resume_ms=m(lambda st: st["trainer"].get("resume_ms")),
            handover_ms=m(lambda st: st["handover_ms"] + st["trainer"].get("handover_wait_ms", 0)),
            free_gen_gib=m(lambda st: st["free_before"] / GiB),
            free_train_gib=m(lambda st: st["trainer"]["free_before"] / GiB),
            e_footprint_gib=m(lambda st: fp_e(st) / GiB), t_footprint_gib=m(lambda st: fp_t(st) / GiB),
            e_reclaimed=m(lambda st: (st["free_after"] - st["free_before"]) / fp_e(st) if "free_after" in st else None),
            # The engine maps its weights again during the trainer's sleep (the hand-over): that
            # growth is the engine's, added back to the trainer's gain.
            t_reclaimed=m(lambda st: (st["trainer"]["free_after"] - st["trainer"]["free_before"]
                                      + st["trainer"].get("engine_grew", 0)) / fp_t(st)
                          if "free_after" in st["trainer"] else None),
        )
        s["switch_ms"] = sum(s[k] for k in ("e_pause_ms", "e_back_ms", "e_resume_ms", "t_pause_ms", "t_back_ms",
                                           "t_resume_ms"))
        s["switch_share"] = s["switch_ms"] / s["step_ms"]
    if ref and ref.get("ok") and eng.get("tokens_hash"):
        n = len(eng["tokens_hash"])
        s["tokens_equal"] = eng["tokens_hash"] == ref["tokens_hash"][:n] and n == len(ref["tokens_hash"])
        s["weights_equal"] = tr.get("weights_hash") == ref["weights_hash"]
        s["engine_weights_equal"] = eng.get("weights_hash") == ref.get("engine_weights_hash")
    s["left"] = {role: by[role].get("left") for role in ("trainer", "engine") if by.get(role, {}).get("left")}
    s["oom"] = any(r.get("oom") for r in res)
    s["ok"] = not errors and bool(eng.get("ok")) and bool(tr.get("ok"))
    s["raw"] = res
    return s


def outcome(s):
    if s["row"] == "control":
        if s["oom"]:
            return "out of memory, as expected"
        return "UNEXPECTED: " + ("; ".join(s["errors"]) if s["errors"] else "fit in the budget without sleeping")
    if s["row"] == "unsafe":
        txt = "; ".join(s["errors"]).lower()
        if "illegal" in txt or "no result" in txt or s["errors"]:
            return "faulted, as expected: " + "; ".join(s["errors"])[:200]
        return "UNEXPECTED: no fault (run it under compute-sanitizer: --sanitize)"
    if s["errors"]:
        return "FAILED: " + "; ".join(s["errors"])[:300]
    if s.get("tokens_equal") is False or s.get("weights_equal") is False:
        return "ran, but NOT identical to the reference"
    return "ok"


def fmt(v, spec=".2f"):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def report(c, ref, rows):
    print()
    form = "one process (--hybrid)" if c.get("hybrid") else "two processes"
    print(f"## Colocated RL, {c['preset']} preset, {form}: {c['n_layer']} layers x {c['n_embd']}, vocab {c['vocab']}, "
          f"batch {c['batch']}, prompts {c['prompt'][0]}-{c['prompt'][1]}, outputs {c['out'][0]}-{c['out'][1]} "
          f"tokens, {c['opt']}, engine weights {c['engine_weights']}; {c['steps']} steps, medians of steps "
          f"{c['warmup']}..{c['steps'] - 1}")
    if ref and ref.get("ok"):
        print(f"reference (one process, nothing sleeps): step {med([st['step_ms'] for st in ref['steps'][c['warmup']:]]):.1f} ms; "
              f"footprints: trainer {ref['trainer_footprint'] / GiB:.2f} GiB, engine {ref['engine_footprint'] / GiB:.2f} GiB "
              f"+ KV reserve {c['reserve_bytes'] / GiB:.2f} GiB; budget {c['budget_bytes'] / GiB:.2f} GiB "
              f"(target {c['target']:.0%} each)")
    field = next((s for s in rows if s["row"] == "field" and s.get("step_ms")), None)
    print()
    print("| row | outcome | hand-over | decode | RL step ms | vs field | switches ms | share of step | "
          "pause call ms (trainer / engine) | memory back after ms (t / e) | resume ms (t / e) | "
          "reclaimed (t / e) | GiB free while generating / training | tokens = reference | "
          "weights = reference (trainer / engine) |")
    print("| --- " * 15 + "|")
    for s in rows:
        vs = (s["step_ms"] / field["step_ms"]) if (field and s.get("step_ms")) else None
        eq = lambda k: "-" if s.get(k) is None else ("yes" if s[k] else "NO")  # noqa: E731
        print(f"| {s['row']} | {outcome(s)} | {s.get('path') or '-'} | {(s.get('graph') or '-')[:40]} | "
              f"{fmt(s.get('step_ms'), '.1f')} | {fmt(vs, '.2f')}x | {fmt(s.get('switch_ms'), '.1f')} | "
              f"{fmt(s.get('switch_share', float('nan')) * 100 if s.get('switch_share') is not None else None, '.1f')}% | "
              f"{fmt(s.get('t_pause_ms'))} / {fmt(s.get('e_pause_ms'))} | {fmt(s.get('t_back_ms'))} / {fmt(s.get('e_back_ms'))} | "
              f"{fmt(s.get('t_resume_ms'))} / {fmt(s.get('e_resume_ms'))} | "
              f"{fmt(s.get('t_reclaimed', float('nan')) * 100 if s.get('t_reclaimed') is not None else None, '.1f')}% / "
              f"{fmt(s.get('e_reclaimed', float('nan')) * 100 if s.get('e_reclaimed') is not None else None, '.1f')}% | "
              f"{fmt(s.get('free_gen_gib'))} / {fmt(s.get('free_train_gib'))} | {eq('tokens_equal')} | "
              f"{eq('weights_equal')} / {eq('engine_weights_equal')} |")
    print()
    for s in rows:
        for e in s["errors"]:
            print(f"  {s['row']}: {e}")
        if s["row"] in ("streamsafe", "field") and s.get("step_ms"):
            print(f"  {s['row']}: awake footprints trainer {fmt(s['t_footprint_gib'])} GiB, engine "
                  f"{fmt(s['e_footprint_gib'])} GiB; hand-over {fmt(s['handover_ms'])} ms")
        for role, left in (s.get("left") or {}).items():
            left = dict(left)
            step = left.pop("step", "?")
            print(f"  {s['row']}: {role} still holds after its pause (step {step}, MiB): "
                  + ", ".join(f"{k} {v}" for k, v in left.items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small model, 4 steps: under a minute")
    ap.add_argument("--large", action="store_true", help="a 1.3 B-parameter model, meant for about 30 GiB a side")
    ap.add_argument("--sanitize", action="store_true",
                    help="a tiny model, 2 steps, rows reference,streamsafe, no ballast or cap: run it under "
                         "compute-sanitizer --tool memcheck --target-processes all")
    ap.add_argument("--unsafe-release", action="store_true",
                    help="add the unsafe row: release_fence:allocation_stream, no wait for the engine's copy")
    ap.add_argument("--rows", help="comma list of reference,streamsafe,field,control,unsafe")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--opt", choices=("signsgd", "adamw"), default="signsgd")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--engine-weights", choices=("discard", "keep"), default="discard",
                    help="what the engine's sleep does with its weights (the hand-over rewrites them anyway)")
    ap.add_argument("--handover", choices=("auto", "ipc", "host"), default="auto",
                    help="auto: CUDA IPC of tensors when this build supports it, else a shared host buffer")
    ap.add_argument("--target", type=float, default=0.65, help="each awake side's share of the budget")
    ap.add_argument("--budget-gib", type=float, help="the budget (default: from the reference's footprints)")
    ap.add_argument("--no-ballast", action="store_true")
    ap.add_argument("--no-cap", action="store_true", help="no set_per_process_memory_fraction")
    ap.add_argument("--no-graph", action="store_true", help="decode eagerly")
    ap.add_argument("--tail-sleep-cycles", type=int, help="torch.cuda._sleep per parameter in the SignSGD tail")
    ap.add_argument("--ss-conf", default="",
                    help="options added to streamsafe's configuration, e.g. expandable_chunk_mb:128 "
                         "(fewer, larger driver mappings for pause and resume to give back and map)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--msg-timeout", type=float, default=90.0)
    ap.add_argument("--row-timeout", type=float)
    ap.add_argument("--json", help="write every row's records here")
    ap.add_argument("--hybrid", action="store_true",
                    help="trainer and engine in one process, switching by tags (the hybrid engine)")
    args = ap.parse_args()

    preset = "sanitize" if args.sanitize else ("quick" if args.quick else ("large" if args.large else "full"))
    c = dict(PRESETS[preset])
    c.update(preset=preset, seed=args.seed, ss_conf=args.ss_conf, opt=args.opt, lr=args.lr,
             engine_weights=args.engine_weights,
             handover=args.handover, target=args.target, no_ballast=args.no_ballast or args.sanitize,
             no_cap=args.no_cap or args.sanitize, no_graph=args.no_graph, msg_timeout=args.msg_timeout,
             budget_bytes=0, reserve_bytes=0, cap_bytes=0, hybrid=args.hybrid)
    if args.steps is not None:
        c["steps"] = args.steps
    if args.warmup is not None:
        c["warmup"] = args.warmup
    if args.row_timeout is not None:
        c["row_timeout"] = args.row_timeout
    if c["warmup"] >= c["steps"]:
        c["warmup"] = max(0, c["steps"] - 1)
    default_rows = ["reference", "streamsafe"] if args.sanitize else ["reference", "streamsafe", "field", "control"]
    rows = args.rows.split(",") if args.rows else default_rows
    if args.unsafe_release and "unsafe" not in rows:
        rows.append("unsafe")
    bad = [r for r in rows if r not in ("reference", "streamsafe", "field", "control", "unsafe")]
    if bad:
        ap.error(f"unknown rows {bad}")
    if rows[0] != "reference" and not args.budget_gib:
        ap.error("the reference row comes first (it sizes the budget), or give --budget-gib")
    base_tail = args.tail_sleep_cycles if args.tail_sleep_cycles is not None else 0
    if args.budget_gib:
        c["budget_bytes"] = c["cap_bytes"] = int(args.budget_gib * GiB)
    t_all = time.perf_counter()
    print(f"colocated_rl: preset {preset}{' (hybrid: one process)' if args.hybrid else ''}, rows {','.join(rows)}; "
          f"torch {torch.__version__}", flush=True)

    ref = None
    summaries = []
    raw = {}
    for row in rows:
        cr = dict(c)
        cr["tail_sleep_cycles"] = base_tail if row != "unsafe" or args.tail_sleep_cycles is not None else 2_000_000
        t0 = time.perf_counter()
        if row == "reference":
            res, codes = run_procs([(reference_main, lambda qs, r: (cr, r))], 1, cr["row_timeout"])
            ref = next((r for r in res if r.get("role") == "reference"), None)
            raw[row] = res
            if not ref or not ref.get("ok"):
                print(f"reference row FAILED (exit {codes}): {ref.get('error') if ref else 'no result'}\n"
                      f"{(ref or {}).get('trace', '')}", flush=True)
                sys.exit(2)
            big = max(ref["trainer_footprint"], ref["engine_footprint"])
            budget = int(args.budget_gib * GiB) if args.budget_gib else int(big / c["target"])
            c["budget_bytes"] = budget
            c["reserve_bytes"] = max(0, int(c["target"] * budget) - ref["engine_footprint"])
            c["cap_bytes"] = budget
            t_share = ref["trainer_footprint"] / budget
            e_share = (ref["engine_footprint"] + c["reserve_bytes"]) / budget
            print(f"budget {budget / GiB:.2f} GiB: trainer awake {t_share:.0%}, engine awake {e_share:.0%} of it "
                  f"(reference row {time.perf_counter() - t0:.1f} s)", flush=True)
            if t_share + e_share <= 1.05:
                print(f"WARNING: trainer and engine together need {t_share + e_share:.0%} of the budget: the control "
                      f"may fit; lower --budget-gib", flush=True)
            continue
        if args.hybrid:
            res, codes = run_procs([(hybrid_main, lambda qs, r, row=row: (cr, row, r))], 2, cr["row_timeout"])
        else:
            res, codes = run_procs([(trainer_main, lambda qs, r, row=row: (cr, row, qs[0], qs[1], r)),
                                    (engine_main, lambda qs, r, row=row: (cr, row, qs[0], qs[1], r))],
                                   2, cr["row_timeout"])
        raw[row] = res
        s = summarize(row, res, codes, c, ref)
        summaries.append(s)
        print(f"row {row}: {outcome(s)} ({time.perf_counter() - t0:.1f} s)", flush=True)
        if s["errors"] and row in ("streamsafe", "field"):
            for r in res:
                if r.get("trace"):
                    print(f"--- {row}/{r.get('role')} traceback:\n{r['trace']}", flush=True)
    report(c, ref, summaries)
    print(f"\ntotal {time.perf_counter() - t_all:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=c, reference=ref, rows=[{k: v for k, v in s.items()} for s in summaries]),
                      f, indent=1, default=str)
    # exit status: 0 when every row came out as it must
    failed = [s["row"] for s in summaries if outcome(s).startswith(("FAILED", "UNEXPECTED", "ran, but"))]
    if failed:
        print(f"rows not as expected: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
