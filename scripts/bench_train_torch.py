#!/usr/bin/env python3
"""Training and decode throughput on CPU: `harpe train` against PyTorch (transformers LlamaForCausalLM +
torch.optim.AdamW), same model config, sequence length, batch and thread count, side by side in one run;
and greedy decode, `harpe generate` against transformers' `generate` with its KV cache.

    scripts/install-torchrun.sh target/pyenv && target/pyenv/bin/pip install transformers
    cargo build --release
    target/pyenv/bin/python scripts/bench_train_torch.py --grid --harpe target/release/harpe --threads 2 \
        --profile 2 --out benches/results/train-cpu-grid_$(date +%Y%m%d).md

Both sides run full optimizer steps (forward, backward, clip, AdamW) in f32 on random-init weights; torch
reads random ids (the tokens do not change the speed). harpe's tokens/s is the median over steps after the
first (warm-up) from its metrics.jsonl; torch's is the median over the same number of timed steps after one
warm-up step. Each side of each row runs in its own fresh process (torch: this script with `--torch-row`).
The method, for every CPU speed figure in benches/: `--repeats R` (default 5) rounds per row, each round torch
(every `--attn` in turn: `--attn sdpa eager` times both) then harpe, so a slow spell of the machine falls on
both sides; each side's median over its R processes and their min-max spread; the CPU model and its vector
ISA (AVX-512, or AVX2 only) in the header; the 1-minute load average before and after each row, and a row
above 1.5 at either end marked loaded (on 2 cores: another process held a core; not evidence of a speed).
torch's default attention is transformers' default, SDPA. `--isa avx2` measures the AVX2-only case on an
AVX-512 machine: torch with ATEN_CPU_CAPABILITY=avx2 and MKL_ENABLE_INSTRUCTIONS=AVX2, harpe a build
without its `avx512` feature (`cargo build --release --no-default-features`; the script checks that
`harpe --version` says its CPU kernels take AVX2).
Activation checkpointing: harpe "every-layer" against `gradient_checkpointing_enable`
(torch.utils.checkpoint around every decoder layer, use_reentrant=False); "none" against plain autograd.

`--grid` runs GRID below, a covering design rather than the full factorial (4 hidden x 2 attention x 4
depths x 4 T x 3 micro-batches x 2 checkpointing = 768 rows, days on 2 cores): every level of every factor
appears at least once, the first reported shape (6 layers, hidden 384, 6/2 heads, intermediate 1024,
micro-batch 4, T 512) appears with and without checkpointing, and the expensive levels are paired with the
cheap ones (T 4096 with micro-batch 1, micro-batch 8 with T <= 1024) so a step stays under ~10 s. GQA 3:1
needs heads divisible by 3 at head dim 64, so it runs at hidden 384 (6/2) and 768 (12/4); hidden 128
(4 heads of 32) and 512 (8 heads of 64) are MHA, and hidden 768 also appears as MHA. Without `--grid`,
`--seq` x `--kv-heads` on the 4-layer, hidden-256 model of the earlier benchmark (both checkpointing modes).

`--infer` runs INFER_GRID instead: perplexity scoring (`harpe eval-ppl` vs transformers' forward) and greedy
KV-cached decoding (`harpe generate` vs transformers' `generate`) on the same saved weights (max(3, --repeats)
timed runs per side, torch and harpe alternating, after a warm-up of each; medians), each row a model
with an eval-ppl window T and a decode prompt length (its comment lists the levels covered):

    target/pyenv/bin/python scripts/bench_train_torch.py --infer --threads 2 \
        --out benches/results/infer-cpu-grid_$(date +%Y%m%d).md

`--profile K` re-runs the K rows with the lowest ratio under `perf record` (both sides) and writes each
side's top symbols. `--decode N` also times greedy decode of N tokens on the first shape: the torch model is
saved with `save_pretrained` and `harpe generate` loads the same weights (--rope-parity hf); tokens/s is N
over the whole call (prefill included), median of 3 calls after a warm-up call of each side, torch and harpe
calls alternating; the file says whether both produced the same tokens.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

VOCAB = 259


def shape(hidden, heads, kv, layers, seq, batch, ckpt, inter=None):
    """One grid row: the model (intermediate ~8/3 hidden rounded to 32 unless given) and the step."""
    inter = inter or (8 * hidden // 3 + 31) // 32 * 32
    return dict(hidden=hidden, heads=heads, kv=kv, layers=layers, inter=inter, seq=seq, batch=batch, ckpt=ckpt)


# hidden, heads, kv heads, layers, T, micro-batch, checkpointing. Levels covered: hidden 128 (rows 3-4),
# 384 (1, 2, 9), 512 (5, 6), 768 (7, 8, 10); GQA 3:1 (1, 2, 7, 9, 10), MHA (3-6, 8); layers 2 (3, 6, 10),
# 4 (4, 7, 9), 6 (1, 2), 8 (5, 8); T 256 (3, 5, 8), 512 (1, 2, 10), 1024 (4, 7), 4096 (6, 9); micro-batch 1
# (4, 5, 6, 9), 4 (1, 2, 7), 8 (3, 8, 10); checkpointing none (1, 3, 5, 7, 9), every layer (2, 4, 6, 8, 10).
GRID = [
    shape(384, 6, 2, 6, 512, 4, "none", inter=1024),  # the first reported shape
    shape(384, 6, 2, 6, 512, 4, "every-layer", inter=1024),
    shape(128, 4, 4, 2, 256, 8, "none"),
    shape(128, 4, 4, 4, 1024, 1, "every-layer"),
    shape(512, 8, 8, 8, 256, 1, "none"),
    shape(512, 8, 8, 2, 4096, 1, "every-layer"),
    shape(768, 12, 4, 4, 1024, 4, "none"),
    shape(768, 12, 12, 8, 256, 8, "every-layer"),
    shape(384, 6, 2, 4, 4096, 1, "none", inter=1024),
    shape(768, 12, 4, 2, 512, 8, "every-layer"),
    # beyond the covering design: GQA 4:1 (8 heads over 2 kv heads) at T 2048, both checkpointing modes
    shape(512, 8, 2, 4, 2048, 2, "none"),
    shape(512, 8, 2, 4, 2048, 2, "every-layer"),
]


# Inference (`--infer`): each row is a model, the eval-ppl window T (window = stride = T: disjoint windows, T-1
# targets each) and the decode prompt length (64 new tokens). Levels covered: hidden 128 (2, 3), 384 (1, 8),
# 512 (4, 5), 768 (6, 7); GQA 3:1 (1, 6, 8), MHA (2-5, 7); layers 2 (2, 5), 4 (3, 6, 8), 6 (1), 8 (4, 7);
# T 256 (2, 4, 7), 512 (1), 1024 (3, 6), 4096 (5, 8); prompt 32 (1, 3, 4, 7, 8), 512 (2, 5, 6).
INFER_GRID = [
    (shape(384, 6, 2, 6, 512, 1, "none", inter=1024), 32),  # the first reported model
    (shape(128, 4, 4, 2, 256, 1, "none"), 512),
    (shape(128, 4, 4, 4, 1024, 1, "none"), 32),
    (shape(512, 8, 8, 8, 256, 1, "none"), 32),
    (shape(512, 8, 8, 2, 4096, 1, "none"), 512),
    (shape(768, 12, 4, 4, 1024, 1, "none"), 512),
    (shape(768, 12, 12, 8, 256, 1, "none"), 32),
    (shape(384, 6, 2, 4, 4096, 1, "none", inter=1024), 32),
]
DECODE_NEW = 64


def legacy_rows(seqs, kv_heads, batch, ckpt_rows):
    """The earlier benchmark's model (4 layers, hidden 256, 8 heads) at each T and kv-head count."""
    modes = ["none", "every-layer"] if ckpt_rows else ["none"]
    return [shape(256, 8, kv, 4, seq, batch, m, inter=688) for kv in kv_heads for seq in seqs for m in modes]


