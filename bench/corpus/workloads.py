#!/usr/bin/env python3
"""PyTorch workloads whose CUDA allocation traces make streamsafe's replay corpus.

    python3 workloads.py --list
    python3 workloads.py NAME --out DIR --tag default|expandable

One workload per process: the memory history is switched on before the first CUDA allocation,
the workload runs (seeded: both captures of a workload make the same requests), then
DIR/NAME.TAG.pickle gets torch.cuda.memory._snapshot() and DIR/NAME.TAG.json PyTorch's own
peaks (max_memory_reserved, max_memory_allocated, the requested peak). The allocator settings
come from PYTORCH_CUDA_ALLOC_CONF, which capture.sh sets; TAG only names the files.

Every model is built here from plain torch modules (the Llama and GPT-2 ones from transformers
configs; no weights, no network). Sizes are chosen to run in seconds on an H200 and to give traces
of tens of thousands of events; shapes vary per step from a seeded generator.

A workload may declare its split of the corpus (`split="held-out"`): capture.sh writes it into the
rows it proposes for ratios.csv (corpus_rows.csv), and a workload without a row in ratios.csv and
without a declared split is proposed as held-out. --list prints name, description and split.
"""

import argparse
import contextlib
import json
import math
import os
import pickle
import random
import sys
import tempfile
import time

MAX_ENTRIES = 3_000_000  # the history ring; no workload here comes near it

WORKLOADS = {}  # name -> (function, one-line description, declared split or "")
SPLITS = ("tuning", "held-out")  # as bench/corpus/ratios.csv and report.py


def workload(description, split=""):
    if split and split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")

    def register(fn):
        WORKLOADS[fn.__name__] = (fn, description, split)
        return fn

    return register


# --------------------------------------------------------------------------------------------
# Models (imported lazily: --list and py_compile need no torch)


