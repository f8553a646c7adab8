#!/usr/bin/env bash
# Install the static libraries of Intel oneAPI MKL (sequential, LP64) from PyPI into PREFIX, for
# `cargo build --release --features mkl`: the CPU GEMMs of `ops::linear` and the attention's block products
# then run on MKL's sgemm instead of the `gemm` crate (src/ops/cpu_gemm.rs says when and why).
#
#   eval "$(scripts/install-mkl.sh PREFIX)"
#   cargo build --release --features mkl
#
# What it does (skipped when PREFIX/lib already holds the three libraries, so a second call costs ~0 s):
#   1. pip download mkl-static (pinned; ~250 MB wheel, no dependencies) into PREFIX/wheel;
#   2. extracts libmkl_intel_lp64.a, libmkl_sequential.a and libmkl_core.a (~640 MB) into PREFIX/lib and
#      deletes the wheel;
#   3. prints `export HARPE_MKL_LIB=PREFIX/lib` on stdout (progress goes to stderr); build.rs links those
#      three archives from there (statically: the binary needs nothing at run time).
# MKL is under the Intel Simplified Software License (redistributable); harpe's default build does not use it.
set -euo pipefail

if [ $# -ne 1 ]; then
  echo "usage: $0 PREFIX   (then: eval \"\$($0 PREFIX)\")" >&2
  exit 2
fi
mkdir -p "$1"
PREFIX="$(cd "$1" && pwd)"
PY="${PYTHON:-python3}"
MKL_V=2026.2.0
LIBS="libmkl_intel_lp64.a libmkl_sequential.a libmkl_core.a"
log() { echo "[install-mkl] $*" >&2; }

have_all() {
  for l in $LIBS; do [ -f "$PREFIX/lib/$l" ] || return 1; done
  [ -f "$PREFIX/lib/.harpe-mkl-$MKL_V" ]
}

if have_all; then
  log "reusing $PREFIX/lib"
else
  command -v "$PY" >/dev/null || { log "error: $PY not found; hint: install Python 3 with pip, or set PYTHON=/path/to/python3"; exit 1; }
  rm -rf "$PREFIX/wheel" "$PREFIX/lib"
  mkdir -p "$PREFIX/wheel" "$PREFIX/lib"
  log "downloading mkl-static==$MKL_V from PyPI"
  "$PY" -m pip download --quiet --no-cache-dir --no-deps "mkl-static==$MKL_V" -d "$PREFIX/wheel" >&2 \
    || { log "error: pip could not download mkl-static==$MKL_V; hint: check the network or the pip index (PIP_INDEX_URL)"; exit 1; }
  log "extracting $LIBS"
  "$PY" - "$PREFIX" $LIBS <<'PY'
import glob, os, shutil, sys, zipfile
prefix, names = sys.argv[1], sys.argv[2:]
wheel = glob.glob(os.path.join(prefix, "wheel", "mkl_static-*.whl"))
if len(wheel) != 1:
    sys.exit(f"[install-mkl] error: expected one mkl_static wheel in {prefix}/wheel, found {wheel}")
with zipfile.ZipFile(wheel[0]) as z:
    members = {os.path.basename(n): n for n in z.namelist() if n.endswith(".a")}
    for name in names:
        if name not in members:
            sys.exit(f"[install-mkl] error: {name} is not in {wheel[0]}")
        with z.open(members[name]) as src, open(os.path.join(prefix, "lib", name), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
PY
  rm -rf "$PREFIX/wheel"
  touch "$PREFIX/lib/.harpe-mkl-$MKL_V"
fi
echo "export HARPE_MKL_LIB=$PREFIX/lib"