def torch_model(s, attn):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    if not torch.cuda.is_available():
        # the CPU-only install (scripts/install-torchrun.sh) links stub CUDA libraries; transformers' mask
        # code asks torch.cuda.is_current_stream_capturing(), which calls into them and segfaults
        torch.cuda.is_current_stream_capturing = lambda: False
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=s["hidden"], intermediate_size=s["inter"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv"], max_position_embeddings=max(s["seq"], 256),
                      rms_norm_eps=1e-5, attn_implementation=attn)
    return LlamaForCausalLM(cfg).float()


def torch_tokens_per_s(s, steps, threads, attn):
    """(tok/s, torch version, parameter count) of `steps` timed optimizer steps after one warm-up."""
    import torch
    torch.set_num_threads(threads)
    model = torch_model(s, attn).train()
    if s["ckpt"] != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    ids = torch.randint(0, VOCAB, (s["batch"], s["seq"]))
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
    return s["batch"] * s["seq"] / statistics.median(times), torch.__version__, n_params


def harpe_toml(s, steps):
    return f"""
[model.init]
vocab_size = {VOCAB}
hidden_size = {s['hidden']}
intermediate_size = {s['inter']}
num_hidden_layers = {s['layers']}
num_attention_heads = {s['heads']}
num_key_value_heads = {s['kv']}
max_position_embeddings = {max(s['seq'], 256)}
rms_norm_eps = 1e-5

[data]
source = "builtin"

[rope]
scheme = "default"
theta = 10000.0

[train]
dtype = "f32"
micro_batch_size = {s['batch']}
activation_checkpointing = "{s['ckpt']}"
loss_chunk_tokens = 1024

[optim]
lr = 1e-3
weight_decay = 0.1

[log]
progress = false
plot = false

[[stage]]
seq_len = {s['seq']}
steps = {steps + 1}
"""


