#!/usr/bin/env bash
# Install an NVIDIA CUDA compiler, headers and link libraries into PREFIX, so that
# `cargo build --release --features cuda` (and `--features nccl`) works on a machine with no GPU and no
# system CUDA. Two toolchains, because the binary's CUDA libraries set the oldest driver it runs on:
#
#   eval "$(scripts/install-cuda-toolchain.sh PREFIX)"       # CUDA 13.0: needs an R580+ driver on the GPU machine
#   eval "$(scripts/install-cuda-toolchain.sh PREFIX 12)"    # CUDA 12.4: needs an R550+ driver (most A100 clusters)
#   cargo build --release --features cuda
#
# (HARPE_CUDA_MAJOR=12 does the same as the second argument.) Use one PREFIX and one CARGO_TARGET_DIR per
# CUDA major: cudarc picks its CUDA version when it is built, from `nvcc --version`.
#
# CUDA 13 (each step is skipped when its result is already there, so a second call costs ~0 s):
#   1. pip --target PREFIX/cuda:     nvcc, nvvm, crt (all three pinned to 13.0.88: an unpinned nvvm/crt
#      resolves to 13.5 whose cicc emits PTX too new for a CUDA 13.0 driver), cuda-runtime, cccl;
#   2. pip --target PREFIX/cudalibs: cublas, curand, nvrtc, nccl-cu13 at the versions torch 2.11 pins
#      (link time only: the binary finds the GPU machine's own copies at run time);
# CUDA 12:
#   1. PyPI's nvidia-cuda-nvcc-cu12 wheels ship ptxas, libdevice and the crt headers but no nvcc driver and
#      no cicc (true of every 12.x release on PyPI), so the compiler driver, cicc, fatbinary, nvlink and
#      cudafe++ come from Debian's nvidia-cuda-toolkit 12.4.131 (non-free, the release trixie ships),
#      fetched as .deb files from deb.debian.org, checked against their sha256 and unpacked with dpkg -x
#      into PREFIX/deb (nothing is installed system-wide; the binaries need glibc >= 2.34 and gcc <= 13);
#   2. pip --target PREFIX/cuda: crt headers, cuda-runtime and cccl headers of the same 12.4 release;
#   3. pip --target PREFIX/cudalibs: cublas, curand, nvrtc and nccl-cu12 at the versions torch 2.6's cu124
#      build pins (link time only, as for CUDA 13);
# Both:
#   3. PREFIX/cuda_root: bin/include/nvvm, lib64/lib*.so symlinks to the versioned libraries,
#      lib64/stubs/libcuda.so = a link-only stub with one empty function per cu* symbol that
#      cudarc binds (the list is read from cudarc's own sources in the cargo registry);
#   4. pip --target PREFIX/cutlass:  nvidia-cutlass 3.5.0.0 (CUTLASS 3.5.0 = the commit candle-flash-attn pins),
#      laid out as cudaforge's cached checkout PREFIX/cudaforge/git/checkouts/cutlass-<16 hex>/{include,
#      tools/util/include} with a .git whose HEAD is the pinned commit id, so `--features flash-attn` builds
#      with no network (cudaforge would otherwise git-clone CUTLASS from github.com);
#   5. prints `export NAME=value` lines on stdout (progress goes to stderr), among them CUDAFORGE_HOME and
#      CANDLE_FLASH_ATTN_BUILD_DIR=PREFIX/flash-attn-build (the compiled FA2 kernel objects survive
#      `cargo clean` and are shared by check, debug and release builds), and HARPE_CUDA_MAJOR.
# It does not install a driver or anything that runs a kernel; CUDA_COMPUTE_CAP defaults to 80 (A100;
# Hopper JIT-compiles the PTX); set it before calling to override (90 = Hopper-only build).
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 PREFIX [12|13]   (then: eval \"\$($0 PREFIX)\")" >&2
  exit 2
fi
CUDA_MAJOR="${2:-${HARPE_CUDA_MAJOR:-13}}"
case "$CUDA_MAJOR" in
  12 | 13) ;;
  *)
    echo "[install-cuda-toolchain] error: CUDA major '$CUDA_MAJOR' is not one this script installs; hint: 13 (R580+ drivers) or 12 (R550+ drivers)" >&2
    exit 2
    ;;
esac
mkdir -p "$1"
PREFIX="$(cd "$1" && pwd)"
PY="${PYTHON:-python3}"
log() { echo "[install-cuda-toolchain] $*" >&2; }
# newest GLOB...: the last match in version order, or nothing. (A bare `$(ls ... | sort -V | tail -n 1)`
# exits the script under `set -e -o pipefail` when nothing matches, e.g. on a fresh machine whose cargo
# registry does not hold cudarc yet, before the fallback below could fetch it.)
newest() { ls -d "$@" 2>/dev/null | sort -V | tail -n 1 || true; }

