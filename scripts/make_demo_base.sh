#!/usr/bin/env bash
# make_demo_base.sh — pretrain the tiny Llama that `harpe demo` extends, and write it to assets/demo-base/.
#
# Usage: scripts/make_demo_base.sh [WORK_DIR]     (default WORK_DIR: runs/demo-base)
# Runs `harpe demo --make-base assets/demo-base` from a release build: the demo's built-in corpus at 384
# tokens (passkey, associative recall, facts, stories, arithmetic; per-source upsampling), `harpe train`
# with the recipe of `BaseRecipe` in src/tools/demo/mod.rs, then `harpe eval-niah` passkey at 384 and 768 tokens.
# Writes config.json, model.safetensors (f32, < 5 MB) and provenance.json (recipe, tokens, final loss,
# passkey scores, wall time, the exact pretrain.toml). Deterministic for a given harpe build and thread
# count up to floating-point summation order. Takes about an hour on 2 cores; `harpe demo` then starts
# from this checkpoint (`harpe demo --pretrain` repeats the pretraining inside the demo instead).
set -euo pipefail
cd "$(dirname "$0")/.."
work="${1:-runs/demo-base}"
cargo build --release --bin harpe
target/release/harpe demo --make-base assets/demo-base --out "$work"
ls -l assets/demo-base
