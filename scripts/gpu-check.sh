#!/usr/bin/env bash
# THE script for a GPU machine: check and time harpe's CUDA build there, and rehearse all of it here on CPU.
#
#   scripts/gpu-check.sh build              # here (no GPU; Rust + the CUDA toolchain from PyPI; HARPE_CUDA_MAJOR=12
#                                           # for the CUDA 12.4 build of R550+ drivers): the CUDA
#                                           # release binary, stripped, its NEEDED list checked, xz-compressed
#                                           # (Python's lzma unpacks it) into gpu-bundle/; prints the sizes and
#                                           # fails when bundle + tracked tree exceed 64 MiB
#   scripts/gpu-check.sh run [--second|--flash]  # on the GPU machine (no Rust, no network; python3 with the
#                                           # NVIDIA CUDA 13 wheels, e.g. torch cu130), from the repository
#                                           # root with gpu-bundle/ beside it
#   scripts/gpu-check.sh rehearse [--second|--flash]  # here, on CPU: the same `run` code end to end (CPU device,
#                                           # `selftest --target emulated`, the Local backend for the NCCL
#                                           # steps, CPU stand-ins for the CUDA-only benchmarks), same report
#   scripts/gpu-check.sh run --multi       # on a machine with N > 1 GPUs: the NCCL rows with N processes
#   scripts/gpu-check.sh steps [--second|--flash|--multi]  # the step plan (ids, limits, their sum) without running anything
#   scripts/gpu-check.sh sizes [DIR]        # the 64 MiB check of `build` on any bundle directory
#
# The report. `run` and `rehearse` write one Markdown file into HARPE_GPU_CHECK_OUT (default benches/results/
# for `run`, target/gpu-check-rehearse/ for `rehearse`; point it at the GPU machine's output folder, the
# only place whose files come back): a header first, then each step's section — command, its output
# streamed into the file while it runs (selftest rows appear as they are computed), exit code, wall time,
# PASS / FAIL / TIMEOUT — so a run cut short anywhere still leaves every row it made. Each step runs under
# `timeout -k` (harpe train traps SIGTERM for its checkpoint; -k ends it anyway).
#
# One budget, in priority order: HARPE_GPU_CHECK_BUDGET seconds (default 420), each step's limit cut to
# what is left, a step that no longer fits recorded as SKIPPED. The preflight's limits are generous
# ceilings (a cold machine loads ~1 GB of CUDA libraries and imports torch for the first time); what it
# uses comes out of the later steps, and `steps` plans it at PREFLIGHT_PLANNED seconds: that plus the later
# steps' limits fits the budget, and the first half leaves 15% of it unplanned (`steps` prints the slack),
# so a preflight three times as slow as planned (a cold torch import, a slow cuInit) cuts no later step.
# First run: preflight (fatal, 30 s each: ldd with anything "not found" named, harpe --version, the
# devices and free memory harpe sees; information only, 30 s each: nvidia-smi, torch's version and SDPA
# backends — a slow or missing torch costs its rows, never the run),
# `selftest --rounds 1`, tiny GPU-vs-CPU training parity (20 f32 steps), `bench attention` at 8K and 32K,
# then PyTorch SDPA on the same shapes as a step of its own, the decoder-layer bench at 4K, then torch's
# layer, NCCL with one process vs the single-process run (ZeRO-0 and ZeRO-3), `harpe plan` vs the measured
# reserved device peak at 32K on one 7B layer with an 8000-token vocabulary, where activations dominate (3 steps;
# the run is stopped once its 3rd step is logged, before its stage-end
# checkpoint, and its directory deleted). `--second`: the 7B training step at the largest T that fits,
# attention at 32K and then at 128K with the 128K step's limit sized from the 32K rows just measured
# (skipped with a note when the budget cannot hold it), selftest's small cases under compute-sanitizer
# memcheck and racecheck, 2 `Local` ranks sharing the GPU (ZeRO-3; Ulysses SP 2), plan vs measured at 32K.
# `--flash` (the flash-attn bundle, HARPE_GPU_BUNDLE=gpu-bundle-fa): selftest with the candle-flash-attn
# rows and FlashAttention-2's forward+backward rows (flash2), attention at 8K/32K and 128K with its column
# and the fa2-* rows, eval-ppl of one bf16 model through harpe's attention and through candle-flash-attn's,
# and 20 bf16 training steps with --attention harpe against --attention flash2. `--multi` (N > 1 GPUs): N NCCL processes (ZeRO 1, 2, 3 and Ulysses SP 2)
# against the one-process run, then 2 steps of the 128K recipe's layout (ZeRO-3, SP 2) on a 7B-shaped stack
# on all N GPUs with every rank's device peak logged; on one GPU each of these rows is reported as
# NEEDS 2+ GPUS (never left out silently), and the first half names them in one such row. Its rehearsal
# (`rehearse --multi`, run by CI with the gloo-featured debug harpe) takes 2 Gloo processes on the CPU.
# Every comparison states its bound and why (beside its step below).
# Every benchmark prints each row as it is measured, so a step stopped by its limit keeps its rows.
# Exit code 0 only when every step ran and passed (information rows aside); 1 otherwise, the failed steps
# named on stderr and in the report's summary (the report is complete either way).
#
# Environment: HARPE_GPU_CHECK_OUT, HARPE_GPU_CHECK_BUDGET, HARPE_GPU_CHECK_STEPS (comma-separated step
# ids to run, the others left out: tests), HARPE_GPU_CHECK_LIMIT_<ID> (tests: the limit in seconds of the
# steps of id ID, dashes written as underscores), HARPE_BIN (the harpe binary; default: gpu-bundle/harpe for
# `run`, target/release/harpe or else target/debug/harpe for `rehearse`), HARPE_GPU_BUNDLE (default
# gpu-bundle), PYTHON (default python3), CUDA_COMPUTE_CAP for build (default 80: candle's PTX for A100,
# JIT-compiled on Hopper; harpe's own kernels carry sm_80 and sm_90 SASS either way), HARPE_GPU_FEATURES
# for build (default nccl; flash-attn with HARPE_GPU_BUNDLE=gpu-bundle-fa: the second bundle, for
# `run --flash`, README "Build for GPUs").
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SELF="$ROOT/scripts/gpu-check.sh"
BUNDLE="${HARPE_GPU_BUNDLE:-$ROOT/gpu-bundle}"
PY="${PYTHON:-python3}"
LIMIT=$((64 * 1024 * 1024))
BUDGET="${HARPE_GPU_CHECK_BUDGET:-420}"
ONLY="${HARPE_GPU_CHECK_STEPS:-}"
# What the preflight is planned to use on a cold machine (its ceilings are 150 s): ldd < 1 s, --version and
# --devices 3-10 s each (the CUDA libraries load, cuInit), nvidia-smi 1-4 s, torch's import + cuInit 4-10 s.
PREFLIGHT_PLANNED=30

die() {
  echo "gpu-check: $*" >&2
  exit 1
}

# ---------------------------------------------------------------------------------------------- build

