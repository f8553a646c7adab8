#!/usr/bin/env bash
# HARPE continual pretraining of Llama-2-7B to 128K on 2 nodes x 8 A100:
# one harpe process per GPU started by srun, NCCL collectives, ZeRO-3.
#
#   sbatch scripts/slurm-harpe-128k.sh                      # submit (re-submitting resumes)
#   CONFIG=configs/yarn-128k.toml sbatch scripts/slurm-harpe-128k.sh
#
# How the ranks find each other: harpe reads SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, takes the
# first host of SLURM_JOB_NODELIST as rank 0's address and 20000 + SLURM_JOB_ID % 10000 as its port
# (export MASTER_ADDR / MASTER_PORT to override), admits only ranks presenting HARPE_RUN_TOKEN (drawn at
# random below, passed to every task by srun; without it the token would be the guessable job id), and
# refuses ranks whose binary or resolved config differ before any work starts. Needs a harpe built with `--features nccl` (README "Build for GPUs", scripts/install-cuda-toolchain.sh).
#SBATCH --job-name=harpe-128k
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=72:00:00
#SBATCH --signal=TERM@600
#SBATCH --requeue
#SBATCH --output=slurm-harpe-128k-%j.out
set -euo pipefail

CONFIG=${CONFIG:-configs/harpe-128k.toml}
RUN_DIR=${RUN_DIR:-runs/harpe-128k}
HARPE=${HARPE:-target/release/harpe}
TIMEOUT_S=${TIMEOUT_S:-900}   # a rank lost mid-run stops every rank within this many seconds

# 32 sequences of 131072 tokens per step (configs/harpe-128k.toml) = 2 micro-batches per rank at 16 ranks.
echo "harpe-128k: job ${SLURM_JOB_ID:-?} on ${SLURM_JOB_NODELIST:-?}, ${SLURM_NTASKS:-?} ranks"

# A random per-submission rendezvous token, the same for every task (srun exports the environment).
export HARPE_RUN_TOKEN="${HARPE_RUN_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"

# 1. Seconds-long smoke test of the launcher settings: every rank joins rank 0 and passes a barrier.
srun --kill-on-bad-exit=1 "$HARPE" dist-check --timeout-s 120

# 2. Train; --resume continues from the newest complete checkpoint (none on the first submission).
#    SIGTERM (from --signal above, or scancel) makes every rank stop after the current step.
srun --kill-on-bad-exit=1 "$HARPE" train --config "$CONFIG" --out "$RUN_DIR" --resume \
    --set dist.backend=nccl \
    --set dist.zero_stage=3 \
    --set dist.timeout_s="$TIMEOUT_S"
