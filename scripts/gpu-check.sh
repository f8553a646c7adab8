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
# `run` does, each step under its own timeout (the whole takes up to about 15 minutes with the attention
# benchmark):
#   1. finds libcudart/libcublas/libcurand (site-packages/nvidia/cu13/lib) and libnccl (nvidia/nccl/lib)
#      in python3's environment and puts them on LD_LIBRARY_PATH (the binary links them; cuda-build.md §2);
#   2. `harpe selftest` (every kernel vs its CPU reference, f32/bf16, fwd/bwd; exit 1 on FAIL), then its
#      small cases once more under compute-sanitizer memcheck and racecheck when the machine has it;
#   3. `harpe bench` (per-kernel GB/s vs measured copy bandwidth; PyTorch beside it when importable);
#   3b. `harpe bench attention` (flash attention fwd/bwd/fwd+bwd at T = 8K/32K/128K, TFLOP/s and % of peak,
#      PyTorch SDPA per backend beside it; `attention_steps` below);
#   4. the tiny config, 20 f32 steps, on the GPU and on the CPU with the same binary, and the two loss
#      curves compared step by step: they must agree to 1e-4 relative (`train_parity`);
#   5. the results file with every command's output and exit code. The script's exit code is 1 when any
#      step failed, so a caller sees it; the file is written either way.
# Environment: HARPE_GPU_BUNDLE (default gpu-bundle), PYTHON (default python3), CUDA_COMPUTE_CAP for
# build (default 80: PTX for A100, JIT-compiled on Hopper).
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
  CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}" nice -n 5 cargo build --release --features cuda --bin harpe
  local bin="${CARGO_TARGET_DIR:-$ROOT/target}/release/harpe"
  echo "gpu-check: cuda release build took $((SECONDS - t0)) s" >&2
  rm -rf "$BUNDLE" && mkdir -p "$BUNDLE"
  strip -o "$BUNDLE/harpe" "$bin"
  cp scripts/bench_kernels_torch.py scripts/bench_attention_torch.py "$BUNDLE/"
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
}

# Issue 11 (flash attention): the attention benchmark, one step of its own (selftest's attention rows run in
# the selftest step). Budget: 18 rows of about 3 x 2 s each plus PyTorch's 54 (the 128K rows dominate).
attention_steps() { # BIN
  step "bench attention" 420 "$1" bench attention --attn-seconds 1
}
step() { # NAME TIMEOUT CMD... : run, record output and exit code in the report
  local name="$1" limit="$2"
  shift 2
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
  # 300 s: the attention rows' T = 4096 + 37 case checks against the CPU reference and the naive bf16 bound
  step "selftest" 300 "$bin" selftest --target cuda --seed "$seed" --rounds 3
  if command -v compute-sanitizer >/dev/null; then
    # HARPE_SELFTEST_SMALL: no T = 4096 + 37 attention case under the (10-100x slower) sanitizers
    export HARPE_SELFTEST_SMALL=1
    step "selftest under compute-sanitizer memcheck" 100 compute-sanitizer --tool memcheck --error-exitcode 1 "$bin" selftest --target cuda --seed "$seed" --rounds 1
    step "selftest under compute-sanitizer racecheck" 100 compute-sanitizer --tool racecheck --error-exitcode 1 "$bin" selftest --target cuda --seed "$seed" --rounds 1
    unset HARPE_SELFTEST_SMALL
  else
    REPORT+=$'\n'"## compute-sanitizer"$'\n\n'"not installed on this machine: memcheck/racecheck skipped."$'\n'
  fi
  step "bench" 180 "$bin" bench
  attention_steps "$bin"
  train_parity "$bin"
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
