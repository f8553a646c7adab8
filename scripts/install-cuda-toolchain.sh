#!/usr/bin/env bash
# Install NVIDIA's CUDA 13.0 compiler, headers and link libraries from PyPI into PREFIX, so that
# `cargo build --release --features cuda` (and `--features nccl`) works on a machine with no GPU and no
# system CUDA. Why each version is pinned: the steps below and the comments beside the versions.
#
#   eval "$(scripts/install-cuda-toolchain.sh PREFIX)"
#   cargo build --release --features cuda
#
# What it does (each step is skipped when its result is already there, so a second call costs ~0 s):
#   1. pip --target PREFIX/cuda:     nvcc, nvvm, crt (all three pinned to 13.0.88: an unpinned nvvm/crt
#      resolves to 13.5 whose cicc emits PTX too new for a CUDA 13.0 driver), cuda-runtime, cccl;
#   2. pip --target PREFIX/cudalibs: cublas, curand, nvrtc, nccl-cu13 at the versions torch 2.11 pins
#      (link time only: the binary finds the GPU machine's own copies at run time);
#   3. PREFIX/cuda_root: bin/include/nvvm symlinks into cu13, lib64/lib*.so symlinks to the versioned
#      libraries, lib64/stubs/libcuda.so = a link-only stub with one empty function per cu* symbol that
#      cudarc binds (the list is read from cudarc's own sources in the cargo registry);
#   4. pip --target PREFIX/cutlass:  nvidia-cutlass 3.5.0.0 (CUTLASS 3.5.0 = the commit candle-flash-attn pins),
#      laid out as cudaforge's cached checkout PREFIX/cudaforge/git/checkouts/cutlass-<16 hex>/{include,
#      tools/util/include} with a .git whose HEAD is the pinned commit id, so `--features flash-attn` builds
#      with no network (cudaforge would otherwise git-clone CUTLASS from github.com);
#   5. prints `export NAME=value` lines on stdout (progress goes to stderr), among them CUDAFORGE_HOME and
#      CANDLE_FLASH_ATTN_BUILD_DIR=PREFIX/flash-attn-build (the compiled FA2 kernel objects survive
#      `cargo clean` and are shared by check, debug and release builds).
# It does not install a driver or anything that runs a kernel; CUDA_COMPUTE_CAP defaults to 80 (A100;
# Hopper JIT-compiles the PTX); set it before calling to override (90 = Hopper-only build).
set -euo pipefail

if [ $# -ne 1 ]; then
  echo "usage: $0 PREFIX   (then: eval \"\$($0 PREFIX)\")" >&2
  exit 2
fi
mkdir -p "$1"
PREFIX="$(cd "$1" && pwd)"
PY="${PYTHON:-python3}"
log() { echo "[install-cuda-toolchain] $*" >&2; }
# newest GLOB...: the last match in version order, or nothing. (A bare `$(ls ... | sort -V | tail -n 1)`
# exits the script under `set -e -o pipefail` when nothing matches, e.g. on a fresh machine whose cargo
# registry does not hold cudarc yet, before the fallback below could fetch it.)
newest() { ls -d "$@" 2>/dev/null | sort -V | tail -n 1 || true; }

NVCC_V=13.0.88
RUNTIME_V=13.0.96
CCCL_V=13.0.85
CUBLAS_V=13.1.0.3
CURAND_V=10.4.0.35
NVRTC_V=13.0.88
NCCL_V=2.28.9
# CUTLASS for candle-flash-attn 0.11.1: its build.rs pins commit 7d49e6c7..., the v3.5.0 tag; the PyPI
# wheel of that release ships the same include/ and tools/util/include/ trees.
CUTLASS_V=3.5.0.0
CUTLASS_COMMIT=7d49e6c7e2f8896c47f586706e67e1fb215529dc

pip_target() { # DIR STAMP PKG...
  local dir="$1" stamp="$2"
  shift 2
  if [ -f "$dir/.harpe-$stamp" ]; then
    log "reusing $dir"
    return
  fi
  command -v "$PY" >/dev/null || { log "error: $PY not found; hint: install Python 3 with pip, or set PYTHON=/path/to/python3"; exit 1; }
  log "pip install into $dir: $*"
  rm -rf "$dir"
  "$PY" -m pip install --quiet --no-cache-dir --no-deps --target "$dir" "$@" >&2 || {
    log "error: pip could not install $*; hint: this needs access to pypi.org (or a wheel mirror via PIP_INDEX_URL)"
    exit 1
  }
  touch "$dir/.harpe-$stamp"
}

pip_target "$PREFIX/cuda" "nvcc-$NVCC_V-rt-$RUNTIME_V" \
  "nvidia-cuda-nvcc==$NVCC_V" "nvidia-nvvm==$NVCC_V" "nvidia-cuda-crt==$NVCC_V" \
  "nvidia-cuda-runtime==$RUNTIME_V" "nvidia-cuda-cccl==$CCCL_V"
pip_target "$PREFIX/cudalibs" "libs-$CUBLAS_V-$NCCL_V" \
  "nvidia-cublas==$CUBLAS_V" "nvidia-curand==$CURAND_V" "nvidia-cuda-nvrtc==$NVRTC_V" \
  "nvidia-nccl-cu13==$NCCL_V" "nvidia-cuda-runtime==$RUNTIME_V"

pip_target "$PREFIX/cutlass" "cutlass-$CUTLASS_V" "nvidia-cutlass==$CUTLASS_V"

CU13="$PREFIX/cuda/nvidia/cu13"
LIBS13="$PREFIX/cudalibs/nvidia/cu13/lib"
NCCLLIB="$PREFIX/cudalibs/nvidia/nccl/lib"
[ -x "$CU13/bin/nvcc" ] || { log "error: $CU13/bin/nvcc missing after install; hint: delete $PREFIX and rerun"; exit 1; }

ROOT="$PREFIX/cuda_root"
mkdir -p "$ROOT/lib64/stubs"
for d in bin include nvvm; do ln -sfn "$CU13/$d" "$ROOT/$d"; done

link_lib() { # NAME DIR: lib64/libNAME.so -> the newest versioned libNAME.so.* in DIR
  local f
  f="$(newest "$2"/lib"$1".so.*)"
  [ -n "$f" ] || { log "error: lib$1.so.* not found in $2; hint: delete $PREFIX and rerun"; exit 1; }
  ln -sfn "$f" "$ROOT/lib64/lib$1.so"
}
link_lib cudart "$LIBS13"
link_lib cublas "$LIBS13"
link_lib cublasLt "$LIBS13"
link_lib curand "$LIBS13"
link_lib nvrtc "$LIBS13"
link_lib nccl "$NCCLLIB"
ln -sfn "$CU13/lib/libcudart_static.a" "$ROOT/lib64/libcudart_static.a"

# The link-only driver stub: every cu* function cudarc declares, as an empty function. It is never
# loaded at run time (the real libcuda.so.1 of the driver is), so the signatures do not matter.
STUB="$ROOT/lib64/stubs/libcuda.so"
if [ ! -f "$STUB" ]; then
  CUDARC_SRC="$(newest "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*)"
  if [ -z "$CUDARC_SRC" ]; then
    log "cudarc sources not in the cargo registry yet: fetching them (cargo fetch)"
    (cd "$(dirname "$0")/.." && cargo fetch >&2)
    CUDARC_SRC="$(newest "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*)"
  fi
  SYS="$CUDARC_SRC/src/driver/sys/mod.rs"
  [ -f "$SYS" ] || { log "error: $SYS not found; hint: run cargo fetch in the harpe checkout first"; exit 1; }
  grep -oE 'pub (unsafe )?fn cu[A-Za-z0-9_]+' "$SYS" | sed -E 's/pub (unsafe )?fn //' | sort -u >"$ROOT/lib64/stubs/cuda_symbols.txt"
  n="$(wc -l <"$ROOT/lib64/stubs/cuda_symbols.txt")"
  [ "$n" -gt 100 ] || { log "error: only $n cu* symbols found in $SYS; hint: cudarc's layout changed, update this script"; exit 1; }
  sed 's/.*/void &(void) {}/' "$ROOT/lib64/stubs/cuda_symbols.txt" >"$ROOT/lib64/stubs/libcuda_stub.c"
  ${CC:-cc} -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$STUB" "$ROOT/lib64/stubs/libcuda_stub.c"
  log "built $STUB with $n cu* symbols from $SYS"