def perf_prefix(perf_out):
    return ["perf", "record", "-F", "499", "-q", "-o", perf_out, "--"] if perf_out else []


def harpe_tokens_per_s(binary, s, steps, threads, perf_out=None):
    with tempfile.TemporaryDirectory() as d:
        cfg = os.path.join(d, "bench.toml")
        open(cfg, "w").write(harpe_toml(s, steps))
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
        cmd = perf_prefix(perf_out) + [binary, "train", "--config", cfg, "--out", os.path.join(d, "run")]
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        recs = [json.loads(l) for l in open(os.path.join(d, "run", "metrics.jsonl"))]
    return statistics.median(r["tokens_per_s"] for r in recs[1:])


# --isa avx2: what keeps torch's own kernels (ATen's dispatch) and MKL's GEMMs off AVX-512
TORCH_AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def torch_row_subprocess(s, steps, threads, attn, perf_out=None):
    """torch's side of one row in a fresh process (as harpe's): (tok/s, torch version, parameters)."""
    cmd = perf_prefix(perf_out) + [sys.executable, os.path.abspath(__file__), "--torch-row", json.dumps(s),
                                   "--steps", str(steps), "--threads", str(threads), "--attn", attn]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return tuple(json.loads(out.strip().splitlines()[-1]))


def perf_top(perf_out, n=12):
    """The top `n` symbols (self time) of a perf.data file, as 'pct symbol' lines."""
    rep = subprocess.run(["perf", "report", "-i", perf_out, "--stdio", "--no-children", "--sort", "dso,symbol",
                          "--percent-limit", "0.8"], capture_output=True, text=True).stdout
    # perf pads the symbol column to its widest entry and appends empty columns ("-      -"): trimmed
    lines = [re.sub(r"\s+-\s+-$", "", l.strip()).rstrip() for l in rep.splitlines() if l.strip() and not l.startswith("#")]
    return lines[:n]


