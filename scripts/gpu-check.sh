#!/usr/bin/env bash
# THE script for a GPU machine: check and time harpe's CUDA build there, in two halves.
#
#   scripts/gpu-check.sh build   # here (no GPU; Rust + the CUDA toolchain from PyPI): builds the CUDA
#                                # release binary, strips it and packs what must travel into gpu-bundle/
#                                # (git-ignored, < 64 MiB; zstd-compressed only if it would not fit)
#   scripts/gpu-check.sh run     # on the GPU machine (no Rust, no network; python3 with the NVIDIA CUDA 13
#                                # wheels, e.g. torch cu130): runs from the repository root with
#                                # gpu-bundle/ beside it and writes benches/results/gpu_<gpu>_<yyyymm>.md
#
# `run` does, each step under its own timeout and all within one budget (HARPE_GPU_CHECK_BUDGET, default
# 450 s; steps that no longer fit are recorded as skipped), in this order:
#   1. finds libcudart/libcublas/libcurand (site-packages/nvidia/cu13/lib) and libnccl (nvidia/nccl/lib)
#      in python3's environment and puts them on LD_LIBRARY_PATH (the binary links them; cuda-build.md §2);
#   2. `harpe selftest` (every kernel vs its CPU reference, f32/bf16/f16, fwd/bwd; exit 1 on FAIL);
#   3. the tiny config, 20 f32 steps, on the GPU and on the CPU with the same binary, and the two loss
#      curves compared step by step: they must agree to 1e-4 relative (`train_parity`); then the same GPU
#      run as an NCCL group of one process (`--nproc-per-node 1`, ZeRO-0 and ZeRO-3: the collectives and
#      the ragged gathers/reduces on device memory), which must equal the single-process GPU run to 1e-6,
#      and as 2 `Local` rank threads sharing the GPU (ZeRO-3; Ulysses SP 2), equal to one rank to 1e-5;
#   4. `harpe plan` vs the measured device peak (metrics.jsonl `device_peak_bytes`) for a Llama-2-7B-shaped
#      4-layer stack at 16K and 32K tokens (configs/gpu-plan-check.toml; `plan_vs_measured`, goal 15%);
#   5. `harpe bench` (per-kernel GB/s vs measured copy bandwidth; PyTorch beside it when importable),
#      `harpe bench model --model-rows layer` (a Llama-2-7B decoder layer fwd+bwd at T = 4096 and 16384),
#      `harpe bench model --model-rows step` (its own step and limit: the full 32-layer Llama-2-7B bf16
#      training step with AdamW at the largest T, a multiple of 1024, whose `harpe plan` fits the free
#      device memory, random init + 1 warm-up + 2 timed steps: tokens/s, TFLOP/s, MFU; a note instead
#      where it does not fit, e.g. 80 GB; PyTorch's same step beside it), `harpe bench comms --nproc-per-node 1` (NCCL
#      all-reduce / all-gather / reduce-scatter through harpe's Comm), then
#      `harpe bench attention` (flash attention fwd/bwd/fwd+bwd at T = 8K/32K/128K, TFLOP/s and % of peak,
#      PyTorch SDPA per backend beside it; `attention_steps` below);
#   6. selftest's small cases under compute-sanitizer memcheck and racecheck when the machine has it;
#   7. the results file with every command's output and exit code. The script's exit code is 1 when any
#      step failed or was skipped, so a caller sees it; the file is written either way.
# Environment: HARPE_GPU_BUNDLE (default gpu-bundle), PYTHON (default python3), CUDA_COMPUTE_CAP for
# build (default 80: PTX for A100, JIT-compiled on Hopper), HARPE_GPU_FEATURES for build (default nccl;
# nccl,flash-attn with HARPE_GPU_BUNDLE=gpu-bundle-fa: the second bundle, README "Build for GPUs").
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUNDLE="${HARPE_GPU_BUNDLE:-$ROOT/gpu-bundle}"
PY="${PYTHON:-python3}"
LIMIT=$((64 * 1024 * 1024))

die() { echo "gpu-check: $*" >&2; exit 1; }