# The shared libraries a harpe binary may need: glibc's, libgcc_s, libstdc++, and (CUDA builds) the
# driver's libcuda and the CUDA/NCCL libraries NVIDIA's wheels ship (tests/tools/no_system_libs.rs: the CPU list).
ALLOWED_LIBS='^(libc|libm|libpthread|libdl|librt|libutil)\.so\.[0-9]+$|^ld-linux[-a-z0-9_.]*\.so\.[0-9]+$|^libgcc_s\.so\.1$|^libstdc\+\+\.so\.6$|^lib(cuda|cudart|cublas|cublasLt|curand|nccl|nvrtc)\.so(\.[0-9]+)*$'

needed() { # BIN: fail naming every NEEDED entry outside ALLOWED_LIBS
  local bin="$1" libs extra
  command -v readelf >/dev/null || die "readelf not found; hint: apt-get install binutils"
  libs="$(readelf -d "$bin" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')" || die "readelf -d $bin failed"
  echo "gpu-check: $bin needs: $(echo $libs)" >&2
  extra="$(printf '%s\n' $libs | grep -Ev "$ALLOWED_LIBS")"
  [ -z "$extra" ] || die "$bin needs libraries a GPU image need not have: $(echo $extra); hint: drop the crate feature that links them (cargo tree -e features -i <crate>)"
}

sizes() { # BUNDLE_DIR: print the sizes; fail when bundle + tracked tree exceed 64 MiB
  local dir="$1" bundle tracked total
  [ -d "$dir" ] || die "no bundle directory $dir; hint: run 'scripts/gpu-check.sh build' first"
  bundle=$(find "$dir" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
  tracked=$(git -C "$ROOT" ls-files -z | (cd "$ROOT" && xargs -0 stat -c %s 2>/dev/null) | awk '{s += $1} END {print s + 0}')
  total=$((bundle + tracked))
  find "$dir" -type f -printf '  %-40f %12s bytes\n' >&2
  printf 'gpu-check: bundle %d bytes (%.1f MiB) + tracked tree %d bytes (%.1f MiB) = %d bytes (%.1f MiB) of %.0f MiB\n' \
    "$bundle" "$(awk "BEGIN {print $bundle / 1048576}")" "$tracked" "$(awk "BEGIN {print $tracked / 1048576}")" \
    "$total" "$(awk "BEGIN {print $total / 1048576}")" "$(awk "BEGIN {print $LIMIT / 1048576}")" >&2
  [ "$total" -le "$LIMIT" ] || die "bundle + tracked tree is $total bytes, over the $LIMIT-byte limit; hint: build with CUDA_COMPUTE_CAP=80 (PTX only, no per-arch SASS), or leave the torch scripts out"
}

build() {
  set -e
  cd "$ROOT"
  local env_lines major="${HARPE_CUDA_MAJOR:-13}" prefix="$ROOT/target/cuda-toolchain" target="${CARGO_TARGET_DIR:-$ROOT/target}"
  # CUDA 12 (R550+ drivers): its own toolchain and target dir (cudarc takes its CUDA version from nvcc when built)
  if [ "$major" = 12 ]; then
    prefix="$ROOT/target/cuda12-toolchain"
    target="${CARGO_TARGET_DIR:-$ROOT/target/cu12}"
  fi
  env_lines="$(scripts/install-cuda-toolchain.sh "$prefix" "$major")" || die "toolchain install failed"
  eval "$env_lines"
  local t0=$SECONDS
  # nccl = cuda + the NCCL backend (the binary then needs libnccl.so.2, which the CUDA wheels ship)
  CARGO_TARGET_DIR="$target" nice -n 5 cargo build --release --features "${HARPE_GPU_FEATURES:-nccl}" --bin harpe
  local bin="$target/release/harpe"
  echo "gpu-check: CUDA $major release build took $((SECONDS - t0)) s" >&2
  rm -rf "$BUNDLE" && mkdir -p "$BUNDLE"
  strip -o "$BUNDLE/harpe" "$bin"
  set +e
  needed "$BUNDLE/harpe"
  cp scripts/bench_kernels_torch.py scripts/bench_attention_torch.py scripts/bench_model_torch.py "$BUNDLE/"
  git rev-parse HEAD >"$BUNDLE/COMMIT" 2>/dev/null || echo unknown >"$BUNDLE/COMMIT"
  # which GPUs the binary's SASS is for (candle-flash-attn's kernels are SASS only: sm_80 and sm_90 in a
  # flash-attn build); cuobjdump is not in the PyPI toolchain by default (nvidia-cuda-cuobjdump adds it)
  if command -v cuobjdump >/dev/null; then
    cuobjdump --list-elf "$bin" 2>/dev/null | grep -o 'sm_[0-9a-z]*' | sort | uniq -c >"$BUNDLE/SASS" || true
    echo "gpu-check: SASS in the binary (count per arch): $(tr -s ' \n' ' ' <"$BUNDLE/SASS")" >&2
  fi
  local raw
  raw=$(stat -c %s "$BUNDLE/harpe")
  # xz (or gzip): both unpack with Python's standard library (lzma, gzip) on a machine without the tools
  if command -v xz >/dev/null; then
    xz -9 -T0 "$BUNDLE/harpe" || die "xz failed"
  else
    gzip -9 "$BUNDLE/harpe" || die "gzip failed"
  fi
  echo "gpu-check: harpe $raw bytes stripped -> $(ls "$BUNDLE" | grep '^harpe\.') $(stat -c %s "$BUNDLE"/harpe.* ) bytes" >&2
  sizes "$BUNDLE"
  echo "gpu-check: $BUNDLE is ready; on the GPU machine run: HARPE_GPU_CHECK_OUT=<its output folder> scripts/gpu-check.sh run" >&2
}

# ------------------------------------------------------------------------------------ the run's steps

MODE=gpu  # gpu | rehearse | dry (steps)
HALF=first
REPORT=/dev/null
FAILED=0
FAILURES=()
DEADLINE=0
PLANNED=0
PREFLIGHT_CEILINGS=0
INFO=0
SUMMARY=()
WORK=""
BIN=""

want() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }
rehearse() { [ "$MODE" = rehearse ]; }
put() { printf '%s\n' "$@" >>"$REPORT"; }

# A failed step: the run's exit code becomes 1 and the step is named at the end.
failed() {
  FAILED=1
  FAILURES+=("$1")
}

