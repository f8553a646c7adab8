#!/usr/bin/env bash
# HARPE continual pretraining of Llama-2-7B to 128K on 2 nodes x 8 A100:
# one harpe process per GPU started by srun, NCCL collectives, ZeRO-3.
#
#   sbatch scripts/slurm-harpe-128k.sh                      # submit (re-submitting resumes)
#   CONFIG=configs/yarn-128k.toml sbatch scripts/slurm-harpe-128k.sh
#   sbatch --nodes=1 scripts/slurm-harpe-128k.sh            # 1 node x 8 GPUs (command-line options win over #SBATCH)
#
# What it reads from the environment (sbatch passes the submitting shell's on): CONFIG, RUN_DIR, HARPE
# (the binary), BACKEND (nccl; gloo runs the same script on CPUs), ZERO_STAGE, TIMEOUT_S, and HARPE_SET
# (extra `--set` overrides, space-separated, e.g. HARPE_SET="train.seed=1 checkpoint.every=200").
# Node and GPU counts are sbatch's own options. The CPU rehearsal of tests/stage_train/train_slurm.rs submits
# this very file as
#   BACKEND=gloo CONFIG=... sbatch --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 --cpus-per-task=1 \
#     --time=10 --signal=TERM@30 scripts/slurm-harpe-128k.sh
# (a --time shorter than the --signal lead time below would get the TERM at once), and
# tests/stage_train/train_slurm_two_nodes.rs, on two nodes, keeps this file's --nodes=2 and --time:
#   BACKEND=gloo CONFIG=... sbatch --ntasks-per-node=2 --gpus-per-node=0 --cpus-per-task=1 scripts/slurm-harpe-128k.sh
#
# How the ranks find each other: harpe reads SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, takes the
# first host of SLURM_JOB_NODELIST as rank 0's address and 20000 + SLURM_JOB_ID % 10000 as its port
# (export MASTER_ADDR / MASTER_PORT to override), admits only ranks presenting HARPE_RUN_TOKEN (drawn at
# random below, passed to every task by srun; without it the token would be the guessable job id), and
# refuses ranks whose binary or resolved config differ before any work starts. Needs a harpe built with `--features nccl` (README "Build for GPUs", scripts/install-cuda-toolchain.sh).
#
# The stop warning (--signal=TERM@N): a TERM lands mid-step, every rank agrees to stop at the end of the
# next step (up to 2 steps), then the checkpoint is written. `harpe plan --config configs/harpe-128k.toml
# --gpus 16 --zero 3 --set train.attention='"harpe"'` prints the lead time this needs (its "stop:" line): 2 steps
# of the 128K stage plus rank 0's checkpoint write (its optimizer shard and the bf16 weights at 1 GB/s), plus a
# quarter, in whole minutes: 2 x 561 s + 19 s (18.5 GB) = 1141 s, x 1.25 -> 1440 s, with harpe's attention
# kernels (an nccl build without flash-attn trains on them; FlashAttention-2's shorter steps need less) and the
# plan's 40% MFU elsewhere. tests/tools/plan.rs checks that the number below is the plan's.
#SBATCH --job-name=harpe-128k
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=72:00:00
#SBATCH --signal=TERM@1440
#SBATCH --requeue
#SBATCH --output=slurm-harpe-128k-%j.out
set -euo pipefail

CONFIG=${CONFIG:-configs/harpe-128k.toml}
RUN_DIR=${RUN_DIR:-runs/harpe-128k}
HARPE=${HARPE:-target/release/harpe}
BACKEND=${BACKEND:-nccl}
ZERO_STAGE=${ZERO_STAGE:-3}
TIMEOUT_S=${TIMEOUT_S:-900}   # a rank lost mid-run stops every rank within this many seconds
SET=()
for kv in ${HARPE_SET:-}; do SET+=(--set "$kv"); done

# 32 sequences of 131072 tokens per step (configs/harpe-128k.toml) = 2 micro-batches per rank at 16 ranks.
echo "harpe-128k: job ${SLURM_JOB_ID:-?} on ${SLURM_JOB_NODELIST:-?}, ${SLURM_NTASKS:-?} ranks"

# A random per-submission rendezvous token, the same for every task (srun exports the environment).
export HARPE_RUN_TOKEN="${HARPE_RUN_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"

# The glibc the binary needs (harpe's floors::GLIBC_FLOOR; tests/tools/no_system_libs.rs holds this number to
# it): on an older one the dynamic loader stops every task with "GLIBC_2.34 not found" and nothing else.
GLIBC_FLOOR=2.34
glibc="$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')"
if [ -n "$glibc" ] && [ "$(printf '%s\n%s\n' "$GLIBC_FLOOR" "$glibc" | sort -V | head -n 1)" != "$GLIBC_FLOOR" ]; then
  echo "harpe-128k: glibc is $glibc on $(hostname) but harpe needs $GLIBC_FLOOR or newer; hint: run the job in a newer image (a container) or build harpe on this cluster's OS" >&2
  exit 1
fi

# --gpu-bind=none: every task sees all of its node's GPUs and opens cuda:LOCAL_RANK. A site default that binds
# one GPU per task shows each task only its own GPU as device 0 (harpe then uses that one device whatever its
# LOCAL_RANK: floors::rank_gpu), and where the binding also fences devices by cgroup, NCCL cannot map its
# node peers' memory for NVLink/peer-to-peer transfers and falls back to slower paths through host memory.
# 1. Seconds-long smoke test of the launcher settings: every rank joins rank 0 and passes a barrier.
srun --kill-on-bad-exit=1 --gpu-bind=none "$HARPE" dist-check --timeout-s 120

# 2. Train; --resume continues from the newest complete checkpoint (none on the first submission).
#    SIGTERM (from --signal above, or scancel) makes every rank stop after the current step.
srun --kill-on-bad-exit=1 --gpu-bind=none "$HARPE" train --config "$CONFIG" --out "$RUN_DIR" --resume \
    --set dist.backend="$BACKEND" \
    --set dist.zero_stage="$ZERO_STAGE" \
    --set dist.timeout_s="$TIMEOUT_S" \
    "${SET[@]}"
