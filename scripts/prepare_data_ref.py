#!/usr/bin/env python3
"""Reference Python implementation of `harpe prepare-data --strategy per-source-upsample` (Fu et al. 2024's
per-source length upsampling), built on the `tokenizers` package, for the side-by-side benchmark in
benches/prepare_data.rs.

Same recipe as the Rust command: read SlimPajama-style jsonl(.zst) in sorted path order, tokenize every
document (no special tokens, BOS prepended), per-source budgets = budget x input-token share, keep documents
with >= threshold tokens and short ones when the splitmix64 coin of (seed, file, doc) < short_keep, cut the
last document at the budget, top up short sources, pack into seq_len sequences with no padding. The coin is
the same function as harpe's, so both write the same token stream (the benchmark checks the sha256).

Usage: python prepare_data_ref.py --tokenizer tokenizer.json --seq-len 4096 --budget 10000000 \
           --out /tmp/ref.bin FILE.jsonl.zst ...
Prints one JSON line: tokens_in, seconds, tokens_out, sha256 of the output tokens.
"""
import argparse
import hashlib
import io
import math
import json
import sys
import time

import numpy as np
import zstandard
from tokenizers import Tokenizer

M64 = (1 << 64) - 1


def mix(z):
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def coin(seed, file, doc):
    return (mix(mix(mix(seed) ^ file) ^ doc) >> 11) / float(1 << 53)


def lines(path):
    with open(path, "rb") as f:
        stream = zstandard.ZstdDecompressor().stream_reader(f) if path.endswith(".zst") else f
        for line in io.TextIOWrapper(stream, encoding="utf-8"):
            if line.strip():
                yield line


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--budget", type=int, required=True)
    ap.add_argument("--threshold", type=int, default=4096)
    ap.add_argument("--short-keep", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bos", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    tok = Tokenizer.from_file(a.tokenizer)
    t0 = time.time()
    docs = []  # (file, doc, source, ids)
    tokens_in = {}
    for fi, path in enumerate(sorted(a.inputs)):
        for di, line in enumerate(lines(path)):
            rec = json.loads(line)
            src = rec["meta"]["redpajama_set_name"]
            ids = np.asarray(tok.encode(rec["text"], add_special_tokens=False).ids, dtype=np.uint32)
            docs.append((fi, di, src, ids))
            tokens_in[src] = tokens_in.get(src, 0) + len(ids)
    total = sum(tokens_in.values())
    # the same float steps as harpe (mixture.rs target_shares + Selector::new), so budgets match to the token
    names = sorted(tokens_in)
    w = [float(tokens_in[n]) for n in names]
    base = sum(w)
    w = [x / base for x in w]
    wsum = sum(w)
    budget = {n: math.floor(float(a.budget) * (x / wsum) + 0.5) for n, x in zip(names, w)}
    used = dict.fromkeys(budget, 0)
    take = [0] * len(docs)
    for k, (fi, di, src, ids) in enumerate(docs):
        room = budget[src] - used[src]
        if room <= 0:
            continue
        if len(ids) < a.threshold and coin(a.seed, fi, di) >= a.short_keep:
            continue
        take[k] = min(len(ids) + 1, room)
        used[src] += take[k]
    for k, (fi, di, src, ids) in enumerate(docs):  # top-up of short sources
        room = budget[src] - used[src]
        if take[k] == 0 and room > 0 and len(ids) < a.threshold:
            take[k] = min(len(ids) + 1, room)
            used[src] += take[k]
    out = []
    bos = np.array([a.bos], dtype=np.uint32)
    for k, (fi, di, src, ids) in enumerate(docs):
        if take[k]:
            out.append(np.concatenate([bos, ids])[: take[k]])
    stream = np.concatenate(out)
    n = len(stream) // a.seq_len
    packed = stream[: n * a.seq_len].reshape(n, a.seq_len).astype("<u4")
    packed.tofile(a.out)
    secs = time.time() - t0
    sha = hashlib.sha256(packed.tobytes()).hexdigest()
    print(json.dumps({"tokens_in": total, "seconds": secs, "tokens_out": int(packed.size), "sha256": sha}))


if __name__ == "__main__":
    sys.exit(main())