# step ID NAME LIMIT CMD...: run CMD under `timeout -k`, its output streamed into the report; the section
# is complete (exit code, wall time, verdict) as soon as the step ends. Returns 0 on PASS. With INFO=1 the
# step is an information row: its verdict is recorded, and a FAIL or TIMEOUT does not fail the run.
step() {
  local id="$1" name="$2" limit="$3"
  shift 3
  want "$id" || return 0
  local over="HARPE_GPU_CHECK_LIMIT_${id//-/_}"
  [ -z "${!over:-}" ] || limit="${!over}"
  local kind=""
  [ "$INFO" = 1 ] && kind=" (information)"
  if [ "$MODE" = dry ]; then
    if [ "$id" = preflight ]; then
      PREFLIGHT_CEILINGS=$((PREFLIGHT_CEILINGS + limit))
    else
      PLANNED=$((PLANNED + limit))
    fi
    printf '%-16s %4d s  %s%s\n' "$id" "$limit" "$name" "$kind"
    return 0
  fi
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 5 ]; then
    [ "$INFO" = 1 ] || failed "$name (SKIPPED)"
    put "" "## $name" "" "**SKIPPED**: the run's budget (HARPE_GPU_CHECK_BUDGET=$BUDGET s) was spent."
    SUMMARY+=("| $id | $name$kind | SKIPPED | - | - |")
    echo "gpu-check: $name: SKIPPED (budget spent)" >&2
    return 1
  fi
  [ "$limit" -le "$left" ] || limit=$left
  local shown="" arg
  for arg in "$@"; do
    case "$arg" in *$'\n'*) shown+=" <inline script>" ;; *) shown+=" $arg" ;; esac
  done
  put "" "## $name" "" "\`${shown# }\` (limit $limit s)" "" '```'
  local t0=$SECONDS rc verdict=PASS
  timeout -k 10 "$limit" "$@" >>"$REPORT" 2>&1 </dev/null
  rc=$?
  local wall=$((SECONDS - t0))
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    verdict=TIMEOUT
  elif [ $rc -ne 0 ]; then
    verdict=FAIL
  fi
  put "" '```' "" "exit code $rc, $wall s (limit $limit s): **$verdict**$kind"
  SUMMARY+=("| $id | $name$kind | $verdict | $rc | $wall |")
  echo "gpu-check: $name: $verdict$kind (exit $rc, $wall s)" >&2
  [ "$verdict" = PASS ] && return 0
  [ "$INFO" = 1 ] || failed "$name ($verdict)"
  return 1
}

# info ID NAME LIMIT CMD...: `step` as an information row.
info() {
  INFO=1
  step "$@"
  local rc=$?
  INFO=0
  return $rc
}

# skip ID NAME WHY: a planned step that does not run, with the reason in the report (not a failure).
skip() {
  want "$1" || return 0
  [ "$MODE" = dry ] && return 0
  put "" "## $2" "" "**SKIPPED**: $3"
  SUMMARY+=("| $1 | $2 | SKIPPED | - | - |")
  echo "gpu-check: $2: SKIPPED ($3)" >&2
}

# needs ID NAME N HAVE: a planned step this machine cannot run for lack of GPUs: a NEEDS row in the report and
# its summary (not a failure, not silent).
needs() {
  want "$1" || return 0
  [ "$MODE" = dry ] && return 0
  put "" "## $2" "" "**NEEDS $3+ GPUS**: this machine has $4; run \`scripts/gpu-check.sh run --multi\` on one with $3 or more."
  SUMMARY+=("| $1 | $2 | NEEDS $3+ GPUS | - | - |")
  echo "gpu-check: $2: NEEDS $3+ GPUS (this machine has $4)" >&2
}

# How many GPUs nvidia-smi lists (0 without nvidia-smi).
gpu_count() {
  command -v nvidia-smi >/dev/null || { echo 0; return; }
  timeout 10 nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
}

# The glibc floor of the binary (harpe's floors::GLIBC_FLOOR; tests/tools/no_system_libs.rs holds this number
# to it): checked by the shell, because on an older glibc the loader stops harpe before it can say anything.
GLIBC_FLOOR=2.34
_glibc() {
  local v
  v="$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')"
  echo "glibc $v; harpe needs $GLIBC_FLOOR or newer"
  [ -n "$v" ] || exit 0
  [ "$(printf '%s\n%s\n' "$GLIBC_FLOOR" "$v" | sort -V | head -n 1)" = "$GLIBC_FLOOR" ] || {
    echo "glibc $v is older than $GLIBC_FLOOR; hint: run in a newer image (a container) or build harpe on this OS"
    exit 1
  }
}

# A note in the report (what a rehearsal stands in for, what was left out).
note() { [ "$MODE" = dry ] || put "" "> $*"; }

# Internal helpers, run under `timeout` through "$SELF" _NAME (timeout cannot run a shell function).
_ldd() { # BIN: ldd, failing with the missing libraries named
  ldd "$1" || exit 1
  local missing
  missing="$(ldd "$1" | awk '/not found/ {print $1}')"
  [ -z "$missing" ] || { echo "MISSING: $(echo $missing) (hint: put their directories on LD_LIBRARY_PATH)"; exit 1; }
}

_torch() { # torch's version, CUDA, device and SDPA backends; a note (exit 0) when torch does not import
  "$PY" - <<'PYEOF'
try:
    import torch
except Exception as e:  # noqa: BLE001 - any import failure is the answer
    print("torch does not import (%s: %s): the torch columns stay empty" % (type(e).__name__, e))
    raise SystemExit(0)
print("torch", torch.__version__, "built for CUDA", torch.version.cuda, "cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    free, total = torch.cuda.mem_get_info()
    print("device 0:", torch.cuda.get_device_name(0), "%.1f GiB free of %.1f GiB" % (free / 2**30, total / 2**30))
b = torch.backends.cuda
for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "cudnn_sdp_enabled", "math_sdp_enabled", "is_flash_attention_available"):
    f = getattr(b, name, None)
    print("  %-30s %s" % (name, f() if f else "n/a in this torch"))
PYEOF
}

# PyTorch's side of a benchmark, as a step of its own (information: the torch columns are optional). Runs
# SCRIPT ARGS... from scripts/ when torch imports with CUDA; otherwise says why and exits 0.
_torch_bench() { # SCRIPT ARGS...
  local script="$ROOT/scripts/$1"
  shift
  if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "torch does not import with CUDA here: no torch rows"
    exit 0
  fi
  "$PY" "$script" "$@"
}

# The 128K attention step's limit from the 32K rows in FILE (from line FROM on): a row is one warm-up and
# one timed call from T = 32K on, attention is quadratic in T (x16 at 128K), and per shape the bench runs one
# untimed forward (for O) plus warm-up and timed calls of fwd, bwd and fwd+bwd: 16 x (3 fwd + 2 bwd +
# 2 fwd+bwd) ms, and in a flash-attn build 16 x 2 candle-flash forwards (the last column of a full fwd
# row) and 16 x 2 of each of the fa2-fwd and fa2-fwd+bwd rows (FlashAttention-2's own), summed over the shapes, plus 20 s of setup, and 30 % slack. Prints the seconds, or nothing when
# FILE has no 32K rows.
_size_128k() { # FILE FROM
  tail -n +"$2" "$1" | awk '
    $2 == 32768 && $1 == "fwd" { f[$3] = $4; if (NF >= 9 && $NF ~ /^[0-9.]+$/) cf[$3] = $NF }
    $2 == 32768 && $1 == "bwd" { b[$3] = $4 }
    $2 == 32768 && $1 == "fwd+bwd" { fb[$3] = $4 }
    $2 == 32768 && ($1 == "fa2-fwd" || $1 == "fa2-fwd+bwd") { fa[$3] += $4 }
    END {
      for (h in fb) { ms += 16 * (3 * f[h] + 2 * b[h] + 2 * fb[h] + 2 * cf[h] + 2 * fa[h]); n++ }
      if (n) printf "%d\n", 1.3 * (ms / 1000 + 20) + 0.5
    }'
}