def decode_tokens_per_s(binary, threads, s, prompt_len, new_tokens, attn, reps=3):
    """(torch tok/s, harpe tok/s, same tokens?, torch runs, harpe runs) of greedy decoding on the same weights and
    prompt: a warm-up call of each side, then `reps` calls of each alternating (torch, harpe, torch, ...), so that a
    slow spell of the machine falls on both sides; medians."""
    import torch
    torch.set_num_threads(threads)
    model = torch_model(dict(s, seq=prompt_len + new_tokens), attn).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=g)

    def torch_call():
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, use_cache=True)
        return new_tokens / (time.perf_counter() - t0), out[0, prompt_len:].tolist()

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
        cmd = [binary, "generate", "--model", d, "--prompt-ids", ",".join(map(str, prompt[0].tolist())),
               "--max-new-tokens", str(new_tokens), "--rope-parity", "hf"]

        def harpe_call():
            return json.loads(subprocess.run(cmd, check=True, env=env, capture_output=True, text=True).stdout)

        _, torch_ids = torch_call()  # warm-up
        first = harpe_call()
        ts, hs = [], []
        for _ in range(reps):
            ts.append(torch_call()[0])
            hs.append(harpe_call()["tokens_per_s"])
    return statistics.median(ts), statistics.median(hs), first["new_tokens"] == torch_ids, ts, hs


def byte_tokenizer(path):
    """harpe's byte tokenizer (model::testing::byte_tokenizer_json): <unk>=0, <s>=1 added first, </s>=2, byte
    b = 3 + b through BPE byte fallback; built with `tokenizers` (installed with transformers)."""
    from tokenizers import Tokenizer, decoders, models, processors
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=False))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.save(path)
    return tok


