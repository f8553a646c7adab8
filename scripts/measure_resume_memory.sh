#!/usr/bin/env bash
# Peak resident memory of a multi-rank `Local` ZeRO-3 training run that writes a checkpoint, and of its
# `--resume`, measured by GNU time's "Maximum resident set size" (the ranks are
# threads of one process, so this is the sum over ranks, file-backed pages of the mapped shards
# included). Also prints the bytes of the ranks' own optimizer shards (the sum of what the ranks must
# hold) and the checkpoint's files.
#
#   scripts/measure_resume_memory.sh [HIDDEN LAYERS INTERMEDIATE HEADS] [OUT_DIR]
#   defaults: 1024 24 2816 16 (0.37B parameters with vocab 32000), /tmp/harpe-resume-mem
#
# Uses target/release/harpe (`cargo build --release` first); runs at nice 19. Needs ~10 GB free at
# the default size.
set -euo pipefail
HIDDEN=${1:-1024}
LAYERS=${2:-24}
INTER=${3:-2816}
HEADS=${4:-16}
OUT=${5:-/tmp/harpe-resume-mem}
WORLD=${WORLD:-4}
STEPS=${STEPS:-2}
BIN=${BIN:-target/release/harpe}
[ -x "$BIN" ] || { echo "error: $BIN missing; hint: cargo build --release" >&2; exit 1; }
rm -rf "$OUT"
mkdir -p "$OUT"
CFG="$OUT/run.toml"
cat >"$CFG" <<EOF
[model.init]
vocab_size = 32000
hidden_size = $HIDDEN
intermediate_size = $INTER
num_hidden_layers = $LAYERS
num_attention_heads = $HEADS
num_key_value_heads = $HEADS
max_position_embeddings = 4096

[data]
source = "builtin"

[rope]
scheme = "default"
theta = 10000.0

[train]
dtype = "f32"
micro_batch_size = 1
global_batch_tokens = $((WORLD * 64))
loss_chunk_tokens = 64

[checkpoint]
every = $STEPS
keep_last = 1

[log]
progress = false
plot = false

[[stage]]
seq_len = 64
steps = 100
EOF
SETS=(--set dist.backend=local --set "dist.world_size=$WORLD" --set dist.zero_stage=3)
peak() { grep "Maximum resident set size" "$1" | awk '{print $NF}'; }
echo "== train $STEPS steps, $WORLD ranks, ZeRO-3, hidden $HIDDEN x $LAYERS layers =="
nice -n 19 /usr/bin/time -v "$BIN" train --config "$CFG" --out "$OUT/run" --steps "$STEPS" "${SETS[@]}" \
  >"$OUT/train.log" 2>"$OUT/train.time"
echo "== resume: $STEPS more steps =="
nice -n 19 /usr/bin/time -v "$BIN" train --config "$CFG" --out "$OUT/run" --steps $((2 * STEPS)) --resume "${SETS[@]}" \
  >"$OUT/resume.log" 2>"$OUT/resume.time"
CK=$(ls -d "$OUT"/run/checkpoints/step_* | sort | head -1)
[ -n "$CK" ] || { echo "error: no checkpoint" >&2; exit 1; }
T=$(peak "$OUT/train.time")
R=$(peak "$OUT/resume.time")
SHARDS=$(du -cb "$OUT"/run/checkpoints/step_*/optim-* | tail -1 | awk '{print $1}')
MODEL=$(du -cb "$OUT"/run/checkpoints/step_*/model* | tail -1 | awk '{print $1}')
PARAMS=$(grep -o '"num_parameters"[^,]*' "$OUT/run/config.toml" 2>/dev/null || true)
echo "parameters: $(awk -v s="$SHARDS" 'BEGIN{printf "%.0f", s/12}') (optimizer shard bytes / 12) $PARAMS"
echo "train peak RSS:  $T KiB ($(awk -v k="$T" 'BEGIN{printf "%.2f", k/1048576}') GiB)"
echo "resume peak RSS: $R KiB ($(awk -v k="$R" 'BEGIN{printf "%.2f", k/1048576}') GiB)"
echo "resume / train:  $(awk -v a="$R" -v b="$T" 'BEGIN{printf "%.3f", a/b}')"
echo "sum of the ranks' own optimizer shards (fp32 master, m, v): $SHARDS B ($(awk -v s="$SHARDS" 'BEGIN{printf "%.2f", s/1073741824}') GiB)"
echo "model files: $MODEL B ($(awk -v s="$MODEL" 'BEGIN{printf "%.2f", s/1073741824}') GiB)"
grep -E "Elapsed|Maximum resident" "$OUT/train.time" "$OUT/resume.time"
tail -n 2 "$OUT/train.log" "$OUT/resume.log"
