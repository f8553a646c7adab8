#!/usr/bin/env bash
# nvcc stand-in that compiles nothing, for type-checking `--features flash-attn` (.ci/run): candle-flash-attn's
# build script compiles 53 FlashAttention-2 kernel files (over an hour on 2 cores; scripts/gpu-check.sh build
# does that), while `cargo check`/`cargo clippy` only need its Rust API. cudaforge (the kernels' build helper)
# takes nvcc from $NVCC, so with NVCC=<this script>:
#   --version, --list-gpu-code, --list-gpu-arch: the real nvcc answers ($HARPE_REAL_NVCC, else $CUDA_ROOT/bin/nvcc);
#   -c ... -o OBJ / -cubin ... -o OUT: an empty OBJ;  --ptx --output-directory DIR F.cu: an empty DIR/F.ptx;
#   --lib -o LIB: an empty archive.
# The outputs are placeholders: use it only with its own CARGO_TARGET_DIR and CANDLE_FLASH_ATTN_BUILD_DIR, for
# check/clippy, never for a build that links or runs (the empty library would fail at link time).
set -euo pipefail
case " $* " in
  *" --version "* | *" --list-gpu-code "* | *" --list-gpu-arch "*)
    exec "${HARPE_REAL_NVCC:-${CUDA_ROOT:?nvcc-check-stub: set CUDA_ROOT or HARPE_REAL_NVCC}/bin/nvcc}" "$@"
    ;;
esac
out="" dir="" lib=0 src=""
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out="$2"; shift ;;
    --output-directory) dir="$2"; shift ;;
    --lib) lib=1 ;;
    *.cu) src="$1" ;;
  esac
  shift
done
if [ "$lib" = 1 ] && [ -n "$out" ]; then
  printf '!<arch>\n' >"$out"
elif [ -n "$out" ]; then
  : >"$out"
elif [ -n "$dir" ] && [ -n "$src" ]; then
  : >"$dir/$(basename "$src" .cu).ptx"
else
  echo "nvcc-check-stub: cannot tell the output file of this call; hint: it only stands in for cudaforge's compile and --lib calls" >&2
  exit 1
fi