_to_file() { # FILE CMD...: CMD's stdout into FILE (stderr to the report)
  local f="$1"
  shift
  "$@" >"$f"
}

_train_until() { # N DIR CMD...: run a training CMD writing DIR until N steps are logged, then stop it
  local n="$1" metrics="$2/metrics.jsonl" pid rc
  shift 2
  "$@" &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    if [ -f "$metrics" ] && [ "$(grep -c '"grad_norm"' "$metrics")" -ge "$n" ]; then
      # the measurement is in; the stage-end checkpoint (~15 GB at the 7B shape) is not wanted
      echo "gpu-check: $n steps logged; stopping the run before its checkpoint (SIGKILL)"
      kill -9 "$pid" 2>/dev/null
      wait "$pid" 2>/dev/null
      exit 0
    fi
    sleep 0.5
  done
  wait "$pid"
  rc=$?
  [ $rc -eq 0 ] || exit $rc
  [ "$(grep -c '"grad_norm"' "$metrics" 2>/dev/null)" -ge "$n" ] || { echo "only $(grep -c '"grad_norm"' "$metrics" 2>/dev/null) of $n steps logged"; exit 1; }
}

# Compares the per-step losses of two metrics.jsonl files: argv = reference, candidate, steps, tolerance.
PARITY_PY='
import json, sys
def losses(p):
    with open(p) as f:
        recs = [json.loads(l) for l in f if l.strip()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r and "grad_norm" in r}
ref, cand = losses(sys.argv[1]), losses(sys.argv[2])
steps, tol = int(sys.argv[3]), float(sys.argv[4])
worst = 0.0
print("step  reference    candidate    rel diff")
for s in sorted(ref):
    if s in cand:
        rel = abs(ref[s] - cand[s]) / max(abs(ref[s]), 1e-12)
        worst = max(worst, rel)
        print("%4d  %.8f  %.8f  %.2e" % (s, ref[s], cand[s], rel))
ok = len(ref) == steps and sorted(ref) == sorted(cand) and worst <= tol
print("%d / %d steps, max relative difference %.3e (bound %.0e): %s" % (len(ref), len(cand), worst, tol, "PASS" if ok else "FAIL"))
sys.exit(0 if ok else 1)
'

# harpe plan vs the measured peak: argv = plan JSON, metrics.jsonl, "gpu" | "rehearse". A rehearsal (CPU:
# no device peak) prints the host RSS peak beside the plan and does not judge the ratio.
PLAN_PY='
import json, sys
plan = json.load(open(sys.argv[1]))
with open(sys.argv[2]) as f:
    recs = [json.loads(l) for l in f if l.strip() and "grad_norm" in l]
rehearse = sys.argv[3] == "rehearse"
# the reserved peak of the pool (allocated + its free fragments) is what the device could not give to anything
# else: the gate reads it, so fragmentation counts against the plan; the allocated peak is printed beside it
key = "step_peak_bytes" if rehearse else "device_reserved_peak_bytes"
peaks = [r.get(key) for r in recs if r.get(key)]
if not peaks:
    sys.exit("no %s in %s" % (key, sys.argv[2]))
gib = 1 << 30
fixed = plan["terms"].get("fixed_overhead", 0)
measured, planned = max(peaks), plan["total_bytes"]
print("terms (GiB): " + ", ".join("%s %.3f" % (k, v / gib) for k, v in plan["terms"].items()))
alloc = [r.get("device_peak_bytes") for r in recs if r.get("device_peak_bytes")]
if alloc:
    print("allocated peak %.3f GiB; reserved peak %.3f GiB" % (max(alloc) / gib, measured / gib))
for r in recs[-1:]:
    for i, (a, res) in enumerate(r.get("device_peaks_by_rank", [])):
        print("rank %d: allocated %.3f GiB, reserved %.3f GiB" % (i, a / gib, res / gib))
print("planned %.3f GiB (%.3f without the fixed overhead, which the allocator peak does not see); measured %s %.3f GiB" % (planned / gib, (planned - fixed) / gib, key, measured / gib))
ratio = measured / max(planned - fixed, 1)
print("measured / planned-without-overhead = %.3f (goal: within 15%%)" % ratio)
if rehearse:
    print("rehearsal: the CPU has no device peak; the host RSS is not what the plan sizes, so the ratio is not judged")
    sys.exit(0)
sys.exit(0 if abs(ratio - 1) <= 0.15 else 1)
'

TINY=(train --config configs/tiny-cpu.toml --set 'train.dtype="f32"' --set log.progress=false --set log.plot=false --steps 20)

# The device of the "GPU" runs: cuda, or the CPU in a rehearsal.
gpu_dev() { if rehearse; then echo '"cpu"'; else echo '"cuda"'; fi; }

# Only what every later step needs is fatal: the binary loads, runs, and sees the device. nvidia-smi and
# torch are information: without them the run loses the GPU's description and the torch columns, nothing else.
preflight() {
  if rehearse; then
    note "rehearsal on $(hostname): no GPU; the host stands in for nvidia-smi"
    info preflight "preflight: host (rehearsal)" 30 sh -c 'nproc; free -m; uname -sr'
  else
    info preflight "preflight: nvidia-smi" 30 nvidia-smi --query-gpu=index,name,driver_version,compute_cap,memory.total,memory.used,memory.free --format=csv
  fi
  step preflight "preflight: glibc floor" 5 "$SELF" _glibc
  step preflight "preflight: shared libraries (ldd)" 30 "$SELF" _ldd "$BIN"
  step preflight "preflight: harpe --version" 30 "$BIN" --version
  step preflight "preflight: devices harpe sees" 30 "$BIN" selftest --devices
  info preflight "preflight: torch and its SDPA backends" 30 "$SELF" _torch
}

# 65 s: the f64 CPU references (~20-30 s) and the JIT compile of the candle PTX modules the ops touch; harpe's
# own kernels load as SASS on sm_80 and sm_90 (build.rs), so their JIT (the attention file alone has 38
# entries) is no longer in it. Later steps find candle's compiled modules in the driver's JIT cache.
selftest_step() {
  if rehearse; then
    step selftest "selftest (emulated kernels, 1 round)" 65 "$BIN" selftest --target emulated --seed "$SEED" --rounds 1
  else
    step selftest "selftest (every kernel vs its reference, 1 round)" 65 "$BIN" selftest --target cuda --seed "$SEED" --rounds 1
  fi
}