def ppl_tokens_per_s(binary, threads, s, attn, reps=3):
    """(torch tok/s, harpe tok/s, torch nll, harpe nll, scored tokens, parameters) of perplexity scoring on the
    same weights: one document of max(4, 8192 / T) windows of T tokens, disjoint windows (eval-ppl --window T --stride T;
    transformers: model(w, labels=w) per window, the rule's T-1 targets each). Median of `reps` passes after a
    warm-up (torch) / of `reps` fresh processes (harpe: its --json `warm_tokens_per_s`, the windows after its
    first, so both sides are timed warm; the first window pays the allocator's first touch of every buffer),
    alternating: torch pass, harpe process, torch pass, ... Also returns each side's runs."""
    import random
    import torch
    torch.set_num_threads(threads)
    T = s["seq"]
    model = torch_model(s, attn).eval()
    rng = random.Random(1)
    n_tokens = max(4, 8192 // T) * T
    text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz      ") for _ in range(n_tokens - 1))
    ids = [1] + [3 + b for b in text.encode()]

    def torch_pass():
        t0 = time.perf_counter()
        nll, count = 0.0, 0
        with torch.no_grad():
            for k in range(0, len(ids), T):
                w = torch.tensor([ids[k:k + T]])
                loss = model(w, labels=w).loss
                nll += loss.item() * (w.shape[1] - 1)
                count += w.shape[1] - 1
        return time.perf_counter() - t0, nll, count

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        tok = byte_tokenizer(os.path.join(d, "tokenizer.json"))
        assert tok.encode(text).ids == ids, "the byte tokenizer does not give harpe's ids"
        doc = os.path.join(d, "doc.txt")
        open(doc, "w").write(text)
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
        cmd = [binary, "eval-ppl", "--model", d, "--input", doc, "--window", str(T), "--stride", str(T),
               "--rope-parity", "hf", "--json"]
        _, nll, count = torch_pass()  # warm-up
        # alternating, a torch pass then a harpe process, so that a slow spell of the machine falls on both sides
        ts, runs = [], []
        for _ in range(reps):
            ts.append(count / torch_pass()[0])
            runs.append(json.loads(subprocess.run(cmd, check=True, env=env, capture_output=True, text=True).stdout))
    if runs[0]["tokens"] != count:
        raise SystemExit(f"eval-ppl scored {runs[0]['tokens']} tokens, transformers {count}: not the same rule")
    hs = [r["warm_tokens_per_s"] for r in runs]
    n_params = sum(p.numel() for p in model.parameters())
    return statistics.median(ts), statistics.median(hs), nll / count, runs[0]["nll"], count, n_params, ts, hs


def infer_rows(a):
    """The INFER_GRID rows: eval-ppl and decode, torch then harpe; returns markdown lines and raw lines."""
    lines = [
        "| # | hidden | heads/kv | layers | inter | params | T | load | ppl torch tok/s | ppl harpe tok/s | ratio | "
        "nll torch / harpe | prompt | load | decode torch tok/s | decode harpe tok/s | ratio | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    raw = []
    for i, (s, prompt) in enumerate(INFER_GRID, 1):
        if a.rows and i not in a.rows:
            continue
        load_p = os.getloadavg()[0]
        reps = max(3, a.repeats)
        pt, ph, nt, nh, count, n_params, pts, phs = ppl_tokens_per_s(a.harpe, a.threads, s, a.attn[0], reps)
        load_d = os.getloadavg()[0]
        dt, dh, same, dts, dhs = decode_tokens_per_s(a.harpe, a.threads, s, prompt, DECODE_NEW, a.attn[0], reps)
        lines.append(f"| {i} | {s['hidden']} | {s['heads']}/{s['kv']} | {s['layers']} | {s['inter']} | "
                     f"{n_params / 1e6:.1f}M | {s['seq']} | {load_p:.2f} | {pt:.0f} | {ph:.0f} | {ph / pt:.2f} | "
                     f"{nt:.4f} / {nh:.4f} | {prompt} | {load_d:.2f} | {dt:.1f} | {dh:.1f} | {dh / dt:.2f} | {same} |")
        line = (f"infer row {i} {describe(s)} ppl({count} tokens) load={load_p:.2f}: torch {pt:.0f} harpe {ph:.0f} "
                f"tok/s (x{ph / pt:.2f}) nll {nt:.5f}/{nh:.5f}; decode {DECODE_NEW} after {prompt} "
                f"load={load_d:.2f}: torch {dt:.1f} harpe {dh:.1f} tok/s (x{dh / dt:.2f}) same: {same}; "
                f"ppl runs torch {' '.join(f'{x:.0f}' for x in pts)} / harpe {' '.join(f'{x:.0f}' for x in phs)}, "
                f"decode runs torch {' '.join(f'{x:.1f}' for x in dts)} / harpe {' '.join(f'{x:.1f}' for x in dhs)}")
        raw.append(line)
        print(line, file=sys.stderr, flush=True)
    return lines, raw


def infer_report(a, lines, raw, load_before):
    import torch
    head = [
        "# Inference throughput on CPU: harpe vs PyTorch (perplexity scoring and KV-cached decoding)",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `scripts/bench_train_torch.py --infer` on "
        f"`{os.uname().nodename}` ({cpu_model()}; {cpu_isa()}; {os.cpu_count()} logical CPUs; 1-minute load average "
        f"{load_before:.2f} before the run and {os.getloadavg()[0]:.2f} after it), {a.threads} threads on both "
        f"sides, f32, vocab {VOCAB}, random-init weights saved by transformers and loaded by harpe "
        f"(--rope-parity hf). torch {torch.__version__}, transformers LlamaForCausalLM, attn_implementation="
        f"\"{a.attn[0]}\"; harpe binary `{a.harpe}`: `{harpe_version(a.harpe)}`. Perplexity: one document of max(4, 8192/T) disjoint windows of T tokens; transformers "
        f"`model(w, labels=w)` per window (no_grad; median of {max(3, a.repeats)} passes after a warm-up) vs `harpe eval-ppl "
        f"--window T --stride T --json` (median of {max(3, a.repeats)} processes of its `warm_tokens_per_s`: scoring time of the windows after the first, "
        f"not loading; the torch side is timed after a warm-up pass; torch passes and harpe processes alternate); "
        f"tokens/s = scored tokens (T-1 per window, the same count on both sides: checked) per second; the mean "
        f"NLL of both is printed as a cross-check. Decode: greedy, {DECODE_NEW} new tokens after the prompt, batch "
        f"1, transformers `generate` (KV cache) vs `harpe generate`, tokens/s = new tokens over the whole call "
        f"(prefill included), median of {max(3, a.repeats)} after a warm-up call of each side, torch and harpe calls "
        f"alternating; `same tokens`: both produced the same ids; each run's tok/s in the raw lines.",
        "",
    ]
    tail = ["", "Command:", "", "```", " ".join([sys.executable] + sys.argv), "```", "", "Raw output:", "", "```"]
    return "\n".join(head + lines + tail + raw + ["```"]) + "\n"


def harpe_version(binary):
    """`harpe --version` (the build's cargo features and CPU GEMM backend), or why it could not be read."""
    try:
        return subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except OSError as e:
        return f"unknown ({e})"


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def cpu_isa():
    """The vector ISA harpe's CPU kernels and torch can use here: AVX-512 or AVX2 only (from /proc/cpuinfo's
    flags; the figures of one do not stand for the other)."""
    try:
        flags = next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown ISA"
    if "avx512f" in flags:
        return "AVX-512 (" + ", ".join(f for f in ("avx512f", "avx512bw", "avx512_bf16") if f in flags) + ")"
    if "avx2" in flags:
        return "AVX2" + (" + FMA" if "fma" in flags else "") + ", no AVX-512"
    return "no AVX2"


# a row measured above this 1-minute load average is marked: on 2 cores it means another process had a core
QUIET_LOAD = 1.5


def spread(xs):
    """'min-max' of a side's per-process figures."""
    return f"{min(xs):.0f}-{max(xs):.0f}"


def describe(s):
    return (f"C={s['hidden']} H={s['heads']}/{s['kv']} L={s['layers']} I={s['inter']} T={s['seq']} "
            f"mb={s['batch']} ckpt={s['ckpt']}")


def run_rows(a, shapes):
    """Every (number, shape): `a.repeats` rounds of torch (each `--attn` in turn) then harpe, each side in a
    fresh process, so a slow spell of the machine falls on both sides; each side's median and spread, and
    the 1-minute load average before and after the row. Returns row dicts and raw lines."""
    rows, raw, meta = [], [], {}
    for i, s in shapes:
        ts = {at: [] for at in a.attn}
        hs = []
        load_before = os.getloadavg()[0]
        for _ in range(a.repeats):
            for at in a.attn:
                t, meta["torch"], params = torch_row_subprocess(s, a.steps, a.threads, at)
                ts[at].append(t)
            hs.append(harpe_tokens_per_s(a.harpe, s, a.steps, a.threads))
        load_after = os.getloadavg()[0]
        h = statistics.median(hs)
        torch_med = {at: statistics.median(v) for at, v in ts.items()}
        loaded = max(load_before, load_after) > QUIET_LOAD
        rows.append(dict(s, i=i, load_before=load_before, load_after=load_after, loaded=loaded, torch=torch_med,
                         torch_runs=ts, harpe=h, harpe_runs=hs, params=params))
        ratios = ", ".join(f"x{h / t:.2f} vs {at}" for at, t in torch_med.items())
        line = (f"row {i} {describe(s)} params={params / 1e6:.1f}M load={load_before:.2f}->{load_after:.2f}"
                f"{' LOADED' if loaded else ''}: harpe {h:.0f} tok/s ({ratios}); runs: harpe {' '.join(f'{x:.0f}' for x in hs)}"
                + "".join(f"; torch {at} {' '.join(f'{x:.0f}' for x in v)}" for at, v in ts.items()))
        raw.append(line)
        print(line, file=sys.stderr, flush=True)
    return rows, raw, meta


def profile_rows(a, rows):
    """perf top symbols of both sides of the `a.profile` rows with the lowest ratio."""
    out = []
    worst = sorted(rows, key=lambda r: r["harpe"] / r["torch"][a.attn[0]])[: a.profile]
    with tempfile.TemporaryDirectory() as d:
        for r in worst:
            s = {k: r[k] for k in ("hidden", "heads", "kv", "layers", "inter", "seq", "batch", "ckpt")}
            pt, ph = os.path.join(d, "torch.data"), os.path.join(d, "harpe.data")
            torch_row_subprocess(s, a.steps, a.threads, a.attn[0], perf_out=pt)
            harpe_tokens_per_s(a.harpe, s, a.steps, a.threads, perf_out=ph)
            out += ["", f"Row {r['i']} ({describe(s)}), `perf record -F 499`, whole process (setup included), "
                    f"self time by shared object and symbol, load {os.getloadavg()[0]:.2f}:", ""]
            for side, p in (("torch", pt), ("harpe", ph)):
                out += [f"{side}:", "", "```"] + perf_top(p) + ["```", ""]
    return out


def report(a, rows, raw, meta, load_before, drows):
    torch_cols = " | ".join(f"torch {at} tok/s (spread) | ratio vs {at}" for at in a.attn)
    lines = [
        "# Training throughput on CPU: harpe vs PyTorch",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `scripts/bench_train_torch.py` on "
        f"`{os.uname().nodename}` ({cpu_model()}; {cpu_isa()}"
        + ("; both sides kept to AVX2 (--isa avx2: torch " + ", ".join(f"{k}={v}" for k, v in TORCH_AVX2_ENV.items())
           + "; harpe built without its avx512 feature)" if a.isa == "avx2" else "")
        + f"; {os.cpu_count()} logical CPUs; 1-minute load average "
        f"{load_before:.2f} before the run and {os.getloadavg()[0]:.2f} after it), {a.threads} threads on both "
        f"sides, f32, vocab {VOCAB}, median of {a.steps} steps after one warm-up step, each side in its own "
        f"process, {a.repeats} processes per side and row, interleaved (torch {' then torch '.join(a.attn)}, then "
        f"harpe, {a.repeats} times); each side's figure is the median over its processes, the spread their "
        f"min-max (each process's tok/s in the raw lines). torch {meta.get('torch', '?')} (transformers "
        f"LlamaForCausalLM, attn_implementation {' and '.join(a.attn)}, torch.optim.AdamW; checkpointed rows: "
        f"gradient_checkpointing_enable, torch.utils.checkpoint per layer); harpe binary `{a.harpe}`: "
        f"`{harpe_version(a.harpe)}`. Load: the 1-minute average before -> after the row; a row above "
        f"{QUIET_LOAD} at either end is marked **loaded** and is not evidence of a speed.",
        "",
        f"| # | hidden | heads/kv | layers | inter | T | mb | ckpt | params | load | harpe tok/s (spread) | {torch_cols} |",
        "|" + "---|" * (11 + 2 * len(a.attn)),
    ]
    for r in rows:
        torch_cells = " | ".join(f"{r['torch'][at]:.0f} ({spread(r['torch_runs'][at])}) | "
                                 f"{r['harpe'] / r['torch'][at]:.2f}" for at in a.attn)
        load = f"{r['load_before']:.2f} -> {r['load_after']:.2f}" + (" **loaded**" if r["loaded"] else "")
        lines.append(f"| {r['i']} | {r['hidden']} | {r['heads']}/{r['kv']} | {r['layers']} | {r['inter']} | "
                     f"{r['seq']} | {r['batch']} | {r['ckpt']} | {r['params'] / 1e6:.1f}M | {load} | "
                     f"{r['harpe']:.0f} ({spread(r['harpe_runs'])}) | {torch_cells} |")
    if drows:
        lines += ["", f"Greedy decode, {a.decode} new tokens after a {a.prompt}-token prompt, batch 1 "
                  "(transformers `generate`, KV cache, vs `harpe generate`):", "",
                  "| shape | load | torch tok/s | harpe tok/s | ratio | same tokens |", "|---|---|---|---|---|---|"]
        for d, load, t, h, same in drows:
            lines.append(f"| {d} | {load:.2f} | {t:.1f} | {h:.1f} | {h / t:.2f} | {same} |")
    if a.profile:
        lines += ["", "## Profiles of the lowest-ratio rows"] + profile_rows(a, rows)
    # The exact command and the raw output, so the file needs no hand-written header.
    lines += ["", "Command:", "", "```", " ".join([sys.executable] + sys.argv), "```", "", "Raw output:", "", "```"]
    lines += raw + ["```"]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--harpe", default="target/release/harpe", help="harpe binary")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both sides")
    ap.add_argument("--grid", action="store_true", help="run GRID (the covering design) instead of --seq/--kv-heads")
    ap.add_argument("--rows", type=int, nargs="+", help="only these GRID (or INFER_GRID) rows (1-based)")
    ap.add_argument("--infer", action="store_true",
                    help="run INFER_GRID (eval-ppl and decode vs transformers) instead of the training grid")
    ap.add_argument("--attn", nargs="+", default=["sdpa"], choices=["sdpa", "eager"],
                    help="transformers' attention(s): each is timed in every round (--attn sdpa eager: both)")
    ap.add_argument("--seq", type=int, nargs="+", default=[256, 1024], help="sequence lengths (without --grid)")
    ap.add_argument("--kv-heads", type=int, nargs="+", default=[4],
                    help="kv heads of the 8 attention heads (4: GQA, 8: MHA; without --grid)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per step (without --grid)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="processes per side and row, interleaved torch and harpe; each side's median is taken")
    ap.add_argument("--no-ckpt-rows", action="store_true", help="skip the checkpointed rows (without --grid)")
    ap.add_argument("--profile", type=int, default=0, metavar="K", help="perf profiles of the K lowest-ratio rows")
    ap.add_argument("--decode", type=int, default=0, metavar="N", help="also time greedy decode of N tokens")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens of the decode rows")
    ap.add_argument("--isa", choices=["native", "avx2"], default="native",
                    help="avx2: keep both sides off AVX-512 (torch by its env switches; harpe must be a "
                         "--no-default-features build)")
    ap.add_argument("--out", help="write the markdown table here (default: stdout only)")
    ap.add_argument("--torch-row", help=argparse.SUPPRESS)  # internal: one torch side, JSON shape
    a = ap.parse_args()
    if a.torch_row:
        print(json.dumps(torch_tokens_per_s(json.loads(a.torch_row), a.steps, a.threads, a.attn[0])))
        return
    if a.isa == "avx2":
        # set before torch is first imported (the --infer rows run torch in this process; harpe ignores them)
        os.environ.update(TORCH_AVX2_ENV)
        if "CPU kernels: AVX-512" in harpe_version(a.harpe):
            raise SystemExit(f"--isa avx2: {a.harpe} takes AVX-512 on this CPU (`harpe --version`)\n"
                             "hint: cargo build --release --no-default-features, and pass that binary")
    if a.infer:
        load_before = os.getloadavg()[0]
        lines, raw = infer_rows(a)
        text = infer_report(a, lines, raw, load_before)
        print(text)
        if a.out:
            open(a.out, "w").write(text)
        return
    if a.grid:
        shapes = [(i + 1, s) for i, s in enumerate(GRID) if not a.rows or i + 1 in a.rows]
    else:
        shapes = list(enumerate(legacy_rows(a.seq, a.kv_heads, a.batch, not a.no_ckpt_rows), 1))
    load_before = os.getloadavg()[0]
    rows, raw, meta = run_rows(a, shapes)
    drows = []
    if a.decode:
        s = shapes[0][1]
        load = os.getloadavg()[0]
        t, h, same, _, _ = decode_tokens_per_s(a.harpe, a.threads, s, a.prompt, a.decode, a.attn[0])
        d = f"C={s['hidden']} H={s['heads']}/{s['kv']} L={s['layers']}"
        drows.append((d, load, t, h, same))
        line = f"decode {a.decode} after {a.prompt} {d} load={load:.2f}: torch {t:.1f} harpe {h:.1f} tok/s (x{h / t:.2f}), same: {same}"
        raw.append(line)
        print(line, file=sys.stderr)
    text = report(a, rows, raw, meta, load_before, drows)
    print(text)
    if a.out:
        open(a.out, "w").write(text)


if __name__ == "__main__":
    main()