build() {
  set -e
  cd "$ROOT"
  local env_lines
  env_lines="$(scripts/install-cuda-toolchain.sh "$ROOT/target/cuda-toolchain")" || die "toolchain install failed"
  eval "$env_lines"
  local t0=$SECONDS
  # nccl = cuda + the NCCL backend (the binary then needs libnccl.so.2, which the cu13 wheels ship)
  CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}" nice -n 5 cargo build --release --features "${HARPE_GPU_FEATURES:-nccl}" --bin harpe
  local bin="${CARGO_TARGET_DIR:-$ROOT/target}/release/harpe"
  echo "gpu-check: cuda release build took $((SECONDS - t0)) s" >&2
  rm -rf "$BUNDLE" && mkdir -p "$BUNDLE"
  strip -o "$BUNDLE/harpe" "$bin"
  cp scripts/bench_kernels_torch.py scripts/bench_attention_torch.py scripts/bench_model_torch.py "$BUNDLE/"
  git rev-parse HEAD >"$BUNDLE/COMMIT" 2>/dev/null || echo unknown >"$BUNDLE/COMMIT"
  local size
  size=$(du -sb "$BUNDLE" | cut -f1)
  if [ "$size" -ge "$LIMIT" ]; then
    command -v zstd >/dev/null || die "bundle is $size bytes (> 64 MiB) and zstd is not installed; hint: apt-get install zstd"
    zstd -q -19 --rm "$BUNDLE/harpe" -o "$BUNDLE/harpe.zst"
    size=$(du -sb "$BUNDLE" | cut -f1)
    [ "$size" -lt "$LIMIT" ] || die "bundle is still $size bytes after zstd; hint: build with CUDA_COMPUTE_CAP=80 (no Hopper-only SASS)"
  fi
  echo "gpu-check: $BUNDLE holds $(ls "$BUNDLE" | tr '\n' ' ')($size bytes); on the GPU machine run: scripts/gpu-check.sh run" >&2
}

# site-packages dirs of python3 that hold nvidia/cu13/lib (CUDA 13 wheels) and nvidia/nccl/lib.
nvidia_libs() {
  "$PY" - <<'PYEOF'
import os, site, sys
dirs = []
for p in list(site.getsitepackages()) + [site.getusersitepackages()] + sys.path:
    for sub in ("nvidia/cu13/lib", "nvidia/nccl/lib"):
        d = os.path.join(p, sub)
        if os.path.isdir(d) and d not in dirs:
            dirs.append(d)
print(":".join(dirs))
PYEOF
}

REPORT=""
FAILED=0

# Compares the per-step losses of two metrics.jsonl files: argv = CPU file, GPU file, steps, tolerance.
PARITY_PY='
import json, sys
def losses(p):
    with open(p) as f:
        recs = [json.loads(l) for l in f if l.strip()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r and "grad_norm" in r}
cpu, gpu = losses(sys.argv[1]), losses(sys.argv[2])
steps, tol = int(sys.argv[3]), float(sys.argv[4])
worst = 0.0
print("step  cpu loss     gpu loss     rel diff")
for s in sorted(cpu):
    if s in gpu:
        rel = abs(cpu[s] - gpu[s]) / max(abs(cpu[s]), 1e-12)
        worst = max(worst, rel)
        print("%4d  %.8f  %.8f  %.2e" % (s, cpu[s], gpu[s], rel))
ok = len(cpu) == steps and sorted(cpu) == sorted(gpu) and worst <= tol
print("%d cpu / %d gpu steps, max relative difference %.3e (bound %.0e): %s" % (len(cpu), len(gpu), worst, tol, "PASS" if ok else "FAIL"))
sys.exit(0 if ok else 1)
'

# The tiny config trained 20 f32 steps on the GPU (device-resident state, harpe's kernels) and on the CPU
# by the same binary; the losses must agree to 1e-4 relative at every step (issue 10's parity target).
train_parity() {
  local bin="$1" dir steps=20
  dir="$(mktemp -d)"
  local common=(train --config configs/tiny-cpu.toml --set 'train.dtype="f32"' --set log.progress=false --steps "$steps")
  step "tiny config on the GPU ($steps f32 steps)" 120 "$bin" "${common[@]}" --set 'train.device="cuda"' --out "$dir/cuda"
  step "tiny config on the CPU ($steps f32 steps)" 120 "$bin" "${common[@]}" --set 'train.device="cpu"' --out "$dir/cpu"
  step "tiny config: GPU vs CPU losses (1e-4 relative)" 30 "$PY" -c "$PARITY_PY" "$dir/cpu/metrics.jsonl" "$dir/cuda/metrics.jsonl" "$steps" 1e-4
  # issue 12: NCCL with world size 1 equals Single (ZeRO-0: all-reduce; ZeRO-3: per-layer all-gather-v and
  # reduce-scatter-v, the grouped broadcasts/reduces, on device buffers)
  local z
  for z in 0 3; do
    step "tiny config over NCCL, 1 process, ZeRO-$z" 120 "$bin" "${common[@]}" --set 'train.device="cuda"' \
      --set 'dist.backend="nccl"' --set "dist.zero_stage=$z" --nproc-per-node 1 --out "$dir/nccl$z"
    step "tiny config: NCCL ZeRO-$z vs single-process GPU losses (1e-6 relative)" 30 "$PY" -c "$PARITY_PY" \
      "$dir/cuda/metrics.jsonl" "$dir/nccl$z/metrics.jsonl" "$steps" 1e-6
  done
  # Local: 2 rank threads sharing this GPU (ZeRO-3; and Ulysses SP 2) equal one rank (exchanges via the host)
  local name sets
  for name in zero3 sp2; do
    sets=(--set 'dist.zero_stage=3')
    [ "$name" = sp2 ] && sets=(--set 'dist.sp_degree=2' --set 'dist.zero_stage=1')
    step "tiny config, 2 Local ranks on one GPU ($name)" 120 "$bin" "${common[@]}" --set 'train.device="cuda"' \
      --set 'dist.backend="local"' --set 'dist.world_size=2' "${sets[@]}" --out "$dir/local_$name"
    step "tiny config: 2 Local ranks ($name) vs 1 rank on the GPU (1e-5 relative)" 30 "$PY" -c "$PARITY_PY" \
      "$dir/cuda/metrics.jsonl" "$dir/local_$name/metrics.jsonl" "$steps" 1e-5
  done
}

