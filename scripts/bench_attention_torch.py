#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention, per backend (flash, cuDNN, efficient), on the shapes of
`harpe bench attention`: batch 1, 32 query heads, 8 and 32 kv heads, head dim 128, causal, bf16, for each
T in --tokens; forward, backward (from a saved forward) and forward+backward. Prints one JSON object
{"<pass> T<t> hkv<hkv>": {backend: ms or null (the backend refused the shape or ran out of memory)}}.
Each measured row is also printed to stderr as it is measured (flushed), so a run stopped by a time limit
(scripts/gpu-check.sh runs this as a step of its own) keeps what it measured. From T = 32K a row is one
warm-up and one timed call, as in `harpe bench attention`.
`harpe bench attention` runs this itself when torch is importable. By hand:

    python3 scripts/bench_attention_torch.py --tokens 8192,32768,131072 --seconds 2

GQA goes through enable_gqa=True (torch >= 2.5); a backend that does not take it gets K/V repeated to 32
heads outside the timed region (its time then covers the larger K/V, as a user of that backend would pay).
"""
import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


LONG_T = 32768


def timed(fn, seconds, t):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - t0
    if t >= LONG_T:
        return once * 1e3
    n = max(1, min(50, int(seconds / max(once, 1e-6))))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def bench(backend, t, hkv, seconds):
    h, d, dev, bf = 32, 128, "cuda", torch.bfloat16
    q = torch.randn(1, h, t, d, device=dev, dtype=bf, requires_grad=True)
    k = torch.randn(1, hkv, t, d, device=dev, dtype=bf, requires_grad=True)
    v = torch.randn(1, hkv, t, d, device=dev, dtype=bf, requires_grad=True)
    do = torch.randn(1, h, t, d, device=dev, dtype=bf)
    out = {}
    with sdpa_kernel([BACKENDS[backend]]):
        try:
            attn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv != h)
            attn()
        except RuntimeError:
            kr = k.detach().repeat_interleave(h // hkv, 1).requires_grad_(True)
            vr = v.detach().repeat_interleave(h // hkv, 1).requires_grad_(True)
            attn = lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
            attn()
        with torch.no_grad():
            out["fwd"] = row(backend, "fwd", t, hkv, timed(attn, seconds, t))
        o = attn()
        out["bwd"] = row(backend, "bwd", t, hkv, timed(lambda: o.backward(do, retain_graph=True), seconds, t))
        out["fwd+bwd"] = row(backend, "fwd+bwd", t, hkv, timed(lambda: attn().backward(do), seconds, t))
    return out


def row(backend, p, t, hkv, ms):
    print("torch SDPA %-9s %-8s %7d %4d %10.3f ms" % (backend, p, t, hkv, ms), file=sys.stderr, flush=True)
    return ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,32768,131072")
    ap.add_argument("--seconds", type=float, default=2.0)
    a = ap.parse_args()
    res = {}
    for t in [int(x) for x in a.tokens.split(",")]:
        for hkv in (8, 32):
            for backend in BACKENDS:
                try:
                    r = bench(backend, t, hkv, a.seconds)
                except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
                    print("torch SDPA %-9s T %d hkv %d: refused (%s)" % (backend, t, hkv, str(e).splitlines()[0][:120]),
                          file=sys.stderr, flush=True)
                    r = {}
                torch.cuda.empty_cache()
                for p in ("fwd", "bwd", "fwd+bwd"):
                    res.setdefault(f"{p} T{t} hkv{hkv}", {})[backend] = r.get(p)
    res["torch"] = torch.__version__
    res["device"] = torch.cuda.get_device_name(0)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
