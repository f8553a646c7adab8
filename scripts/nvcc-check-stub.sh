#!/usr/bin/env bash
# nvcc stand-in for type-checking `--features flash-attn` (.ci/run): candle-flash-attn's build script compiles
# FlashAttention-2 kernel files (13 in harpe's trimmed copy; the forward-only build took 37 min on 2 cores, and
# `scripts/gpu-check.sh build` does it), while
# `cargo check`/`cargo clippy` only need its Rust API. cudaforge (the build helper of candle-flash-attn and of
# candle-kernels) and harpe's build.rs take nvcc from $NVCC, so with NVCC=<this script>:
#   - a call that names candle-flash-attn (its kernel sources) or $CANDLE_FLASH_ATTN_BUILD_DIR (its objects
#     and library) compiles nothing: -c ... -o OBJ / -cubin ... -o OUT: an empty OBJ; --ptx
#     --output-directory DIR F.cu: an empty DIR/F.ptx; --lib -o LIB: an empty archive;
#   - every other call (candle-kernels' PTX, harpe's kernels/*.cu) and --version, --list-gpu-code,
#     --list-gpu-arch run the real nvcc ($HARPE_REAL_NVCC, else $CUDA_ROOT/bin/nvcc): CI compiles those
#     kernels for real.
# The FA2 outputs are placeholders: use it only with a CANDLE_FLASH_ATTN_BUILD_DIR of its own, for
# check/clippy, never for a build that links or runs (the empty library would fail at link time).
set -euo pipefail
real="${HARPE_REAL_NVCC:-${CUDA_ROOT:?nvcc-check-stub: set CUDA_ROOT or HARPE_REAL_NVCC}/bin/nvcc}"
fa_dir="${CANDLE_FLASH_ATTN_BUILD_DIR:?nvcc-check-stub: set CANDLE_FLASH_ATTN_BUILD_DIR (its own directory)}"
fa=0
for a in "$@"; do
  case "$a" in
    *candle-flash-attn* | "$fa_dir"/*) fa=1 ;;
  esac
done
case " $* " in
  *" --version "* | *" --list-gpu-code "* | *" --list-gpu-arch "*) fa=0 ;;
esac
[ "$fa" = 1 ] || exec "$real" "$@"
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