# The tiny config trained 20 f32 steps on the GPU (device-resident state, harpe's kernels) and on the CPU
# by the same binary; the losses must agree to 1e-4 relative at every step. The bound: f32 on both, so what
# differs is the order of every reduction (GEMM tiles, row sums, the loss). A reordered f32 sum of n terms
# moves by at most (n - 1) 2^-24 of the sum of their magnitudes; the tiny model's longest is the MLP's
# down projection, n = 192: 1.1e-5 at the worst per op, ~1e-6 typically (random signs: sqrt(n) 2^-24).
# Twenty AdamW steps carry such differences into the weights (an update moves by at most lr per element,
# so their relative part stays of the same order), and the loss sums many such terms: 1e-4 is ~10x the
# per-op worst case, a margin for the ~10 ops a layer chains, not for a wrong kernel (which moves the loss
# at 1e-2 and beyond within a few steps).
parity() {
  local d="$WORK/parity"
  rehearse && note "rehearsal: the \"GPU\" run is a second CPU run (the comparison code is what is rehearsed)"
  step parity "tiny config on the GPU (20 f32 steps)" 20 "$BIN" "${TINY[@]}" --set "train.device=$(gpu_dev)" --out "$d/gpu"
  step parity "tiny config on the CPU (20 f32 steps)" 15 "$BIN" "${TINY[@]}" --set 'train.device="cpu"' --out "$d/cpu"
  step parity "tiny config: GPU vs CPU losses (1e-4 relative)" 3 "$PY" -c "$PARITY_PY" "$d/cpu/metrics.jsonl" "$d/gpu/metrics.jsonl" 20 1e-4
}

# harpe's attention rows (--no-torch), then PyTorch SDPA's on the same shapes as an information step.
attention() { # ID T-LIST LIMIT
  if rehearse; then
    note "rehearsal: \`harpe bench attention\` is CUDA-only; the CPU decoder layer and training step (attention included) stand in"
    step "$1" "bench attention at T = $2 (rehearsal: CPU decoder layer and step)" "$3" "$BIN" bench model --model-rows layer,step --device cpu --iters 2
  else
    step "$1" "bench attention at T = $2 (harpe)" "$3" "$BIN" bench attention --no-torch --attn-tokens "$2" --attn-seconds 0.5
  fi
}

attention_torch() { # ID T-LIST LIMIT
  info "$1" "PyTorch SDPA at T = $2 (the torch columns of the attention rows)" "$3" "$SELF" _torch_bench \
    bench_attention_torch.py --tokens "$2" --seconds 0.5
}

# The 128K rows, their limit sized from a 32K step measured just before (one warm-up + one timed call per
# row, so their cost scales with T^2 from it): skipped with a note when the budget cannot hold them.
attention_128k() { # CAP
  local cap="$1" from=1 need left
  [ "$MODE" = dry ] || from=$(($(wc -l <"$REPORT") + 1))
  attention attention-128k "32768" 20
  if [ "$MODE" = dry ]; then
    step attention-128k "bench attention at T = 131072 (harpe; limit from the 32K rows, at most)" "$cap" true
    return
  fi
  want attention-128k || return 0
  need="$("$SELF" _size_128k "$REPORT" "$from")"
  left=$((DEADLINE - SECONDS))
  if [ -z "$need" ]; then
    skip attention-128k "bench attention at T = 131072" "no 32K rows to size it from (the 32K step above failed, or a rehearsal's stand-in ran)"
  elif [ "$need" -gt "$cap" ] || [ "$need" -gt "$left" ]; then
    skip attention-128k "bench attention at T = 131072" "the 32K rows predict $need s; the step may take $cap s and the budget has $left s left"
  else
    note "the 128K limit: $need s, from the 32K rows (16 x their calls, +20 s setup, +30 %)"
    step attention-128k "bench attention at T = 131072 (harpe)" "$need" "$BIN" bench attention --no-torch --attn-tokens 131072 --attn-seconds 0.5
  fi
}

layer() {
  if rehearse; then
    step layer "bench model: decoder layer (rehearsal: CPU, T 128)" 45 "$BIN" bench model --model-rows layer --device cpu --iters 2
  else
    step layer "bench model: Llama-2-7B decoder layer at T = 4096 (harpe)" 35 "$BIN" bench model --no-torch --model-rows layer --model-tokens 4096
  fi
  info layer-torch "PyTorch: Llama-2-7B decoder layer at T = 4096" 25 "$SELF" _torch_bench bench_model_torch.py \
    --hidden 4096 --heads 32 --kv-heads 32 --inter 11008 --tokens 4096 --vocab 32000 --layers 1 --iters 20 --layer-only
}

# NCCL with one process equals the single-process run (ZeRO-0: all-reduce; ZeRO-3: per-layer
# all-gather-v and reduce-scatter-v on device buffers). A rehearsal runs the Local backend with one rank.
# The bound, 2^-22 relative (4 f32 ulps): with one process every collective is a copy, so the two runs can
# differ only where the GPU's order of arithmetic can — the f32 atomicAdd of dQ in attention's backward
# (kernels/attention.cu; nothing else in the step uses atomics). At the tiny config's T = 64 with key tiles
# of 32 (D = 16), a dQ element receives at most two atomic adds into a zeroed accumulator, and
# 0 + a + b = 0 + b + a exactly (f32 addition commutes; only a third term makes the order matter), so the
# losses are expected bit for bit equal: the 4 ulps cover printing, not noise. A config with n > 2 key tiles
# per row would move dQ by up to (n - 2) 2^-24 per step: widen the bound with it.
nccl() {
  local d="$WORK/nccl" z backend=(--set 'dist.backend="nccl"' --nproc-per-node 1)
  rehearse && backend=(--set 'dist.backend="local"' --set dist.world_size=1)
  rehearse && note "rehearsal: the Local backend with one rank stands in for NCCL with one process"
  step nccl "tiny config, single process (the reference)" 10 "$BIN" "${TINY[@]}" --set "train.device=$(gpu_dev)" --out "$d/single"
  for z in 0 3; do
    step nccl "tiny config over NCCL, 1 process, ZeRO-$z" 15 "$BIN" "${TINY[@]}" --set "train.device=$(gpu_dev)" \
      "${backend[@]}" --set "dist.zero_stage=$z" --out "$d/nccl$z"
    step nccl "tiny config: NCCL ZeRO-$z vs single process (2^-22 relative)" 3 "$PY" -c "$PARITY_PY" \
      "$d/single/metrics.jsonl" "$d/nccl$z/metrics.jsonl" 20 2.4e-7
  done
}