def build_gpt(torch, vocab, d, layers, heads, max_seq=1024, checkpoint=False):
    nn = torch.nn
    F = torch.nn.functional
    if checkpoint:
        import torch.utils.checkpoint  # noqa: F401  (not imported by `import torch`)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.out = nn.Linear(4 * d, d)

        def attend(self, x, cache):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
            mask = None
            if cache is not None:
                if cache[0] is not None:
                    # The dynamic cache of text generation: a new, longer tensor per token.
                    k = torch.cat([cache[0], k], dim=2)
                    v = torch.cat([cache[1], v], dim=2)
                    if t > 1:  # several new tokens after a cached prefix (a later chat turn)
                        s = k.shape[2]
                        mask = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(diagonal=s - t)
                cache[0], cache[1] = k, v
            causal = mask is None and (cache is None or t > 1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
            return self.proj(y.transpose(1, 2).reshape(b, t, c))

        def forward(self, x, cache=None):
            x = x + self.attend(x, cache)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocab, d)
            self.wpe = nn.Embedding(max_seq, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, idx, caches=None, pos0=0):
            t = idx.shape[1]
            pos = torch.arange(pos0, pos0 + t, device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for i, blk in enumerate(self.blocks):
                if caches is not None:
                    x = blk(x, caches[i])
                elif checkpoint and self.training:
                    x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
                else:
                    x = blk(x)
            return self.head(self.ln_f(x))

    return GPT()


def lm_loss(torch, logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def random_batch(torch, rng, vocab, batches, seqs, dev):
    b, t = rng.choice(batches), rng.choice(seqs)
    x = torch.randint(0, vocab, (b, t + 1), device=dev)
    return x[:, :-1], x[:, 1:]


def generate(torch, model, prompt, new_tokens):
    """Greedy decoding with a per-layer KV cache grown by torch.cat."""
    caches = [[None, None] for _ in model.blocks]
    logits = model(prompt, caches, 0)
    tok = logits[:, -1:].argmax(-1)
    out = [tok]
    pos = prompt.shape[1]
    for _ in range(new_tokens - 1):
        logits = model(tok, caches, pos)
        pos += 1
        tok = logits[:, -1:].argmax(-1)
        out.append(tok)
    return torch.cat([prompt] + out, dim=1)


# --------------------------------------------------------------------------------------------
# Workloads. Each takes (torch, rng, dev).

VOCAB = 16384


def _train_gpt(torch, rng, dev, steps, d, layers, heads, batches, seqs, checkpoint=False, autocast=False,
               fused=False):
    model = build_gpt(torch, VOCAB, d, layers, heads, checkpoint=checkpoint).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=None if fused else True)
    for _ in range(steps):
        x, y = random_batch(torch, rng, VOCAB, batches, seqs, dev)
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            loss = lm_loss(torch, model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, y, loss


@workload("GPT (8 layers, 768 wide) training, AdamW (foreach), batch 2-16 x sequence 128-1024 per step")
def gpt_varlen_adamw(torch, rng, dev):
    _train_gpt(torch, rng, dev, 16, 768, 8, 12, [2, 4, 6, 8, 12, 16], [128, 256, 384, 512, 768, 1024])


@workload("GPT (8 layers, 1024 wide) training with activation checkpointing per block, variable shapes")
def gpt_checkpoint(torch, rng, dev):
    _train_gpt(torch, rng, dev, 14, 1024, 8, 16, [4, 8, 12, 16, 24], [256, 512, 768, 1024], checkpoint=True)


@workload("GPT (8 layers, 768 wide) training under bf16 autocast, fused AdamW, variable shapes")
def gpt_bf16_autocast(torch, rng, dev):
    _train_gpt(torch, rng, dev, 16, 768, 8, 12, [2, 4, 8, 16, 24], [128, 256, 512, 1024], autocast=True, fused=True)


@workload("GPT (6 layers, 768 wide): batches copied in on a side stream, SignSGD update on a second "
          "stream with record_stream, variable shapes")
def gpt_side_stream(torch, rng, dev):
    model = build_gpt(torch, VOCAB, 768, 6, 12).to(dev)
    params = list(model.parameters())
    main = torch.cuda.current_stream()
    copy_stream = torch.cuda.Stream()
    update_stream = torch.cuda.Stream()
    for _ in range(16):
        b, t = rng.choice([4, 8, 12, 16]), rng.choice([256, 512, 768, 1024])
        host = torch.randint(0, VOCAB, (b, t + 1)).pin_memory()
        with torch.cuda.stream(copy_stream):
            tokens = host.to(dev, non_blocking=True)
        main.wait_stream(copy_stream)
        tokens.record_stream(main)
        loss = lm_loss(torch, model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        update_stream.wait_stream(main)
        with torch.cuda.stream(update_stream), torch.no_grad():
            for p in params:
                p.grad.record_stream(update_stream)
                p.add_(p.grad.sign(), alpha=-1e-4)
        main.wait_stream(update_stream)
        for p in params:
            p.grad = None  # freed on the main stream with a use on update_stream pending
        del tokens, loss, host


@workload("four branch MLPs of different widths on four streams (record_stream on inputs and "
          "outputs), trained with AdamW, batch 256-4096 per step")
def multi_stream(torch, rng, dev):
    nn = torch.nn
    widths = [1024, 2048, 3072, 4096]
    branches = nn.ModuleList(
        nn.Sequential(nn.Linear(1024, w), nn.GELU(), nn.Linear(w, w), nn.GELU(), nn.Linear(w, 1024)) for w in widths
    ).to(dev)
    opt = torch.optim.AdamW(branches.parameters(), lr=1e-4, foreach=True)
    streams = [torch.cuda.Stream() for _ in widths]
    main = torch.cuda.current_stream()
    for _ in range(24):
        n = rng.choice([256, 512, 1024, 2048, 3072, 4096])
        x = torch.randn(n, 1024, device=dev)
        outs = []
        for branch, s in zip(branches, streams):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                x.record_stream(s)
                h = branch(x)
                for _ in range(rng.randint(0, 2)):
                    h = h + branch(h * 0.5)
            main.wait_stream(s)
            h.record_stream(main)
            outs.append(h)
        loss = sum(o.float().pow(2).mean() for o in outs)
        loss.backward()
        for s in streams:
            main.wait_stream(s)
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, outs, loss, h


@workload("GPT (6 layers, 1024 wide) KV-cache text generation: 8 requests, batch 1-8, prompt "
          "32-960 tokens, 8-40 new tokens")
def kv_cache_generate(torch, rng, dev):
    model = build_gpt(torch, VOCAB, 1024, 6, 16).to(dev).eval()
    with torch.no_grad():
        for _ in range(8):
            b = rng.choice([1, 2, 4, 8])
            prompt_len = rng.randint(32, 960)
            new = rng.randint(8, 40)
            prompt = torch.randint(0, VOCAB, (b, prompt_len), device=dev)
            out = generate(torch, model, prompt, new)
            del prompt, out


@workload("FSDP2 (fully_shard per block, bf16 parameters, fp32 reduction) on one GPU, world size 1, "
          "GPT (6 layers, 768 wide), AdamW, variable shapes")
def fsdp2_one_gpu(torch, rng, dev):
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    init_file = tempfile.NamedTemporaryFile(prefix="corpus_pg_", delete=False).name
    try:
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1,
                                device_id=torch.device(dev))
    except Exception as e:  # no NCCL: gloo, whose CUDA collectives stage through the host
        print(f"fsdp2_one_gpu: nccl failed ({e}); using gloo", file=sys.stderr)
        os.unlink(init_file)
        init_file = tempfile.NamedTemporaryFile(prefix="corpus_pg_", delete=False).name
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        model = build_gpt(torch, VOCAB, 768, 6, 12).to(dev)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for blk in model.blocks:
            fully_shard(blk, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        for _ in range(14):
            x, y = random_batch(torch, rng, VOCAB, [2, 4, 8, 12, 16], [128, 256, 512, 1024], dev)
            loss = lm_loss(torch, model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del x, y, loss
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
        with contextlib.suppress(OSError):
            os.unlink(init_file)


@workload("mixture of experts: 4 layers of 8 experts (1024 -> 2816 -> 1024), top-2 routing, "
          "variable tokens per expert, AdamW, 512-8192 tokens per step")
def moe_variable_tokens(torch, rng, dev):
    nn = torch.nn
    F = torch.nn.functional
    d, hidden, experts, top_k = 1024, 2816, 8, 2

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.router = nn.Linear(d, experts, bias=False)
            self.w1 = nn.ModuleList(nn.Linear(d, hidden) for _ in range(experts))
            self.w2 = nn.ModuleList(nn.Linear(hidden, d) for _ in range(experts))

        def forward(self, x):
            h = self.norm(x)
            weights, chosen = torch.topk(F.softmax(self.router(h).float(), dim=-1), top_k, dim=-1)
            weights = (weights / weights.sum(-1, keepdim=True)).to(h.dtype)
            out = torch.zeros_like(h)
            for e in range(experts):
                rows, slot = torch.nonzero(chosen == e, as_tuple=True)
                if rows.numel() == 0:
                    continue
                y = self.w2[e](F.gelu(self.w1[e](h[rows])))
                out = out.index_add(0, rows, y * weights[rows, slot].unsqueeze(-1))
            return x + out

    model = nn.Sequential(*[MoE() for _ in range(4)]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    for step in range(16):
        n = rng.choice([512, 1024, 2048, 4096, 6144, 8192])
        # Skewed inputs: the router's choice, and so the tokens per expert, differ per step.
        x = torch.randn(n, d, device=dev) * (1 + step % 3) + torch.randn(1, d, device=dev)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, loss


@workload("RL-style loop: 4 rounds of generation (KV cache, batch 4-16, prompt 32-256, 12-32 new "
          "tokens) then 2 policy-gradient steps on the samples, empty_cache() between phases")
def rl_generate_train(torch, rng, dev):
    model = build_gpt(torch, VOCAB, 768, 6, 12).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    for _ in range(4):
        model.eval()
        with torch.no_grad():
            b = rng.choice([4, 8, 12, 16])
            prompt = torch.randint(0, VOCAB, (b, rng.randint(32, 256)), device=dev)
            samples = generate(torch, model, prompt, rng.randint(12, 32))
            rewards = torch.randn(b, device=dev)
            del prompt
        torch.cuda.empty_cache()
        model.train()
        for _ in range(2):
            logits = model(samples[:, :-1])
            logp = torch.log_softmax(logits.float(), -1).gather(-1, samples[:, 1:].unsqueeze(-1)).squeeze(-1)
            loss = -(logp.mean(-1) * rewards).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del logits, logp, loss
        del samples, rewards
        torch.cuda.empty_cache()


@workload("ResNet-style convolutional network (bottleneck blocks, BatchNorm, channels_last), SGD "
          "with momentum, batch 16-96 x resolution 96-224 per step")
def convnet_resnet(torch, rng, dev):
    nn = torch.nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, mid, cout, stride):
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
                nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
                nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Identity() if cin == cout and stride == 1 else
                         nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

        def forward(self, x):
            return torch.relu(self.body(x) + self.skip(x))

    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for mid, blocks, stride in [(64, 2, 1), (128, 3, 2), (256, 3, 2), (512, 2, 2)]:
        for i in range(blocks):
            layers.append(Bottleneck(cin, mid, mid * 4, stride if i == 0 else 1))
            cin = mid * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 1000)]
    model = nn.Sequential(*layers).to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    for _ in range(16):
        b, r = rng.choice([16, 32, 48, 64, 96]), rng.choice([96, 128, 160, 192, 224])
        x = torch.randn(b, 3, r, r, device=dev).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (b,), device=dev)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, y, loss


@workload("diffusion-style U-Net (4 levels, GroupNorm, SiLU, time embedding, skip connections) "
          "under bf16 autocast, AdamW, batch 4-32 x resolution 64-160 per step")
def unet_diffusion(torch, rng, dev):
    nn = torch.nn
    F = torch.nn.functional

    class Res(nn.Module):
        def __init__(self, cin, cout, tdim):
            super().__init__()
            self.n1, self.c1 = nn.GroupNorm(8, cin), nn.Conv2d(cin, cout, 3, padding=1)
            self.t = nn.Linear(tdim, cout)
            self.n2, self.c2 = nn.GroupNorm(8, cout), nn.Conv2d(cout, cout, 3, padding=1)
            self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

        def forward(self, x, temb):
            h = self.c1(F.silu(self.n1(x))) + self.t(temb)[:, :, None, None]
            return self.skip(x) + self.c2(F.silu(self.n2(h)))

    class UNet(nn.Module):
        def __init__(self, base=64, mults=(1, 2, 4, 4), tdim=256):
            super().__init__()
            self.tdim = tdim
            self.temb = nn.Sequential(nn.Linear(tdim, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
            self.inp = nn.Conv2d(3, base, 3, padding=1)
            chans = [base * m for m in mults]
            self.down, self.pool = nn.ModuleList(), nn.ModuleList()
            c = base
            for i, ch in enumerate(chans):
                self.down.append(nn.ModuleList([Res(c, ch, tdim), Res(ch, ch, tdim)]))
                c = ch
                self.pool.append(nn.Conv2d(c, c, 3, 2, 1) if i < len(chans) - 1 else nn.Identity())
            self.mid = nn.ModuleList([Res(c, c, tdim), Res(c, c, tdim)])
            self.up, self.upsample = nn.ModuleList(), nn.ModuleList()
            for i, ch in reversed(list(enumerate(chans))):
                self.up.append(nn.ModuleList([Res(c + ch, ch, tdim), Res(ch, ch, tdim)]))
                c = ch
                self.upsample.append(nn.Upsample(scale_factor=2, mode="nearest") if i > 0 else nn.Identity())
            self.out = nn.Sequential(nn.GroupNorm(8, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))

        def forward(self, x, t):
            half = self.tdim // 2
            freqs = torch.exp(-math.log(10000) * torch.arange(half, device=x.device) / half)
            temb = self.temb(torch.cat([torch.sin(t[:, None] * freqs), torch.cos(t[:, None] * freqs)], -1))
            h = self.inp(x)
            skips = []
            for (r1, r2), pool in zip(self.down, self.pool):
                h = r2(r1(h, temb), temb)
                skips.append(h)
                h = pool(h)
            for r in self.mid:
                h = r(h, temb)
            for (r1, r2), up in zip(self.up, self.upsample):
                h = r2(r1(torch.cat([h, skips.pop()], 1), temb), temb)
                h = up(h)
            return self.out(h)

    model = UNet().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    for _ in range(14):
        b, r = rng.choice([4, 8, 16, 24, 32]), rng.choice([64, 96, 128, 160])
        x0 = torch.randn(b, 3, r, r, device=dev)
        t = torch.rand(b, device=dev) * 1000
        noise = torch.randn_like(x0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x0 + noise, t)
        loss = F.mse_loss(pred.float(), noise)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x0, t, noise, pred, loss


@workload("Llama-style decoder from a transformers LlamaConfig (6 layers, 768 wide, GQA 12/4 heads, "
          "SwiGLU), bf16 autocast, AdamW, variable shapes")
def llama_hf_varlen(torch, rng, dev):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
                         num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024)
    try:
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").to(dev)
    except (AttributeError, TypeError, ValueError):
        model = LlamaForCausalLM(config).to(dev)
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    for _ in range(14):
        x, y = random_batch(torch, rng, VOCAB, [2, 4, 8, 12, 16], [128, 256, 512, 768, 1024], dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        loss = lm_loss(torch, logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, y, logits, loss


# Generation workloads captured after the first twelve; held out from the tuning half.


def _hf_generation_model(torch, cls, config, dev):
    """A transformers causal LM from its config (random weights), bf16, SDPA attention, eval mode."""
    try:
        model = cls._from_config(config, attn_implementation="sdpa")
    except (AttributeError, TypeError, ValueError):
        model = cls(config)
    model = model.to(device=dev, dtype=torch.bfloat16).eval()
    model.generation_config.pad_token_id = 0
    return model


def _left_padded_prompts(torch, lengths, dev):
    """A batch of prompts of the given lengths, left-padded with token 0, and its attention mask."""
    b, t = len(lengths), max(lengths)
    ids = torch.randint(3, VOCAB, (b, t), device=dev)
    mask = torch.ones(b, t, dtype=torch.long, device=dev)
    for i, n in enumerate(lengths):
        if n < t:
            ids[i, : t - n] = 0
            mask[i, : t - n] = 0
    return ids, mask


@workload("transformers LlamaForCausalLM from a config (8 layers, 1024 wide, GQA 16/4), bf16, generate() "
          "with sampling (temperature, top-k, top-p) and a growing KV cache: 10 batches of 1-16 left-padded "
          "prompts of 16-768 tokens, 16-96 new tokens each", split="held-out")
def hf_sample_generate(torch, rng, dev):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = _hf_generation_model(torch, LlamaForCausalLM, config, dev)
    with torch.no_grad():
        for _ in range(10):
            b = rng.choice([1, 2, 4, 8, 16])
            ids, mask = _left_padded_prompts(torch, [rng.randint(16, 768) for _ in range(b)], dev)
            new = rng.randint(16, 96)
            # min_new_tokens = max_new_tokens: every request produces exactly `new` tokens, so the
            # requests (and both captures) do not depend on which tokens were sampled.
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.8, top_k=50,
                                 top_p=0.95, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                                 eos_token_id=2)
            del ids, mask, out


@workload("transformers GPT2LMHeadModel from a config (8 layers, 768 wide), bf16, generate() with beam "
          "search (2-6 beams, the KV cache reordered every token): 8 batches of 1-8 left-padded prompts of "
          "16-384 tokens, 8-48 new tokens each", split="held-out")
def hf_beam_search(torch, rng, dev):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=1024, n_embd=768, n_layer=8, n_head=12,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = _hf_generation_model(torch, GPT2LMHeadModel, config, dev)
    with torch.no_grad():
        for _ in range(8):
            b = rng.choice([1, 2, 4, 8])
            ids, mask = _left_padded_prompts(torch, [rng.randint(16, 384) for _ in range(b)], dev)
            new = rng.randint(8, 48)
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, num_beams=rng.choice([2, 4, 6]),
                                 max_new_tokens=new, min_new_tokens=new, early_stopping=False, pad_token_id=0,
                                 eos_token_id=2)
            del ids, mask, out


@workload("multi-turn chat on a GPT (6 layers, 1024 wide), bf16, KV cache kept across turns: 6 "
          "conversations of batch 2-16, 2-5 turns each (a first prompt of 64-512 tokens, later turns of "
          "16-256, prefilled onto the cache), 8-64 greedy reply tokens per turn", split="held-out")
def chat_multiturn_generate(torch, rng, dev):
    max_seq = 2048
    model = build_gpt(torch, VOCAB, 1024, 6, 16, max_seq=max_seq).to(device=dev, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for _ in range(6):
            b = rng.choice([2, 4, 8, 16])
            caches = [[None, None] for _ in model.blocks]
            pos, tok = 0, None
            for turn in range(rng.randint(2, 5)):
                n_user = rng.randint(64, 512) if turn == 0 else rng.randint(16, 256)
                n_reply = rng.randint(8, 64)
                if pos + 1 + n_user + n_reply > max_seq:
                    break
                user = torch.randint(0, VOCAB, (b, n_user), device=dev)
                if tok is not None:  # the last reply token enters the cache with the next turn
                    user = torch.cat([tok, user], dim=1)
                logits = model(user, caches, pos)  # prefill of the turn onto the cached conversation
                pos += user.shape[1]
                tok = logits[:, -1:].argmax(-1)
                reply = [tok]
                for _ in range(n_reply - 1):
                    logits = model(tok, caches, pos)
                    pos += 1
                    tok = logits[:, -1:].argmax(-1)
                    reply.append(tok)
                reply = torch.cat(reply, dim=1)
                del user, logits, reply
            del caches, tok


# --------------------------------------------------------------------------------------------


def start_history(torch, dev):
    """Switches the memory history on; returns the context setting that records a trace."""
    for context, stacks in ((None, "python"), ("alloc", "python")):
        torch.cuda.memory._record_memory_history(enabled="all", context=context, stacks=stacks,
                                                 max_entries=MAX_ENTRIES)
        probe = torch.empty(1, device=dev)
        del probe
        traces = torch.cuda.memory._snapshot()["device_traces"]
        if any(traces):
            return str(context)
        print(f"history with context={context} records no trace; trying the next setting", file=sys.stderr)
    raise RuntimeError("torch.cuda.memory._record_memory_history records no trace entries")


def run(name, out_dir, tag):
    import torch

    fn, description, split = WORKLOADS[name]
    dev = "cuda:0"
    torch.cuda.set_device(0)
    torch.manual_seed(1234)
    rng = random.Random(sum(map(ord, name)))
    context = start_history(torch, dev)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    fn(torch, rng, dev)
    torch.cuda.synchronize()
    seconds = time.time() - t0
    stats = torch.cuda.memory_stats()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    base = os.path.join(out_dir, f"{name}.{tag}")
    with open(base + ".pickle", "wb") as f:
        pickle.dump(snap, f, protocol=4)
    entries = sum(len(t) for t in snap["device_traces"])
    result = {
        "workload": name,
        "tag": tag,
        "description": description,
        "split": split,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "history_context": context,
        "seconds": round(seconds, 3),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "requested_peak": stats.get("requested_bytes.all.peak", 0),
        "num_alloc_retries": stats.get("num_alloc_retries", 0),
        "num_device_alloc": stats.get("num_device_alloc", 0),
        "num_device_free": stats.get("num_device_free", 0),
        "trace_entries": entries,
        "segment_maps": sum(1 for t in snap["device_traces"] for e in t if e.get("action") == "segment_map"),
        "allocator_settings": snap.get("allocator_settings", {}),
    }
    result["ratio"] = result["max_memory_reserved"] / max(1, result["max_memory_allocated"])
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(f"{name} [{tag}]: {seconds:.1f} s, {entries} trace entries, reserved {result['max_memory_reserved']} B, "
          f"allocated {result['max_memory_allocated']} B, ratio {result['ratio']:.4f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", nargs="?", help="workload name (--list shows them)")
    ap.add_argument("--list", action="store_true",
                    help="print the workloads, one per line: name, description, declared split (tab-separated)")
    ap.add_argument("--out", default=".", help="directory for NAME.TAG.pickle and NAME.TAG.json")
    ap.add_argument("--tag", default="default", help="names the capture (default, expandable)")
    args = ap.parse_args()
    if args.list:
        for name, (_, description, split) in WORKLOADS.items():
            print(f"{name}\t{description}\t{split}")
        return 0
    if args.name not in WORKLOADS:
        ap.error(f"unknown workload {args.name!r}; --list shows them")
    os.makedirs(args.out, exist_ok=True)
    run(args.name, args.out, args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
