#!/usr/bin/env python3
"""PyTorch's time for `harpe bench model`'s rows at the same shapes, printed as one JSON object
{row name: milliseconds, or null when torch ran out of device memory; "errors": {row name: message}}.
`harpe bench model` runs this itself on CUDA when `python3 -c "import torch"` works, once per row
(--layer-only / --step-only), and puts the times beside its own (ratio > 1: harpe faster). By hand:

    python3 scripts/bench_model_torch.py --hidden 4096 --heads 32 --kv-heads 32 --inter 11008 \
        --tokens 8192 --vocab 32000 --layers 32 --iters 2 --step-only

What torch runs (eager, no torch.compile; the named competitor is eager transformers with
attn_implementation="sdpa", written out here so the GPU machine needs torch only):
- "decoder layer fwd+bwd": one Llama decoder layer as transformers' LlamaDecoderLayer computes it —
  RMSNorm (f32 upcast), q/k/v/o projections without bias, rotary embedding (rotate_half), causal
  scaled_dot_product_attention (torch picks its best backend; GQA through enable_gqa), SiLU-gated MLP,
  residuals — on bf16 weights, forward then backward of y.float().sum(), as harpe's row does;
- "train step": embedding, L such layers each under torch.utils.checkpoint (harpe's every-layer
  recompute), final norm, lm head, cross-entropy in f32, backward; the bf16 gradients moved into fp32
  master gradients (each bf16 one freed as it is copied), global-norm clipping to 1.0,
  torch.optim.AdamW(fused=True) on the fp32 masters, and the masters copied back into the bf16 weights:
  harpe's step (fp32 master + AdamW, bf16 compute), ~18 B/param as harpe's.
Weights are made on the device in their dtype (no host-side init of 7B fp32 parameters). A CUDA
out-of-memory in a row frees what the row held and reports null for it, so harpe's row stands alone.
It runs on the CPU too for a smoke test: --device cpu (f32, wall clock).
"""
import argparse
import gc
import json
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def timed(fn, iters):
    if not torch.cuda.is_available():  # a CPU smoke run (--device cpu): wall clock
        fn()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def rms(x, w, eps=1e-5):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Layer(torch.nn.Module):
    def __init__(self, c, h, hkv, inter, dev, dt):
        super().__init__()
        d = c // h
        self.h, self.hkv, self.d = h, hkv, d
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False, device=dev, dtype=dt)  # noqa: E731
        self.q, self.k, self.v, self.o = lin(c, h * d), lin(c, hkv * d), lin(c, hkv * d), lin(h * d, c)
        self.gate, self.up, self.down = lin(c, inter), lin(c, inter), lin(inter, c)
        self.ln1 = torch.nn.Parameter(torch.ones(c, device=dev, dtype=dt))
        self.ln2 = torch.nn.Parameter(torch.ones(c, device=dev, dtype=dt))

    def forward(self, x, cos, sin):
        b, t, c = x.shape
        h = rms(x, self.ln1)
        q = self.q(h).view(b, t, self.h, self.d).transpose(1, 2)
        k = self.k(h).view(b, t, self.hkv, self.d).transpose(1, 2)
        v = self.v(h).view(b, t, self.hkv, self.d).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.hkv != self.h)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, c))
        h = rms(x, self.ln2)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def rope(t, d, dev, dtype, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=dev, dtype=torch.float64) / d)
    ang = torch.outer(torch.arange(t, device=dev, dtype=torch.float64), inv)
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos().to(dtype)[None, None], emb.sin().to(dtype)[None, None]


def layer_row(a, dev, dt, cos, sin):
    layer = Layer(a.hidden, a.heads, a.kv_heads, a.inter, dev, dt)
    x = torch.randn(1, a.tokens, a.hidden, device=dev, dtype=dt, requires_grad=True)

    def layer_step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x, cos, sin).float().sum().backward()

    return timed(layer_step, a.iters)


def step_row(a, dev, dt, cos, sin):
    embed = torch.nn.Embedding(a.vocab, a.hidden, device=dev, dtype=dt)
    layers = torch.nn.ModuleList([Layer(a.hidden, a.heads, a.kv_heads, a.inter, dev, dt) for _ in range(a.layers)])
    norm = torch.nn.Parameter(torch.ones(a.hidden, device=dev, dtype=dt))
    head = torch.nn.Linear(a.hidden, a.vocab, bias=False, device=dev, dtype=dt)
    params = list(embed.parameters()) + list(layers.parameters()) + [norm] + list(head.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=dev != "cpu")
    ids = (torch.arange(a.tokens, device=dev) * 7 + torch.arange(a.tokens, device=dev) ** 2) % a.vocab
    ids = ids[None]
    targets = torch.roll(ids, -1, 1)

    def train_step():
        for p, m in zip(params, masters):
            p.grad, m.grad = None, None
        h = embed(ids)
        for ly in layers:
            h = checkpoint(ly, h, cos, sin, use_reentrant=False)
        logits = head(rms(h, norm)).float()
        loss = F.cross_entropy(logits.view(-1, a.vocab), targets.view(-1))
        del h, logits
        loss.backward()
        loss.item()  # the step's loss read, as harpe's loop reads it
        for m, p in zip(masters, params):
            m.grad, p.grad = p.grad.float(), None
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, params):
                p.copy_(m)

    return timed(train_step, a.iters)


def main():
    ap = argparse.ArgumentParser()
    for k, v in [("hidden", 4096), ("heads", 32), ("kv-heads", 32), ("inter", 11008), ("tokens", 4096),
                 ("vocab", 32000), ("layers", 2), ("iters", 5)]:
        ap.add_argument("--" + k, type=int, default=v)
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--layer-only", action="store_true", help="time the decoder layer row only")
    only.add_argument("--step-only", action="store_true", help="time the training step row only")
    ap.add_argument("--device", default="cuda", help="cuda (what harpe bench model runs), or cpu for a smoke run")
    a = ap.parse_args()
    dev = a.device
    dt = torch.bfloat16 if dev != "cpu" else torch.float32
    torch.manual_seed(0)
    cos, sin = rope(a.tokens, a.hidden // a.heads, dev, dt)
    out, errors = {}, {}
    rows = [("decoder layer fwd+bwd", layer_row), ("train step", step_row)]
    for name, row in rows:
        if (a.layer_only and row is not layer_row) or (a.step_only and row is not step_row):
            continue
        try:
            out[name] = row(a, dev, dt, cos, sin)
        except torch.OutOfMemoryError as e:  # a missing torch number, not a failed harpe row
            out[name] = None
            errors[name] = "out of memory: " + str(e).splitlines()[0]
        gc.collect()  # the row's tensors (also those an exception's frames held)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if errors:
        out["errors"] = errors
    print(json.dumps(out))


if __name__ == "__main__":
    main()