# harpe plan vs the measured peak for the Llama-2-7B-shaped stack (configs/gpu-plan-check.toml),
# 3 bf16 steps, stopped before its checkpoint; a rehearsal plans and runs the tiny config on the CPU.
# LAYERS/VOCAB (optional) shrink the stack so the activations, not the model states, are most of the peak:
# at T = 32768 one 7B layer with an 8000-token vocabulary keeps ~6.5 GB of one layer's graph against
# ~4.3 GB of weights, gradients and AdamW state, so an error in the activation count shows.
plan_vs_measured() { # ID T [LAYERS VOCAB]
  local id="$1" t="$2" d="$WORK/plan$2" cfg=configs/gpu-plan-check.toml
  local sets=(--set "stage.0.seq_len=$t" --set "train.global_batch_tokens=$t") gpu=(--gpu h200)
  [ -z "${3:-}" ] || sets+=(--set "model.init.num_hidden_layers=$3" --set "model.init.vocab_size=$4")
  if rehearse; then
    cfg=configs/tiny-cpu.toml
    sets=(--set 'train.dtype="f32"' --set log.progress=false --set log.plot=false)
    gpu=()
    note "rehearsal: the tiny config on the CPU (a CPU plan) stands in for the 7B-shaped stack at T = $t"
  fi
  step "$id" "harpe plan at T = $t" 5 "$SELF" _to_file "$d.json" "$BIN" plan --config "$cfg" --gpus 1 "${gpu[@]}" --json "${sets[@]}"
  step "$id" "train at T = $t (3 steps, stopped before the checkpoint)" 50 "$SELF" _train_until 3 "$d" "$BIN" train --config "$cfg" "${sets[@]}" --out "$d"
  step "$id" "plan vs measured at T = $t" 3 "$PY" -c "$PLAN_PY" "$d.json" "$d/metrics.jsonl" "$MODE"
  [ "$MODE" = dry ] || rm -rf "$d"
}

sanitizer() {
  if rehearse; then
    note "rehearsal: no compute-sanitizer; the same small selftest runs on the emulated kernels"
    export HARPE_SELFTEST_SMALL=1
    step sanitizer "selftest small cases (rehearsal: emulated, for memcheck)" 40 "$BIN" selftest --target emulated --seed "$SEED" --rounds 1
    step sanitizer "selftest small cases (rehearsal: nothing, for racecheck)" 40 true
    unset HARPE_SELFTEST_SMALL
  elif command -v compute-sanitizer >/dev/null || [ "$MODE" = dry ]; then
    # HARPE_SELFTEST_SMALL: no T = 4096 + 37 attention case under the (10-100x slower) sanitizers
    export HARPE_SELFTEST_SMALL=1
    step sanitizer "selftest under compute-sanitizer memcheck" 40 compute-sanitizer --tool memcheck --error-exitcode 1 "$BIN" selftest --target cuda --seed "$SEED" --rounds 1
    step sanitizer "selftest under compute-sanitizer racecheck" 40 compute-sanitizer --tool racecheck --error-exitcode 1 "$BIN" selftest --target cuda --seed "$SEED" --rounds 1
    unset HARPE_SELFTEST_SMALL
  else
    failed "compute-sanitizer (NOT RUN)"
    put "" "## compute-sanitizer" "" "**NOT RUN**: compute-sanitizer is not installed on this machine (memcheck/racecheck)."
    SUMMARY+=("| sanitizer | compute-sanitizer memcheck/racecheck | NOT RUN | - | - |")
  fi
}

# 2 Local rank threads sharing one GPU (ZeRO-3; Ulysses SP 2) equal one rank to 1e-5. The bound: with two
# ranks the gradient of each element is a sum over the ranks' micro-batches in another grouping, and SP 2
# runs attention and its projections at half the heads (other GEMM shapes, so cuBLAS may pick other tilings
# and other summation orders in every matmul): per op at most (n - 1) 2^-24 relative for n = 192 terms
# (1.1e-5), ~sqrt(n) 2^-24 = 8e-7 typically; 1e-5 holds the typical case of ~10 chained ops with margin.
local_ranks() {
  local d="$WORK/local" name sets
  step local "tiny config, 1 rank (the reference)" 10 "$BIN" "${TINY[@]}" --set "train.device=$(gpu_dev)" --out "$d/one"
  for name in zero3 sp2; do
    sets=(--set 'dist.zero_stage=3')
    [ "$name" = sp2 ] && sets=(--set 'dist.sp_degree=2' --set 'dist.zero_stage=1')
    step local "tiny config, 2 Local ranks on one device ($name)" 20 "$BIN" "${TINY[@]}" --set "train.device=$(gpu_dev)" \
      --set 'dist.backend="local"' --set 'dist.world_size=2' "${sets[@]}" --out "$d/$name"
    step local "tiny config: 2 Local ranks ($name) vs 1 rank (1e-5 relative)" 3 "$PY" -c "$PARITY_PY" \
      "$d/one/metrics.jsonl" "$d/$name/metrics.jsonl" 20 1e-5
  done
}

step7b() {
  if rehearse; then
    step step7b "bench model: training step (rehearsal: CPU, 2 layers)" 100 "$BIN" bench model --model-rows step --device cpu --iters 2
  else
    # ~20 s of random init (6.7B parameters), 1 warm-up + 2 steps at the largest T that fits, then torch's
    step step7b "bench model: Llama-2-7B training step at the largest T (harpe)" 100 "$BIN" bench model --no-torch --model-rows step
  fi
}

first_half() {
  selftest_step
  parity
  attention attention 8192,32768 35
  attention_torch attention-torch 8192,32768 25
  layer
  nccl
  [ "$MODE" = dry ] || rehearse || [ "$(gpu_count)" -ge 2 ] || needs multi "NCCL with N processes and the 128K layout on N GPUs (run --multi)" 2 "$(gpu_count)"
  plan_vs_measured plan 32768 1 8000
}

second_half() {
  step7b
  attention_128k 60
  sanitizer
  local_ranks
  plan_vs_measured plan-32k 32768
}

# Several GPUs, one NCCL process each: 20 f32 steps of the tiny config at ZeRO 1, 2, 3 and Ulysses SP 2
# (ZeRO-1) equal the one-process run to 1e-5 relative. The bound: with N ranks each gradient element is a
# sum over the ranks' micro-batches in another grouping (NCCL's ring or tree order), and SP runs attention
# and its projections at 1/P of the heads, so cuBLAS may take other tilings: per op at most (n - 1) 2^-24
# relative for n = 192 terms, ~sqrt(n) 2^-24 typically; 1e-5 holds ~10 chained ops with margin (as the
# Local ranks of the second half). Then the 128K recipe's layout (ZeRO-3, SP 2) on the 7B-shaped stack of
# configs/gpu-plan-check.toml at T = 32768 for 2 bf16 steps on all N GPUs, stopped before its checkpoint,
# every rank's device peak (allocated and reserved) in its log.
MULTI_ROWS=(z1 z2 z3 sp2)
multi_half() {
  local d="$WORK/multi" n backend=nccl r z sets
  if [ "$MODE" = dry ]; then
    n=2
  elif rehearse; then
    n=2 backend=gloo
    note "rehearsal: 2 Gloo processes on the CPU stand in for N NCCL processes on N GPUs (a binary built with --features gloo)"
  else
    n="$(gpu_count)"
  fi
  if [ "$n" -lt 2 ]; then
    for r in "${MULTI_ROWS[@]}"; do needs multi "tiny config over NCCL, N processes ($r) vs 1 process" 2 "$n"; done
    needs multi-128k "128K recipe's layout (ZeRO-3, SP 2), 2 steps on N GPUs" 2 "$n"
    return
  fi
  step multi "tiny config, 1 process (the reference)" 15 "$BIN" "${TINY[@]}" --set "train.device=$(gpu_dev)" --out "$d/one"
  for r in "${MULTI_ROWS[@]}"; do
    case "$r" in
      sp2) sets=(--set dist.zero_stage=1 --set dist.sp_degree=2) ;;
      *) sets=(--set "dist.zero_stage=${r#z}") ;;
    esac
    step multi "tiny config over $backend, $n processes ($r)" 40 "$BIN" "${TINY[@]}" --set "train.device=$(gpu_dev)" \
      --set "dist.backend=\"$backend\"" --nproc-per-node "$n" "${sets[@]}" --out "$d/$r"
    step multi "tiny config: $n processes ($r) vs 1 process (1e-5 relative)" 3 "$PY" -c "$PARITY_PY" \
      "$d/one/metrics.jsonl" "$d/$r/metrics.jsonl" 20 1e-5
  done
  local cfg=configs/gpu-plan-check.toml lay=(--set stage.0.seq_len=32768 --set train.global_batch_tokens=32768)
  if rehearse; then
    cfg=configs/tiny-cpu.toml lay=(--set 'train.dtype="f32"' --set log.progress=false --set log.plot=false)
    note "rehearsal: the tiny config on the CPU stands in for the 7B-shaped stack at T = 32768"
  fi
  step multi-128k "128K recipe's layout (ZeRO-3, SP 2), 2 steps on $n ranks" 120 "$SELF" _train_until 2 "$d/layout" \
    "$BIN" train --config "$cfg" "${lay[@]}" --set "train.device=$(gpu_dev)" --set "dist.backend=\"$backend\"" \
    --set dist.zero_stage=3 --set dist.sp_degree=2 --nproc-per-node "$n" --out "$d/layout"
  step multi-128k "every rank's device peak of the layout run" 3 sh -c "grep -h 'peak' '$d/layout/metrics.jsonl' | tail -n 2"
}

