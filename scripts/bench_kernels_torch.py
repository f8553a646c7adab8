#!/usr/bin/env python3
"""PyTorch's time for the work each `harpe bench` kernel row does, same shapes, printed as one JSON object
{row name: milliseconds}. `harpe bench` runs this itself when `python3 -c "import torch"` works and puts
the times beside its own (ratio > 1: harpe faster). By hand:

    python3 scripts/bench_kernels_torch.py --tokens 4096 --iters 20

What torch runs: rope — HF `apply_rotary_pos_emb` arithmetic (rotate_half, bf16 in, cos/sin expanded per
head); rms_norm — HF LlamaRMSNorm (f32 upcast, bf16 out) and its autograd backward; cross-entropy —
log_softmax + gather in f32 from bf16 logits (nll), and softmax minus one-hot (dlogits); AdamW —
torch.optim.AdamW(fused=True) on one flat f32 parameter plus the bf16 copy; sum of squares —
torch.linalg.vector_norm. Eager mode, no torch.compile (the named competitor is eager transformers).
"""
import argparse
import json

import torch


def timed(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    dev, bf, t, it = "cuda", torch.bfloat16, a.tokens, a.iters
    out = {}
    h, d = 32, 128
    x = torch.randn(1, h, t, d, device=dev, dtype=bf)
    cos = torch.randn(h, t, d // 2, device=dev)
    sin = torch.randn(h, t, d // 2, device=dev)

    def rope(x):
        c = torch.cat((cos, cos), -1).unsqueeze(0).to(bf)
        s = torch.cat((sin, sin), -1).unsqueeze(0).to(bf)
        return x * c + rotate_half(x) * s

    out["rope fwd bf16"] = timed(lambda: rope(x), it)
    xg = x.clone().requires_grad_(True)
    out["rope fwd+bwd bf16"] = timed(lambda: rope(xg).sum().backward(), it)

    c = 4096
    xn = torch.randn(t, c, device=dev, dtype=bf)
    w = torch.randn(c, device=dev, dtype=bf)

    def rms(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(bf) * w

    out["rms_norm fwd bf16"] = timed(lambda: rms(xn, w), it)
    xv, wv = xn.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out["rms_norm fwd+bwd bf16"] = timed(lambda: rms(xv, wv).sum().backward(), it)

    n, v = min(t, 4096), 32000
    logits = torch.randn(n, v, device=dev, dtype=bf) * 2
    tg = torch.arange(n, device=dev)
    out["ce nll bf16"] = timed(lambda: -torch.log_softmax(logits.float(), -1).gather(1, tg[:, None]), it)

    def dlogits():
        p = torch.softmax(logits.float(), -1)
        p[torch.arange(n, device=dev), tg] -= 1
        return p.to(bf)

    out["ce dlogits bf16"] = timed(dlogits, it)

    npar = 64 << 20
    p = torch.zeros(npar, device=dev, requires_grad=True)
    p.grad = torch.zeros(npar, device=dev)
    opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    wb = torch.empty(npar, device=dev, dtype=bf)

    def step():
        opt.step()
        wb.copy_(p.detach())

    out["adamw f32->bf16"] = timed(step, it)
    out["grad sum of squares"] = timed(lambda: torch.linalg.vector_norm(p.grad), it)
    out["torch"] = torch.__version__
    out["device"] = torch.cuda.get_device_name(0)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