fi

# cudaforge's CUTLASS cache (dependency.rs): it uses $CUDAFORGE_HOME/git/checkouts/cutlass-<first 16 hex
# of the commit> when include/ exists there and `git rev-parse HEAD` in it prints the commit. rev-parse
# reads a detached HEAD without looking the object up, so an empty repository whose HEAD file holds the id
# passes; nothing else in the checkout is read (no fetch, no checkout).
FA_SRC="$(newest "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/candle-flash-attn-0.11.*)"
if [ -n "$FA_SRC" ] && ! grep -q "$CUTLASS_COMMIT" "$FA_SRC/build.rs"; then
  log "error: $FA_SRC/build.rs pins another CUTLASS commit than $CUTLASS_COMMIT; hint: update CUTLASS_COMMIT and CUTLASS_V in $0 to that commit's release"
  exit 1
fi
CUTLASS_SRC="$PREFIX/cutlass/cutlass_library/source"
[ -f "$CUTLASS_SRC/include/cute/tensor.hpp" ] || { log "error: $CUTLASS_SRC/include/cute/tensor.hpp missing after install; hint: delete $PREFIX/cutlass and rerun"; exit 1; }
CHECKOUT="$PREFIX/cudaforge/git/checkouts/cutlass-${CUTLASS_COMMIT:0:16}"
if [ "$(git -C "$CHECKOUT" rev-parse HEAD 2>/dev/null)" != "$CUTLASS_COMMIT" ] || [ ! -e "$CHECKOUT/include" ]; then
  command -v git >/dev/null || { log "error: git not found (cudaforge runs git rev-parse on the CUTLASS cache); hint: apt-get install git"; exit 1; }
  rm -rf "$CHECKOUT"
  mkdir -p "$CHECKOUT/tools/util"
  ln -sfn "$CUTLASS_SRC/include" "$CHECKOUT/include"
  ln -sfn "$CUTLASS_SRC/tools/util/include" "$CHECKOUT/tools/util/include"
  git init -q "$CHECKOUT"
  echo "$CUTLASS_COMMIT" >"$CHECKOUT/.git/HEAD"
  [ "$(git -C "$CHECKOUT" rev-parse HEAD)" = "$CUTLASS_COMMIT" ] || { log "error: git rev-parse HEAD in $CHECKOUT does not print $CUTLASS_COMMIT; hint: report your git version"; exit 1; }
  log "laid out CUTLASS $CUTLASS_V as cudaforge's checkout $CHECKOUT"
fi
mkdir -p "$PREFIX/flash-attn-build"

cat <<EOF
export CUDA_ROOT=$ROOT
export CUDA_HOME=$ROOT
export CUDA_PATH=$ROOT
export PATH=$ROOT/bin:\$PATH
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-80}
export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-2}
export CUDAFORGE_HOME=$PREFIX/cudaforge
export CANDLE_FLASH_ATTN_BUILD_DIR=$PREFIX/flash-attn-build
EOF