if [ "$CUDA_MAJOR" = 13 ]; then
  NVCC_V=13.0.88
  RUNTIME_V=13.0.96
  CCCL_V=13.0.85
  CUBLAS_V=13.1.0.3
  CURAND_V=10.4.0.35
  NVRTC_V=13.0.88
  NCCL_V=2.28.9
else
  # CUDA 12.4.1's parts: the wheels torch 2.6.0+cu124 pins, and Debian's build of the same release's compiler.
  NVCC_V=12.4.131
  RUNTIME_V=12.4.127
  CCCL_V=12.4.127.post1
  CUBLAS_V=12.4.5.8
  CURAND_V=10.3.5.147
  NVRTC_V=12.4.127
  NCCL_V=2.21.5
  DEB_V="12.4.131~12.4.1-2"
  DEB_POOL=pool/non-free/n/nvidia-cuda-toolkit
  DEB_TOOLKIT_SHA=cd5fe85aee38d108b315f408a688641478f2402622a10c677478eb7a6c4e5319
  DEB_NVVM_SHA=3c905c1df7453e1ad477516c4465629c310d2f58a796d66f44070dc289e7ec12
fi
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

link_lib() { # NAME DIR: lib64/libNAME.so -> the newest versioned libNAME.so.* in DIR
  local f
  f="$(newest "$2"/lib"$1".so.*)"
  [ -n "$f" ] || { log "error: lib$1.so.* not found in $2; hint: delete $PREFIX and rerun"; exit 1; }
  ln -sfn "$f" "$ROOT/lib64/lib$1.so"
}

# deb_unpack NAME SHA256: Debian's NAME_$DEB_V_amd64.deb from the pool, checked, unpacked into PREFIX/deb.
# deb.debian.org first; snapshot.debian.org keeps every file Debian ever published, for after trixie's
# pool has moved on to a newer build.
deb_unpack() {
  local name="$1" sha="$2" file url got
  file="$PREFIX/debs/${name}_${DEB_V/\~/%7E}_amd64.deb"
  mkdir -p "$PREFIX/debs" "$PREFIX/deb"
  if [ ! -f "$PREFIX/deb/.harpe-$name-$DEB_V" ]; then
    command -v dpkg-deb >/dev/null || { log "error: dpkg-deb not found; hint: apt-get install dpkg"; exit 1; }
    if [ "$(sha256sum "$file" 2>/dev/null | cut -d' ' -f1)" != "$sha" ]; then
      for url in "https://deb.debian.org/debian/$DEB_POOL/$(basename "$file")" \
        "https://snapshot.debian.org/archive/debian/20250801T000000Z/$DEB_POOL/$(basename "$file")"; do
        log "fetching $url"
        if "$PY" -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' "$url" "$file.part" 2>/dev/null; then
          mv "$file.part" "$file"
          break
        fi
      done
    fi
    got="$(sha256sum "$file" 2>/dev/null | cut -d' ' -f1)"
    [ "$got" = "$sha" ] || { log "error: $file: sha256 ${got:-missing}, expected $sha; hint: the download failed or the file changed; delete $PREFIX/debs and rerun, or place the .deb there by hand"; exit 1; }
    dpkg-deb -x "$file" "$PREFIX/deb"
    touch "$PREFIX/deb/.harpe-$name-$DEB_V"
  fi
}