# The flash-attn bundle's half (HARPE_GPU_BUNDLE=gpu-bundle-fa, built with HARPE_GPU_FEATURES=flash-attn: no
# NCCL): selftest with its candle-flash-attn rows, bench attention with its column, and eval-ppl of one bf16
# model (the tiny config at head dim 64, trained 20 steps on the GPU) through harpe's attention and through
# candle-flash-attn's: the mean NLLs must agree to 1e-2 relative. The bound: both accumulate in f32 and
# round O to bf16 once (8 significant bits: at most 2^-9 = 2e-3 relative per element), so the two O differ
# by up to 2 x 2^-9 = 3.9e-3 per element; through two layers and the lm head such differences move the
# logits, and the mean NLL of 8160 tokens averages their signs: 1e-2 is 2.5 x the per-element bf16
# difference, far below what a wrong attention (a wrong mask or scale moves the NLL by 1e-1 and more) gives.
FLASH_MODEL=(--set model.init.hidden_size=256 --set model.init.intermediate_size=512)

# Compares the `nll` of two eval-ppl --json files: argv = reference, candidate, tolerance.
NLL_PY='
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
tol = float(sys.argv[3])
rel = abs(a["nll"] - b["nll"]) / max(abs(a["nll"]), 1e-12)
print("reference nll %.6f (%d tokens, %.0f tok/s); candidate nll %.6f (%d tokens, %.0f tok/s); relative difference %.2e (bound %.0e)"
      % (a["nll"], a["tokens"], a["tokens_per_s"], b["nll"], b["tokens"], b["tokens_per_s"], rel, tol))
sys.exit(0 if a["tokens"] == b["tokens"] and rel <= tol else 1)
'

flash_eval() {
  local d="$WORK/flash" ck dev=cuda cand=candle-flash
  if rehearse; then
    dev=cpu cand=harpe
    note "rehearsal: candle-flash-attn is CUDA-only; both eval-ppl runs use harpe's attention on the CPU (the comparison code is what is rehearsed)"
  fi
  step flash-ppl "tiny config at head dim 64 on the GPU (20 f32 steps)" 40 "$BIN" "${TINY[@]}" "${FLASH_MODEL[@]}" \
    --set "train.device=$(gpu_dev)" --out "$d/run"
  ck="$d/run/checkpoints/step_000020"
  local side a
  for side in reference candidate; do
    a=harpe
    [ "$side" = candidate ] && a="$cand"
    step flash-ppl "eval-ppl bf16, $side: --attention $a (8K tokens of README.md, window 256)" 20 "$SELF" _to_file \
      "$d/ppl-$side.json" "$BIN" eval-ppl --model "$ck" --tokenizer "$d/run/tokenizer.json" --input README.md \
      --max-tokens 8192 --window 256 --stride 256 --dtype bf16 --device "$dev" --attention "$a" --json
  done
  step flash-ppl "eval-ppl: candle-flash-attn vs harpe's attention (1e-2 relative)" 3 "$PY" -c "$NLL_PY" \
    "$d/ppl-reference.json" "$d/ppl-candidate.json" 1e-2
}

# FlashAttention-2's own backward in training against harpe's kernels: the tiny config at head dim 64 in
# bf16, 20 steps from the same seed with --attention harpe and with --attention flash2, on the GPU; the
# losses must agree to 2e-2 relative. The bound: each step's attention outputs and gradients differ by
# bf16 roundings (2^-9 relative per element, both round once from f32), which the 20 updates carry into the
# weights; a wrong backward (a lost scale, a wrong mask or GQA sum) bends the loss curve by more than 1e-1
# within those steps.
flash_train() {
  local d="$WORK/flash-train" a=flash2
  if rehearse; then
    a=harpe
    note "rehearsal: FlashAttention-2 is CUDA-only; both training runs use harpe's attention on the CPU (the comparison code is what is rehearsed)"
  fi
  step flash-train "tiny config bf16 at head dim 64, --attention harpe (20 steps)" 40 "$BIN" "${TINY[@]}" \
    "${FLASH_MODEL[@]}" --set 'train.dtype="bf16"' --set "train.device=$(gpu_dev)" --attention harpe --out "$d/harpe"
  step flash-train "tiny config bf16 at head dim 64, --attention $a (20 steps)" 40 "$BIN" "${TINY[@]}" \
    "${FLASH_MODEL[@]}" --set 'train.dtype="bf16"' --set "train.device=$(gpu_dev)" --attention "$a" --out "$d/flash2"
  step flash-train "training losses: --attention $a vs harpe (2e-2 relative)" 3 "$PY" -c "$PARITY_PY" \
    "$d/harpe/metrics.jsonl" "$d/flash2/metrics.jsonl" 20 2e-2
}

flash_half() {
  selftest_step
  attention attention 8192,32768 35
  flash_eval
  flash_train
  attention_128k 60
}

