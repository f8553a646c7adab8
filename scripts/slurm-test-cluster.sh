#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the tests that submit real srun/sbatch jobs
# (tests/stage_train/train_slurm.rs, tests/tools/sweep_slurm.rs) and for trying the Slurm workflow of
# README "Launching on GPUs" by hand.
#
#   scripts/slurm-test-cluster.sh up       # install slurm-wlm + munge if missing, start, wait until idle
#   scripts/slurm-test-cluster.sh status   # exit 0 when the node is up and answers
#   scripts/slurm-test-cluster.sh down     # stop the daemons by their pid files
#   eval "$(scripts/slurm-test-cluster.sh env)"   # SLURM_CONF for sinfo/srun/sbatch in this shell
#
# Everything lives under $HARPE_SLURM_DIR (default /tmp/harpe-slurm-test-cluster): slurm.conf, the
# munge key and socket, state, spool, logs and pid files, so /etc/slurm and the system munged are
# never touched and `down` + `rm -r` leaves nothing behind. The node line is `slurmd -C`'s (this
# machine's real hostname, CPUs and memory). Daemons run as root: fine for a throwaway test cluster.
#
# Accounting: there is no slurmdbd, so `AccountingStorageType=accounting_storage/none` and `sacct` has
# nothing to read. `harpe sweep --status` therefore reads squeue (pending/running tasks), the job ids
# harpe itself recorded when it submitted (slurm-jobs.json in the sweep directory) and the run
# directories; on a cluster with accounting it also asks sacct for the final state of finished tasks.
# JobRequeue=1 lets `scontrol requeue` and `--requeue` jobs go back to the queue.
set -euo pipefail

D=${HARPE_SLURM_DIR:-/tmp/harpe-slurm-test-cluster}
CONF=$D/slurm.conf
export SLURM_CONF=$CONF

log() { echo "slurm-test-cluster: $*" >&2; }

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    && command -v sbatch >/dev/null; then
    return
  fi
  if [ "$(id -u)" != 0 ]; then
    log "slurm-wlm and munge are missing and installing them needs root"
    log "hint: sudo apt-get install slurm-wlm munge, then run this again"
    exit 1
  fi
  log "installing slurm-wlm and munge (apt)"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
}

write_conf() {
  mkdir -p "$D/state" "$D/spool" "$D/munge"
  chmod 700 "$D/munge"
  if [ ! -f "$D/munge/munge.key" ]; then
    dd if=/dev/urandom of="$D/munge/munge.key" bs=1 count=128 status=none
    chmod 400 "$D/munge/munge.key"
  fi
  # `slurmd -C` prints this machine's node line (NodeName=<hostname> CPUs=... RealMemory=...); its
  # second line is the uptime, which is not a slurm.conf key.
  local node host
  node=$(slurmd -C | head -n 1)
  host=$(echo "$node" | sed -n 's/^NodeName=\([^ ]*\).*/\1/p')
  cat >"$CONF" <<EOF
ClusterName=harpe-test
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/munge/munge.socket
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/slurmctld.log
SlurmdLogFile=$D/slurmd.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobRequeue=1
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# finished jobs stay visible to squeue for 10 minutes (harpe sweep --status reads them)
MinJobAge=600
# a TERM'd task gets this long to checkpoint before SIGKILL
KillWait=60
SchedulerParameters=sched_interval=2
$node State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

node_idle() {
  sinfo -h -o '%t' 2>/dev/null | grep -qE '^(idle|mix|alloc)'
}

up() {
  install_packages
  if alive "$D/slurmctld.pid" && alive "$D/slurmd.pid" && node_idle; then
    log "already up ($CONF)"
    return
  fi
  write_conf
  local t0=$SECONDS
  if ! alive "$D/munged.pid"; then
    munged --force --key-file="$D/munge/munge.key" --socket="$D/munge/munge.socket" \
      --pid-file="$D/munged.pid" --log-file="$D/munged.log" --seed-file="$D/munge/munged.seed"
  fi
  alive "$D/slurmctld.pid" || slurmctld -f "$CONF"
  alive "$D/slurmd.pid" || slurmd -f "$CONF"
  for _ in $(seq 1 120); do
    if node_idle; then
      # a node that was down in saved state comes back with ReturnToService=2; nudge it anyway
      log "up in $(( SECONDS - t0 )) s: $(sinfo -h -o '%N %c CPUs %m MB %t')"
      return
    fi
    scontrol update nodename="$(sinfo -h -o '%N' | head -n 1)" state=resume >/dev/null 2>&1 || true
    sleep 0.5
  done
  log "the node did not become idle within 60 s; logs: $D/slurmctld.log, $D/slurmd.log"
  sinfo >&2 || true
  exit 1
}

stop_pid() {
  local f=$1
  if alive "$f"; then
    local p
    p=$(cat "$f")
    kill "$p" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$p" 2>/dev/null || true
  fi
  rm -f "$f"
}

down() {
  [ -f "$CONF" ] && scancel --user=root >/dev/null 2>&1 || true
  stop_pid "$D/slurmd.pid"
  stop_pid "$D/slurmctld.pid"
  stop_pid "$D/munged.pid"
  log "down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status)
    if alive "$D/slurmctld.pid" && alive "$D/slurmd.pid" && node_idle; then
      sinfo -h -o '%N %c CPUs %m MB %t'
    else
      log "not up (no live slurmctld/slurmd under $D, or the node is not idle)"
      exit 1
    fi
    ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *)
    echo "usage: $0 up|down|status|env" >&2
    exit 2
    ;;
esac