# Compares harpe plan's per-GPU total with the measured device peaks: argv = plan JSON, metrics.jsonl.
PLAN_PY='
import json, sys
plan = json.load(open(sys.argv[1]))
with open(sys.argv[2]) as f:
    peaks = [json.loads(l).get("device_peak_bytes") for l in f if l.strip() and "loss" in l]
peaks = [p for p in peaks if p]
if not peaks:
    sys.exit("no device_peak_bytes in " + sys.argv[2])
gib = 1 << 30
fixed = plan["terms"].get("fixed_overhead", 0)
measured, planned = max(peaks), plan["total_bytes"]
print("terms (GiB): " + ", ".join("%s %.2f" % (k, v / gib) for k, v in plan["terms"].items()))
print("planned %.2f GiB (%.2f without the fixed overhead, which the allocator peak does not see); measured peak %.2f GiB" % (planned / gib, (planned - fixed) / gib, measured / gib))
ratio = measured / (planned - fixed)
print("measured / planned-without-overhead = %.3f (goal: within 15%%)" % ratio)
sys.exit(0 if abs(ratio - 1) <= 0.15 else 1)
'

# Issue 13: harpe plan vs the measured peak for a Llama-2-7B-shaped layer stack (configs/gpu-plan-check.toml)
# at 16K and 32K tokens, 3 bf16 steps each on this GPU.
plan_vs_measured() { # BIN
  local bin="$1" dir t
  dir="$(mktemp -d)"
  for t in 16384 32768; do
    local sets=(--set "stage.0.seq_len=$t" --set "train.global_batch_tokens=$t")
    # the plan is host arithmetic (no GPU): its JSON goes to a file, its errors show in the comparison step
    timeout 30 "$bin" plan --config configs/gpu-plan-check.toml --gpus 1 --gpu h200 --json "${sets[@]}" >"$dir/plan$t.json" 2>&1
    step "train the 7B-shaped stack at T=$t (3 bf16 steps)" 150 "$bin" train --config configs/gpu-plan-check.toml "${sets[@]}" --out "$dir/run$t"
    step "plan vs measured at T=$t" 20 "$PY" -c "$PLAN_PY" "$dir/plan$t.json" "$dir/run$t/metrics.jsonl"
  done
}

# Issue 11 (flash attention): the attention benchmark, one step of its own (selftest's attention rows run in
# the selftest step). Budget: 18 rows of about 3 x 2 s each plus PyTorch's 54 (the 128K rows dominate).
attention_steps() { # BIN
  step "bench attention" 420 "$1" bench attention --attn-seconds 1
}
# The whole run shares one time budget (HARPE_GPU_CHECK_BUDGET seconds, default 450: GPU time is lent in
# minutes, and one rerun must fit): each step's limit is cut to what is left, and a step that would get
# under 15 s is recorded as skipped (and counts as a failure), never silently dropped.
DEADLINE=0
step() { # NAME TIMEOUT CMD... : run, record output and exit code in the report
  local name="$1" limit="$2"
  shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 15 ]; then
    FAILED=1
    echo "== $name: skipped (time budget spent)" >&2
    REPORT+=$'\n'"## $name"$'\n\n'"skipped: the run's time budget (HARPE_GPU_CHECK_BUDGET=${HARPE_GPU_CHECK_BUDGET:-450} s) was spent"$'\n'
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  local t0=$SECONDS out rc
  out="$(timeout "$limit" "$@" 2>&1)"
  rc=$?
  [ $rc -eq 0 ] || FAILED=1
  echo "== $name: exit $rc in $((SECONDS - t0)) s" >&2
  REPORT+=$'\n'"## $name"$'\n\n'"\`$*\` — exit code $rc, $((SECONDS - t0)) s (limit $limit s)"$'\n\n```\n'"$(printf '%s' "$out" | tail -n 80)"$'\n```\n'
}