# include_farm DIR...: ROOT/include as one directory of links to every entry of the wheels' include/ dirs
# (the cu12 wheels keep each library's headers in a folder of its own; nvcc and cudarc want one).
include_farm() {
  rm -rf "$ROOT/include" && mkdir -p "$ROOT/include"
  local d e
  for d in "$@"; do
    for e in "$d"/*; do
      case "$(basename "$e")" in __init__.py | __pycache__) continue ;; esac
      ln -sfn "$e" "$ROOT/include/$(basename "$e")"
    done
  done
}

ROOT="$PREFIX/cuda_root"
if [ "$CUDA_MAJOR" = 13 ]; then
  pip_target "$PREFIX/cuda" "nvcc-$NVCC_V-rt-$RUNTIME_V" \
    "nvidia-cuda-nvcc==$NVCC_V" "nvidia-nvvm==$NVCC_V" "nvidia-cuda-crt==$NVCC_V" \
    "nvidia-cuda-runtime==$RUNTIME_V" "nvidia-cuda-cccl==$CCCL_V"
  pip_target "$PREFIX/cudalibs" "libs-$CUBLAS_V-$NCCL_V" \
    "nvidia-cublas==$CUBLAS_V" "nvidia-curand==$CURAND_V" "nvidia-cuda-nvrtc==$NVRTC_V" \
    "nvidia-nccl-cu13==$NCCL_V" "nvidia-cuda-runtime==$RUNTIME_V"

  CU13="$PREFIX/cuda/nvidia/cu13"
  LIBS13="$PREFIX/cudalibs/nvidia/cu13/lib"
  NCCLLIB="$PREFIX/cudalibs/nvidia/nccl/lib"
  [ -x "$CU13/bin/nvcc" ] || { log "error: $CU13/bin/nvcc missing after install; hint: delete $PREFIX and rerun"; exit 1; }

  mkdir -p "$ROOT/lib64/stubs"
  for d in bin include nvvm; do ln -sfn "$CU13/$d" "$ROOT/$d"; done
  link_lib cudart "$LIBS13"
  link_lib cublas "$LIBS13"
  link_lib cublasLt "$LIBS13"
  link_lib curand "$LIBS13"
  link_lib nvrtc "$LIBS13"
  link_lib nccl "$NCCLLIB"
  ln -sfn "$CU13/lib/libcudart_static.a" "$ROOT/lib64/libcudart_static.a"
else
  deb_unpack nvidia-cuda-toolkit "$DEB_TOOLKIT_SHA"
  deb_unpack libnvvm4 "$DEB_NVVM_SHA"
  pip_target "$PREFIX/cuda" "cu12-nvcc-$NVCC_V-rt-$RUNTIME_V" \
    "nvidia-cuda-nvcc-cu12==$NVCC_V" "nvidia-cuda-runtime-cu12==$RUNTIME_V" "nvidia-cuda-cccl-cu12==$CCCL_V"
  pip_target "$PREFIX/cudalibs" "cu12-libs-$CUBLAS_V-$NCCL_V" \
    "nvidia-cublas-cu12==$CUBLAS_V" "nvidia-curand-cu12==$CURAND_V" "nvidia-cuda-nvrtc-cu12==$NVRTC_V" \
    "nvidia-nccl-cu12==$NCCL_V"
  DEB="$PREFIX/deb/usr"
  W="$PREFIX/cuda/nvidia"
  L="$PREFIX/cudalibs/nvidia"
  [ -x "$DEB/lib/nvidia-cuda-toolkit/bin/nvcc" ] || { log "error: nvcc missing in $DEB after unpacking; hint: delete $PREFIX/deb and rerun"; exit 1; }

  rm -rf "$ROOT/bin" "$ROOT/nvvm"
  mkdir -p "$ROOT/bin" "$ROOT/nvvm/bin" "$ROOT/nvvm/libdevice" "$ROOT/lib64/stubs"
  # nvcc reads nvcc.profile beside itself: Debian's points at /usr; this one at ROOT. ptxas is the wheel's,
  # the same 12.4.131 release as Debian's.
  cp "$DEB/lib/nvidia-cuda-toolkit/bin/nvcc" "$ROOT/bin/nvcc"
  for t in fatbinary nvlink cudafe++ bin2c nvprune cuobjdump nvdisasm cu++filt; do ln -sfn "$DEB/bin/$t" "$ROOT/bin/$t"; done
  ln -sfn "$W/cuda_nvcc/bin/ptxas" "$ROOT/bin/ptxas"
  ln -sfn "$DEB/lib/nvidia-cuda-toolkit/bin/crt" "$ROOT/bin/crt"
  ln -sfn "$DEB/lib/nvidia-cuda-toolkit/bin/cicc" "$ROOT/nvvm/bin/cicc"
  ln -sfn "$W/cuda_nvcc/nvvm/libdevice/libdevice.10.bc" "$ROOT/nvvm/libdevice/libdevice.10.bc"
  cat >"$ROOT/bin/nvcc.profile" <<'PROFILE'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/lib64:
PATH            += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib64/stubs" "-L$(TOP)/lib64"
PROFILE
  include_farm "$W/cuda_runtime/include" "$W/cuda_nvcc/include" "$W/cuda_cccl/include" \
    "$L/cublas/include" "$L/curand/include" "$L/cuda_nvrtc/include" "$L/nccl/include"
  link_lib cudart "$W/cuda_runtime/lib"
  link_lib cublas "$L/cublas/lib"
  link_lib cublasLt "$L/cublas/lib"
  link_lib curand "$L/curand/lib"
  link_lib nvrtc "$L/cuda_nvrtc/lib"
  link_lib nccl "$L/nccl/lib"
  "$ROOT/bin/nvcc" --version | grep -q "release 12.4" || { log "error: $ROOT/bin/nvcc does not report release 12.4; hint: delete $PREFIX and rerun"; exit 1; }
fi

pip_target "$PREFIX/cutlass" "cutlass-$CUTLASS_V" "nvidia-cutlass==$CUTLASS_V"

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
export HARPE_CUDA_MAJOR=$CUDA_MAJOR
export CUDA_HOME=$ROOT
export CUDA_PATH=$ROOT
export PATH=$ROOT/bin:\$PATH
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-80}
export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-2}
export CUDAFORGE_HOME=$PREFIX/cudaforge
export CANDLE_FLASH_ATTN_BUILD_DIR=$PREFIX/flash-attn-build
EOF
