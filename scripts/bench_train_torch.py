#!/usr/bin/env python3
"""Training and decode throughput on CPU: `harpe train` against PyTorch eager (transformers
LlamaForCausalLM), same model config, same sequence length and batch, same thread count, side by side in
one run; and greedy decode, `harpe generate` against transformers' `generate` with its KV cache.

    python3 -m venv /tmp/gvenv && /tmp/gvenv/bin/pip install torch transformers
    cargo build --release
    /tmp/gvenv/bin/python scripts/bench_train_torch.py --harpe target/release/harpe --threads 2 \
        --out benches/results/train-cpu_$(date +%Y%m).md

Both sides run full optimizer steps (forward, backward, AdamW) in f32 on random-init weights; torch reads
the same kind of data (byte tokens of harpe's built-in text are not needed for speed, so torch uses random
ids). harpe's tokens/s is the median over steps after the first (warm-up) from its metrics.jsonl; torch's
is the median over the same number of timed steps. Activation checkpointing: harpe "every-layer" against
transformers' `gradient_checkpointing_enable` (torch.utils.checkpoint around every decoder layer,
use_reentrant=False); "none" against plain eager. `--kv-heads 4 8` runs the GQA (8/4) and MHA (8/8) shapes.
Decode (`--decode N`): the torch model is saved with `save_pretrained` and `harpe generate` loads the same
weights (--rope-parity hf), both continue the same random prompt greedily for exactly N tokens (no stop
token); tokens/s is N over the whole call (prefill of the prompt included), median of 3 calls after a
warm-up, and the file says whether both produced the same tokens. Each row records the 1-minute load
average at its start, since a shared machine moves these numbers.
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


def torch_model(seq, kv_heads):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(**dict(CFG, num_key_value_heads=kv_heads), max_position_embeddings=max(seq, 256),
                      rms_norm_eps=1e-5, attn_implementation="eager")
    return LlamaForCausalLM(cfg).float()


def torch_tokens_per_s(seq, batch, steps, threads, kv_heads, ckpt):
    import torch
    torch.set_num_threads(threads)
    model = torch_model(seq, kv_heads).train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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


def harpe_tokens_per_s(binary, seq, batch, steps, threads, ckpt, kv_heads):
    toml = f"""
[model.init]
vocab_size = {CFG['vocab_size']}
hidden_size = {CFG['hidden_size']}
intermediate_size = {CFG['intermediate_size']}
num_hidden_layers = {CFG['num_hidden_layers']}
num_attention_heads = {CFG['num_attention_heads']}
num_key_value_heads = {kv_heads}
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