run() {
  cd "$ROOT"
  [ -d "$BUNDLE" ] || die "no bundle at $BUNDLE; hint: run 'scripts/gpu-check.sh build' on the build machine and copy gpu-bundle/ here"
  local bin="$BUNDLE/harpe"
  if [ ! -x "$bin" ] && [ -f "$BUNDLE/harpe.zst" ]; then
    command -v zstd >/dev/null || die "harpe.zst needs zstd to unpack; hint: apt-get install zstd, or rebuild the bundle uncompressed"
    zstd -q -d "$BUNDLE/harpe.zst" -o "$BUNDLE/harpe" && chmod +x "$bin"
  fi
  [ -x "$bin" ] || die "$bin missing"
  command -v nvidia-smi >/dev/null || die "nvidia-smi not found: no NVIDIA driver on this machine"
  local libs
  libs="$(nvidia_libs)" || die "$PY failed; hint: set PYTHON to the python3 of the environment that has torch / the nvidia-*-cu13 wheels"
  [ -n "$libs" ] || die "no site-packages/nvidia/cu13/lib in $PY's environment; hint: pip install nvidia-cuda-runtime nvidia-cublas nvidia-curand nvidia-nccl-cu13 (or torch built for cu13x)"
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  local gpu driver cap
  IFS=',' read -r gpu driver cap < <(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader | head -n 1)
  local slug
  slug="$(echo "$gpu" | tr 'A-Z' 'a-z' | sed -E 's/nvidia//; s/[^a-z0-9]+/-/g; s/^-+|-+$//g')"
  local out="benches/results/gpu_${slug}_$(date +%Y%m).md"
  local seed=$(( $(date +%s) % 100000 ))
  DEADLINE=$((SECONDS + ${HARPE_GPU_CHECK_BUDGET:-450}))
  # most important first: kernels vs CPU references, GPU training vs CPU, the plan, then speed, then the
  # sanitizers (slowest per finding)
  # 300 s: the attention rows' T = 4096 + 37 case checks against the CPU reference and the naive bf16 bound
  step "selftest" 300 "$bin" selftest --target cuda --seed "$seed" --rounds 3
  train_parity "$bin"
  plan_vs_measured "$bin"
  step "bench" 180 "$bin" bench
  step "bench model" 120 "$bin" bench model --model-rows layer
  # the 7B step: ~20 s of random init (6.7B parameters), 3 steps at T ~ 32K on an H200, then torch's 3
  step "bench model (7B train step)" 180 "$bin" bench model --model-rows step
  # issue 12: the collectives over NCCL, one process (what one GPU's NCCL path costs; on an 8-GPU node
  # `bench comms --nproc-per-node 8` gives the bus bandwidth to compare with NVLink)
  step "bench comms (NCCL, 1 process)" 60 "$bin" bench comms --nproc-per-node 1 --comm-mib 1,64,512
  attention_steps "$bin"
  if command -v compute-sanitizer >/dev/null; then
    # HARPE_SELFTEST_SMALL: no T = 4096 + 37 attention case under the (10-100x slower) sanitizers
    export HARPE_SELFTEST_SMALL=1
    step "selftest under compute-sanitizer memcheck" 100 compute-sanitizer --tool memcheck --error-exitcode 1 "$bin" selftest --target cuda --seed "$seed" --rounds 1
    step "selftest under compute-sanitizer racecheck" 100 compute-sanitizer --tool racecheck --error-exitcode 1 "$bin" selftest --target cuda --seed "$seed" --rounds 1
    unset HARPE_SELFTEST_SMALL
  else
    REPORT+=$'\n'"## compute-sanitizer"$'\n\n'"not installed on this machine: memcheck/racecheck skipped."$'\n'
  fi
  {
    echo "# harpe on $gpu (driver $driver, compute capability $cap), $(date -u +%Y-%m-%d)"
    echo
    echo "Written by \`scripts/gpu-check.sh run\` from bundle commit $(cat "$BUNDLE/COMMIT" 2>/dev/null || echo unknown);"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH. Each section is one command with its exit code and the last 80 lines"
    echo "of its output."
    echo "$REPORT"
  } >"$out"
  echo "gpu-check: wrote $out (any step failed: $FAILED)" >&2
  exit $FAILED
}

case "${1:-}" in
  build) build ;;
  run) run ;;
  *) echo "usage: $0 build|run   (see the header of this script)" >&2; exit 2 ;;
esac
