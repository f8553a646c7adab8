#!/usr/bin/env bash
# Gloo processes against Local thread ranks on this host (a release build with --features gloo):
#   1. `harpe bench comms` over 2 and 4 Gloo processes and over as many Local thread ranks;
#   2. one training run of a 57M-parameter Llama (hidden 768, 8 layers, T 256), 4 ranks at ZeRO-3, as 4
#      Gloo processes and as 4 Local threads, with the host's cores split between the processes
#      (RAYON_NUM_THREADS = cores / ranks, at least 1, as `harpe sweep --jobs` splits them); the
#      tokens/s of the steps after the first, from metrics.jsonl.
# Usage: scripts/bench_gloo.sh [HARPE_BIN] > benches/results/gloo.md
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${1:-target/release/harpe}"
[ -x "$BIN" ] || { echo "no $BIN: cargo build --release --features gloo" >&2; exit 1; }
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
CORES="$(nproc)"

echo "# Gloo processes vs Local thread ranks"
echo
echo "Host: $CORES cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')). Binary: \`$($BIN --version | head -1)\`."
echo "Made by \`scripts/bench_gloo.sh\`."
echo
echo "## Collectives (harpe bench comms, 1 and 16 MiB)"
echo
for n in 2 4; do
  echo '```'
  echo "\$ harpe bench comms --nproc-per-node $n --backend gloo --comm-mib 1,16"
  "$BIN" bench comms --nproc-per-node "$n" --backend gloo --comm-mib 1,16 --comm-seconds 0.5 2>&1 | grep -v '^harpe: started'
  echo "\$ harpe bench comms --ranks $n --comm-mib 1,16"
  "$BIN" bench comms --ranks "$n" --comm-mib 1,16 --comm-seconds 0.5
  echo '```'
done

cat > "$WORK/m.toml" <<'TOML'
[model.init]
vocab_size = 259
hidden_size = 768
intermediate_size = 2048
num_hidden_layers = 8
num_attention_heads = 12
[data]
source = "builtin"
[rope]
scheme = "default"
theta = 10000.0
[train]
dtype = "f32"
micro_batch_size = 1
global_batch_tokens = 1024
activation_checkpointing = "every-layer"
loss_chunk_tokens = 256
[log]
progress = false
plot = false
[checkpoint]
every = 0
[[stage]]
seq_len = 256
steps = 4
TOML

threads=$(( CORES / 4 )); [ "$threads" -ge 1 ] || threads=1
tps() { # mean tokens/s of the steps after the first
  python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])][1:]; print(round(sum(x['tokens_per_s'] for x in r)/len(r),1))" "$1"
}
RAYON_NUM_THREADS=$threads "$BIN" train --config "$WORK/m.toml" --out "$WORK/gloo" --nproc-per-node 4 \
  --set dist.backend=gloo --set dist.zero_stage=3 --force > "$WORK/gloo.log" 2>&1
"$BIN" train --config "$WORK/m.toml" --out "$WORK/local" --set dist.backend=local --set dist.world_size=4 \
  --set dist.zero_stage=3 --force > "$WORK/local.log" 2>&1
G=$(tps "$WORK/gloo/metrics.jsonl"); L=$(tps "$WORK/local/metrics.jsonl")
echo
echo "## A 4-rank ZeRO-3 training step, 57M parameters (hidden 768, 8 layers, T 256, 1024 tokens a step)"
echo
echo "| ranks as | threads per rank | tokens/s (steps 2-4) |"
echo "|---|---|---|"
echo "| 4 Gloo processes | $threads (RAYON_NUM_THREADS) | $G |"
echo "| 4 Local threads | the process's rayon pool, shared | $L |"
echo
python3 -c "g,l=$G,$L; print(f'Gloo step time / Local step time: {l/g:.2f}x (goal: at most 1.3x)')"
