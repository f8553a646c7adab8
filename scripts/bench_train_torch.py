#!/usr/bin/env python3
"""Training throughput on CPU: `harpe train` against PyTorch eager (transformers LlamaForCausalLM),
same model config, same sequence length and batch, same thread count, side by side in one run.

    python3 -m venv /tmp/gvenv && /tmp/gvenv/bin/pip install torch transformers
    cargo build --release
    /tmp/gvenv/bin/python scripts/bench_train_torch.py --harpe target/release/harpe --threads 2 \
        --out benches/results/train-cpu_$(date +%Y%m).md

Both sides run full optimizer steps (forward, backward, AdamW) in f32 on random-init weights; torch reads
the same kind of data (byte tokens of harpe's built-in text are not needed for speed, so torch uses random
ids). harpe's tokens/s is the median over steps after the first (warm-up) from its metrics.jsonl; torch's
is the median over the same number of timed steps. Activation checkpointing: torch eager has none, so
harpe is measured both with "none" (like for like) and with "every-layer" (what long runs use).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CFG = dict(vocab_size=259, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
           num_attention_heads=8, num_key_value_heads=4)


def torch_tokens_per_s(seq, batch, steps, threads):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(**CFG, max_position_embeddings=max(seq, 256), rms_norm_eps=1e-5,
                      attn_implementation="eager")
    model = LlamaForCausalLM(cfg).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    ids = torch.randint(0, CFG["vocab_size"], (batch, seq))
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i > 0:
            times.append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in model.parameters())
    return batch * seq / statistics.median(times), torch.__version__, n_params


def harpe_tokens_per_s(binary, seq, batch, steps, threads, ckpt):
    toml = f"""
[model.init]
vocab_size = {CFG['vocab_size']}
hidden_size = {CFG['hidden_size']}
intermediate_size = {CFG['intermediate_size']}
num_hidden_layers = {CFG['num_hidden_layers']}
num_attention_heads = {CFG['num_attention_heads']}
num_key_value_heads = {CFG['num_key_value_heads']}
max_position_embeddings = {max(seq, 256)}
rms_norm_eps = 1e-5

[data]
source = "builtin"

[rope]
scheme = "default"
theta = 10000.0

[train]
dtype = "f32"
micro_batch_size = {batch}
activation_checkpointing = "{ckpt}"
loss_chunk_tokens = 1024

[optim]
lr = 1e-3
weight_decay = 0.1

[log]
progress = false
plot = false

[[stage]]
seq_len = {seq}
steps = {steps + 1}
"""
    with tempfile.TemporaryDirectory() as d:
        cfg = os.path.join(d, "bench.toml")
        open(cfg, "w").write(toml)
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
        subprocess.run([binary, "train", "--config", cfg, "--out", os.path.join(d, "run")], check=True,
                       env=env, stdout=subprocess.DEVNULL)
        recs = [json.loads(l) for l in open(os.path.join(d, "run", "metrics.jsonl"))]
    return statistics.median(r["tokens_per_s"] for r in recs[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--harpe", default="target/release/harpe", help="harpe binary")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both sides")
    ap.add_argument("--seq", type=int, nargs="+", default=[256, 1024], help="sequence lengths")
    ap.add_argument("--batch", type=int, default=2, help="sequences per step")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up step)")
    ap.add_argument("--out", help="write the markdown table here (default: stdout only)")
    a = ap.parse_args()
    rows, raw = [], []
    tv, params = "?", 0
    load_before = os.getloadavg()
    for seq in a.seq:
        t, tv, params = torch_tokens_per_s(seq, a.batch, a.steps, a.threads)
        h0 = harpe_tokens_per_s(a.harpe, seq, a.batch, a.steps, a.threads, "none")
        h1 = harpe_tokens_per_s(a.harpe, seq, a.batch, a.steps, a.threads, "every-layer")
        rows.append((seq, t, h0, h1))
        line = (f"T={seq}: torch {t:.0f} tok/s, harpe {h0:.0f} tok/s (no ckpt, ratio {h0 / t:.2f}), "
                f"{h1:.0f} tok/s (every-layer ckpt, ratio {h1 / t:.2f})")
        raw.append(line)
        print(line, file=sys.stderr)
    lines = [
        "# Training throughput on CPU: harpe vs PyTorch eager",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} by `scripts/bench_train_torch.py` on `{os.uname().nodename}` "
        f"({os.cpu_count()} logical CPUs; 1-minute load average {load_before[0]:.2f} before the run and "
        f"{os.getloadavg()[0]:.2f} after it), {a.threads} threads on both sides, f32, "
        f"batch {a.batch}, median of {a.steps} steps after one warm-up step. torch {tv} "
        f"(transformers LlamaForCausalLM, eager attention, torch.optim.AdamW); harpe binary `{a.harpe}`.",
        f"Model: Llama, {CFG['num_hidden_layers']} layers, hidden {CFG['hidden_size']}, intermediate "
        f"{CFG['intermediate_size']}, {CFG['num_attention_heads']} heads / {CFG['num_key_value_heads']} kv heads, "
        f"vocab {CFG['vocab_size']} (~{params / 1e6:.1f}M parameters).",
        "",
        "| T | torch tok/s | harpe tok/s (no ckpt) | ratio | harpe tok/s (every-layer ckpt) | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for seq, t, h0, h1 in rows:
        lines.append(f"| {seq} | {t:.0f} | {h0:.0f} | {h0 / t:.2f} | {h1:.0f} | {h1 / t:.2f} |")
    # The exact command and the raw output, so the file needs no hand-written header.
    lines += ["", "Command:", "", "```", " ".join([sys.executable] + sys.argv), "```", "", "Raw output:", "", "```"]
    lines += raw + ["```"]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        open(a.out, "w").write(text)


if __name__ == "__main__":
    main()