def decode_tokens_per_s(binary, threads, kv_heads, prompt_len, new_tokens):
    """(torch tok/s, harpe tok/s, same tokens?) of greedy decoding on the same weights and prompt."""
    import torch
    torch.set_num_threads(threads)
    model = torch_model(prompt_len + new_tokens, kv_heads).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, CFG["vocab_size"], (1, prompt_len), generator=g)
    times = []
    with torch.no_grad():
        for i in range(4):
            t0 = time.perf_counter()
            out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, use_cache=True)
            if i > 0:
                times.append(time.perf_counter() - t0)
    torch_ids = out[0, prompt_len:].tolist()
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
        cmd = [binary, "generate", "--model", d, "--prompt-ids", ",".join(map(str, prompt[0].tolist())),
               "--max-new-tokens", str(new_tokens), "--rope-parity", "hf"]
        runs = [json.loads(subprocess.run(cmd, check=True, env=env, capture_output=True, text=True).stdout)
                for _ in range(4)]
    h = statistics.median(r["tokens_per_s"] for r in runs[1:])
    return new_tokens / statistics.median(times), h, runs[0]["new_tokens"] == torch_ids


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--harpe", default="target/release/harpe", help="harpe binary")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both sides")
    ap.add_argument("--seq", type=int, nargs="+", default=[256, 1024], help="sequence lengths")
    ap.add_argument("--kv-heads", type=int, nargs="+", default=[CFG["num_key_value_heads"]],
                    help="kv heads of the 8 attention heads (4: GQA, 8: MHA)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per step")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up step)")
    ap.add_argument("--no-ckpt-rows", action="store_true", help="skip the checkpointed rows")
    ap.add_argument("--decode", type=int, default=0, metavar="N", help="also time greedy decode of N tokens")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens of the decode rows")
    ap.add_argument("--out", help="write the markdown table here (default: stdout only)")
    a = ap.parse_args()
    rows, drows, raw = [], [], []
    tv, params = "?", 0
    load_before = os.getloadavg()
    for kv in a.kv_heads:
        for seq in a.seq:
            load = os.getloadavg()[0]
            t, tv, params = torch_tokens_per_s(seq, a.batch, a.steps, a.threads, kv, False)
            h0 = harpe_tokens_per_s(a.harpe, seq, a.batch, a.steps, a.threads, "none", kv)
            tc = hc = float("nan")
            if not a.no_ckpt_rows:
                tc, _, _ = torch_tokens_per_s(seq, a.batch, a.steps, a.threads, kv, True)
                hc = harpe_tokens_per_s(a.harpe, seq, a.batch, a.steps, a.threads, "every-layer", kv)
            rows.append((kv, seq, load, t, h0, tc, hc))
            line = (f"kv={kv} T={seq} load={load:.2f}: no ckpt torch {t:.0f} harpe {h0:.0f} tok/s "
                    f"(x{h0 / t:.2f}); every-layer ckpt torch {tc:.0f} harpe {hc:.0f} tok/s (x{hc / tc:.2f})")
            raw.append(line)
            print(line, file=sys.stderr)
        if a.decode:
            load = os.getloadavg()[0]
            t, h, same = decode_tokens_per_s(a.harpe, a.threads, kv, a.prompt, a.decode)
            drows.append((kv, load, t, h, same))
            line = (f"kv={kv} decode {a.decode} after {a.prompt} load={load:.2f}: torch {t:.1f} harpe {h:.1f} "
                    f"tok/s (x{h / t:.2f}), same tokens: {same}")
            raw.append(line)
            print(line, file=sys.stderr)
    heads = CFG["num_attention_heads"]
    lines = [
        "# Training throughput on CPU: harpe vs PyTorch eager",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} by `scripts/bench_train_torch.py` on `{os.uname().nodename}` "
        f"({os.cpu_count()} logical CPUs; 1-minute load average {load_before[0]:.2f} before the run and "
        f"{os.getloadavg()[0]:.2f} after it), {a.threads} threads on both sides, f32, "
        f"batch {a.batch}, median of {a.steps} steps after one warm-up step. torch {tv} "
        f"(transformers LlamaForCausalLM, eager attention, torch.optim.AdamW; checkpointed rows: "
        f"gradient_checkpointing_enable, torch.utils.checkpoint per layer); harpe binary `{a.harpe}`.",
        f"Model: Llama, {CFG['num_hidden_layers']} layers, hidden {CFG['hidden_size']}, intermediate "
        f"{CFG['intermediate_size']}, {heads} heads of dim {CFG['hidden_size'] // heads}, vocab "
        f"{CFG['vocab_size']} (~{params / 1e6:.1f}M parameters at the last shape).",
        "",
        "| heads / kv heads | T | load | torch tok/s | harpe tok/s | ratio | torch ckpt tok/s | harpe ckpt tok/s | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kv, seq, load, t, h0, tc, hc in rows:
        lines.append(f"| {heads}/{kv} | {seq} | {load:.2f} | {t:.0f} | {h0:.0f} | {h0 / t:.2f} | {tc:.0f} | {hc:.0f} "
                     f"| {hc / tc:.2f} |")
    if drows:
        lines += ["", f"Greedy decode, {a.decode} new tokens after a {a.prompt}-token prompt, batch 1 "
                  "(transformers `generate`, KV cache, vs `harpe generate`):", "",
                  "| heads / kv heads | load | torch tok/s | harpe tok/s | ratio | same tokens |",
                  "|---|---|---|---|---|---|"]
        for kv, load, t, h, same in drows:
            lines.append(f"| {heads}/{kv} | {load:.2f} | {t:.1f} | {h:.1f} | {h / t:.2f} | {same} |")
    # The exact command and the raw output, so the file needs no hand-written header.
    lines += ["", "Command:", "", "```", " ".join([sys.executable] + sys.argv), "```", "", "Raw output:", "", "```"]
    lines += raw + ["```"]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        open(a.out, "w").write(text)


if __name__ == "__main__":
    main()
