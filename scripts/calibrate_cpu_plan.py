#!/usr/bin/env python3
"""Calibrate the CPU plan's backward-temporaries constants (src/train/plan/memory.rs CPU_BWD_PER_I, CPU_BWD_PER_C).

Runs 2-step `harpe train` on CPU (f32, one rank, every-layer checkpointing) over the MHA grid
C 128/256 x I 512/1024 x L 4/8 x T 512/1024, reads each run's measured peak (metrics.jsonl
step_peak_bytes), asks `harpe plan --json` for the same config, and fits the correction
  (measured - planned) / (T * 4 B) = dI * I + dC * C
by least squares over the T = 1024 runs (every other term of the plan is enumerated; these two absorb
candle's backward temporaries and what glibc keeps resident). The T = 512 runs are printed as a check:
since SwiGLU is fused (ops::swiglu) the largest ones (C 256, L 8) peak in the optimizer step, not in the
recompute, which the plan's working set does not model (they measure 15-20 MiB above the plan). Each config runs --repeat times and its smallest peak is
kept: how the ranks' and rayon's threads meet decides what glibc's per-thread arenas keep, so the same
run measures up to ~10% apart on a busy machine (187-206 MiB); the smallest is the least allocator noise.
Prints the fit, the new constants and each config's residual.
The peak does not depend on the build profile (same allocations), so a debug binary will do.

usage: scripts/calibrate_cpu_plan.py [--harpe target/debug/harpe] [--out DIR]
"""
import argparse, itertools, json, os, re, subprocess, sys, tempfile

CFG = """
[model.init]
vocab_size = 259
hidden_size = {c}
intermediate_size = {i}
num_hidden_layers = {l}
num_attention_heads = {h}
num_key_value_heads = {h}

[data]
source = "builtin"

[rope]
scheme = "default"
theta = 10000.0

[train]
device = "cpu"
dtype = "f32"
micro_batch_size = 1
activation_checkpointing = "every-layer"
loss_chunk_tokens = 128
global_batch_tokens = {t}

[log]
progress = false
plot = false

[[stage]]
seq_len = {t}
steps = 2
"""


def plan_constants(src):
    text = open(src).read()
    get = lambda name: float(re.search(rf"pub const {name}: f64 = ([0-9.]+);", text).group(1))
    return get("CPU_BWD_PER_I"), get("CPU_BWD_PER_C")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--harpe", default="target/debug/harpe")
    ap.add_argument("--repeat", type=int, default=3, help="runs per config; the smallest peak is kept")
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="harpe-calib-")
    os.makedirs(out, exist_ok=True)
    per_i, per_c = plan_constants("src/train/plan/memory.rs")
    rows = []
    for c, i, l, t in itertools.product((128, 256), (512, 1024), (4, 8), (512, 1024)):
        name = f"c{c}-i{i}-l{l}-t{t}"
        cfg = os.path.join(out, name + ".toml")
        with open(cfg, "w") as f:
            f.write(CFG.format(c=c, i=i, l=l, h=c // 32, t=t))
        run = os.path.join(out, name)
        measured = None
        for _ in range(a.repeat):
            subprocess.run(["rm", "-rf", run], check=True)
            subprocess.run([a.harpe, "train", "--config", cfg, "--out", run], check=True, stdout=subprocess.DEVNULL)
            peaks = [json.loads(x).get("step_peak_bytes") for x in open(os.path.join(run, "metrics.jsonl"))]
            peak = max(p for p in peaks if p)
            measured = peak if measured is None else min(measured, peak)
        plan = json.loads(subprocess.run([a.harpe, "plan", "--config", cfg, "--json"], check=True,
                                         capture_output=True, text=True).stdout)
        r = (measured - plan["total_bytes"]) / (t * 4.0)
        rows.append((name, c, i, t, measured, plan["total_bytes"], r))
        print(f"{name}: measured {measured / 2**20:.1f} MiB, planned {plan['total_bytes'] / 2**20:.1f} MiB, "
              f"residual {r:+.1f} f32/token", flush=True)
    # least squares r = dI * I + dC * C (normal equations) over the longest-T runs
    check = [x for x in rows if x[3] != 1024]
    rows = [x for x in rows if x[3] == 1024]
    sii = sum(i * i for _, _, i, *_ in rows)
    scc = sum(c * c for _, c, *_ in rows)
    sic = sum(c * i for _, c, i, *_ in rows)
    sir = sum(i * r for _, _, i, _, _, _, r in rows)
    scr = sum(c * r for _, c, _, _, _, _, r in rows)
    det = sii * scc - sic * sic
    di, dc = (sir * scc - scr * sic) / det, (scr * sii - sir * sic) / det
    print(f"fit: dI {di:+.2f}, dC {dc:+.2f} -> CPU_BWD_PER_I = {per_i + di:.1f}, CPU_BWD_PER_C = {per_c + dc:.1f}")
    worst = max(abs(r - di * i - dc * c) * t * 4.0 / 2**20 for _, c, i, t, _, _, r in rows)
    print(f"largest residual of the fitted runs: {worst:.2f} MiB")
    for name, c, i, t, _, _, r in check:
        print(f"check {name}: {(r - di * i - dc * c) * t * 4.0 / 2**20:+.2f} MiB (measured - fitted plan)")


if __name__ == "__main__":
    sys.exit(main())