# The harpe binary: HARPE_BIN, else the bundle's (unpacked with Python's lzma/gzip when compressed), else
# (rehearsal) the CPU build in target/.
find_bin() {
  if [ -n "${HARPE_BIN:-}" ]; then
    BIN="$HARPE_BIN"
  elif rehearse; then
    BIN="$ROOT/target/release/harpe"
    [ -x "$BIN" ] || BIN="$ROOT/target/debug/harpe"
    [ -x "$BIN" ] || die "no harpe binary in target/; hint: cargo build --release (or set HARPE_BIN)"
  else
    [ -d "$BUNDLE" ] || die "no bundle at $BUNDLE; hint: run 'scripts/gpu-check.sh build' on the build machine and copy gpu-bundle/ here"
    BIN="$BUNDLE/harpe"
    local packed
    for packed in "$BUNDLE/harpe.xz" "$BUNDLE/harpe.gz"; do
      if [ ! -x "$BIN" ] && [ -f "$packed" ]; then
        "$PY" -c 'import sys, shutil, lzma, gzip
op = lzma.open if sys.argv[1].endswith(".xz") else gzip.open
with op(sys.argv[1]) as f, open(sys.argv[2], "wb") as g:
    shutil.copyfileobj(f, g)' "$packed" "$BIN" && chmod +x "$BIN" || die "cannot unpack $packed with $PY"
      fi
    done
  fi
  [ -x "$BIN" ] || die "$BIN missing or not executable"
  case "$BIN" in /*) ;; *) BIN="$PWD/$BIN" ;; esac
}

# site-packages dirs of python3 that hold nvidia/cu13/lib (CUDA 13 wheels), nvidia/nccl/lib, and the cu12
# wheels' per-library dirs (a CUDA 12 build on a torch cu12x machine).
nvidia_libs() {
  "$PY" - <<'PYEOF' 2>/dev/null
import os, site, sys
dirs = []
for p in list(site.getsitepackages()) + [site.getusersitepackages()] + sys.path:
    for sub in ("nvidia/cu13/lib", "nvidia/nccl/lib", "nvidia/cuda_runtime/lib", "nvidia/cublas/lib",
                "nvidia/curand/lib", "nvidia/cuda_nvrtc/lib"):
        d = os.path.join(p, sub)
        if os.path.isdir(d) and d not in dirs:
            dirs.append(d)
print(":".join(dirs))
PYEOF
}

# Every half starts with the preflight; a failed fatal preflight row (the binary does not load, run, or see
# the device) ends the run there.
half() {
  preflight
  if [ "$FAILED" -ne 0 ] && [ "$MODE" != dry ]; then
    put "" "**The preflight failed: the run stops here** (the sections above say why)."
    return
  fi
  case "$HALF" in
    second) second_half ;;
    flash) flash_half ;;
    multi) multi_half ;;
    *) first_half ;;
  esac
}

run() {
  cd "$ROOT"
  if [ "$MODE" = dry ]; then
    SEED=0 BIN=harpe WORK=/nonexistent
    half
    local total=$((PLANNED + PREFLIGHT_PLANNED))
    echo "preflight ceilings: $PREFLIGHT_CEILINGS s, planned at $PREFLIGHT_PLANNED s (what it uses comes out of the later steps)"
    echo "total of the step limits: $total s (the preflight's $PREFLIGHT_PLANNED s + the later steps' $PLANNED s; budget $BUDGET s)"
    echo "slack: $((BUDGET - total)) s ($((100 * (BUDGET - total) / BUDGET))% of the budget: what a preflight slower than planned may use before a later step is cut)"
    [ "$total" -le "$BUDGET" ] || die "the step limits ($total s) exceed the budget ($BUDGET s); hint: raise HARPE_GPU_CHECK_BUDGET or leave steps out with HARPE_GPU_CHECK_STEPS"
    return 0
  fi
  find_bin
  local out_dir slug gpu="cpu" driver="-" cap="-"
  if rehearse; then
    out_dir="${HARPE_GPU_CHECK_OUT:-$ROOT/target/gpu-check-rehearse}"
    slug="rehearse-cpu"
  else
    out_dir="${HARPE_GPU_CHECK_OUT:-$ROOT/benches/results}"
    local libs
    libs="$(nvidia_libs)"
    [ -n "$libs" ] && export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    if command -v nvidia-smi >/dev/null; then
      IFS=',' read -r gpu driver cap < <(timeout 5 nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader | head -n 1)
    else
      gpu="no-nvidia-smi"
    fi
    slug="gpu-check_$(echo "$gpu" | tr 'A-Z' 'a-z' | sed -E 's/nvidia//; s/[^a-z0-9]+/-/g; s/^-+|-+$//g')"
  fi
  mkdir -p "$out_dir" || die "cannot create $out_dir"
  local base="$out_dir/${slug}_$(date +%Y%m)" n=1
  [ "$HALF" = first ] || base="${base}_$HALF"
  REPORT="$base.md"
  while [ -e "$REPORT" ]; do n=$((n + 1)) && REPORT="$base-$n.md"; done
  WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")" || die "mktemp failed"
  trap 'rm -rf "$WORK"' EXIT
  SEED=$(($(date +%s) % 100000))
  echo "gpu-check: writing $REPORT" >&2
  {
    echo "# harpe gpu-check ($MODE, $HALF half) on $gpu (driver $driver, compute capability $cap), $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "Written by \`scripts/gpu-check.sh ${ARGS[*]}\` from commit $(cat "$BUNDLE/COMMIT" 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "with $BIN; budget $BUDGET s; seed $SEED; LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}."
    echo "Each section: the command, its output as it ran, its exit code, wall time and verdict."
  } >>"$REPORT"
  DEADLINE=$((SECONDS + BUDGET))
  half
  {
    echo
    echo "## Summary"
    echo
    echo "| step | section | verdict | exit | s |"
    echo "|---|---|---|---|---|"
    printf '%s\n' "${SUMMARY[@]}"
    echo
    [ "${#FAILURES[@]}" -eq 0 ] || printf 'Failed: %s\n\n' "$(IFS=';' && echo "${FAILURES[*]}" | sed 's/;/; /g')"
    echo "Run exit code: $FAILED (0 only when every step ran and passed); $SECONDS s in all."
  } >>"$REPORT"
  [ "${#FAILURES[@]}" -eq 0 ] || printf 'gpu-check: failed: %s\n' "${FAILURES[@]}" >&2
  echo "gpu-check: wrote $REPORT (exit $FAILED)" >&2
  exit "$FAILED"
}

ARGS=("$@")
case "${1:-}" in
  build) build ;;
  sizes) sizes "${2:-$BUNDLE}" ;;
  run | rehearse | steps)
    [ "$1" = rehearse ] && MODE=rehearse
    [ "$1" = steps ] && MODE=dry
    case "${2:-}" in
      "") ;;
      --second) HALF=second ;;
      --flash) HALF=flash ;;
      --multi) HALF=multi ;;
      *) die "unknown option ${2}; hint: the options are --second, --flash and --multi" ;;
    esac
    run
    ;;
  _ldd | _glibc | _torch | _torch_bench | _size_128k | _to_file | _train_until)
    f="$1"
    shift
    "$f" "$@"
    ;;
  *)
    echo "usage: $0 build | run [--second|--flash|--multi] | rehearse [--second|--flash|--multi] | steps [--second|--flash|--multi] | sizes [DIR]   (see the header)" >&2
    exit 2
    ;;
esac
