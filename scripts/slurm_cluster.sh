#!/usr/bin/env bash
# A real single-host Slurm cluster with emulated nodes n[1-4] on 127.0.0.1.
#
#   bash scripts/slurm_cluster.sh start    # idempotent; installs slurm-wlm + munge (apt, root) on first use
#   bash scripts/slurm_cluster.sh status   # daemons, nodes, queue; exit 1 if not fully up
#   bash scripts/slurm_cluster.sh stop     # cancels jobs, stops every daemon by its pid file
#
# Used by the tests marked `slurm` and by CI. Debian's slurm-wlm is built with
# MULTIPLE_SLURMD, so one slurmd per emulated node (`slurmd -N nK`) listens on its own
# port. Settings and the reasons for them: ../shared/notes/slurm-on-one-host.md.
# Node count, CPUs and memory per node can be changed with SAO_SLURM_NODES (default 4),
# SAO_SLURM_CPUS (8) and SAO_SLURM_MEM_MB (16000); they apply at the next cold start.
set -euo pipefail

ROOT="${SAO_SLURM_ROOT:-/var/lib/sao-slurm}"
CONF=/etc/slurm/slurm.conf          # where every Slurm client looks without SLURM_CONF
NUM_NODES="${SAO_SLURM_NODES:-4}"
NODE_CPUS="${SAO_SLURM_CPUS:-8}"
NODE_MEM_MB="${SAO_SLURM_MEM_MB:-16000}"
CTLD_PORT=16817                     # off the default 6817 so a real installation is never hit
NODE_PORT0=17001
MUNGE_PID=/run/munge/munged.pid
CTLD_PID="$ROOT/run/slurmctld.pid"
HOST="$(hostname -s)"

log() { echo "slurm_cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }
node_names() { local i; for ((i = 1; i <= NUM_NODES; i++)); do echo "n$i"; done; }
slurmd_pid_file() { echo "$ROOT/run/slurmd-$1.pid"; }

# A pid file's daemon is alive unless it is gone or a zombie (exited daemons linger as Z here).
alive() {
  local pid_file="$1" pid state
  pid="$(cat "$pid_file" 2>/dev/null)" || return 1  # daemons remove their own pid file on exit
  [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
  # A stale pid file may name a reused pid: only our daemons' binaries count.
  local exe
  exe="$(readlink "/proc/$pid/exe" 2>/dev/null)" || return 1
  case " $(readlink -f /usr/sbin/munged /usr/sbin/slurmctld /usr/sbin/slurmd | tr '\n' ' ')" in
    *" $exe "*) ;;
    *) return 1 ;;
  esac
  state="$(sed -E 's/^[0-9]+ \(.*\) ([A-Za-z]).*/\1/' "/proc/$pid/stat" 2>/dev/null)" || return 1
  [ "$state" != "Z" ]
}

install_packages() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v sbatch >/dev/null && return
  [ "$(id -u)" = 0 ] || die "slurm-wlm and munge are missing and installing them needs root"
  log "installing slurm-wlm and munge (apt, ~35 s)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >&2
}

start_munge() {
  alive "$MUNGE_PID" && return
  mkdir -p /run/munge /var/lib/munge /var/log/munge /etc/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  fi
  chown munge:munge /run/munge /var/lib/munge /var/log/munge /etc/munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  chmod 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged --pid-file="$MUNGE_PID"
  for _ in $(seq 50); do alive "$MUNGE_PID" && return; sleep 0.1; done
  die "munged did not start (see /var/log/munge/munged.log)"
}

write_conf() {
  # Job ids restart at 1 when state is wiped, and a reused %j folder hands submitit an
  # old result: start each cold cluster at an id taken from the clock (1 per 0.25 s,
  # wrapping after ~190 days below Slurm's MaxJobId).
  local first_job_id=$(( ($(date +%s) * 4) % 67000000 + 1 ))
  local last_port=$((NODE_PORT0 + NUM_NODES - 1))
  mkdir -p /etc/slurm
  cat >"$CONF" <<EOF
# Written by scripts/slurm_cluster.sh (emulated single-host cluster); rewritten on each cold start.
ClusterName=sao
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Requeued jobs wait cred_expire s before rerunning (default 120; below 5 is ignored).
AuthInfo=cred_expire=10
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool/%n
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,bf_interval=1,sched_interval=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobRequeue=1
ReturnToService=2
PropagateResourceLimits=NONE
# Grace between SIGTERM and SIGKILL when a job is cancelled, preempted or requeued.
KillWait=15
MinJobAge=600
FirstJobId=$first_job_id
NodeName=n[1-$NUM_NODES] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=[$NODE_PORT0-$last_port] CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB State=UNKNOWN
PartitionName=debug Nodes=n[1-$NUM_NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

start_slurmctld() {
  alive "$CTLD_PID" && return
  # Cold start: no slurmd may survive from an earlier cluster (it would hold the ports).
  stop_slurmds
  rm -rf "$ROOT/state" "$ROOT/spool"
  mkdir -p "$ROOT/state" "$ROOT/run" "$ROOT/log"
  write_conf
  /usr/sbin/slurmctld -c -f "$CONF"
  for _ in $(seq 100); do alive "$CTLD_PID" && return; sleep 0.1; done
  die "slurmctld did not start (see $ROOT/log/slurmctld.log)"
}

start_slurmds() {
  local n
  for n in $(node_names); do
    alive "$(slurmd_pid_file "$n")" && continue
    mkdir -p "$ROOT/spool/$n"
    /usr/sbin/slurmd -N "$n" -f "$CONF"
  done
}

wait_idle() {
  local deadline=$((SECONDS + 60)) states
  while :; do
    states="$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u || true)"
    if [ -n "$states" ] && ! grep -qvE ' (idle|mixed|allocated)$' <<<"$states" \
        && [ "$(wc -l <<<"$states")" -ge "$NUM_NODES" ]; then
      return
    fi
    [ $SECONDS -lt $deadline ] || die "nodes not idle after 60 s: $(tr '\n' ' ' <<<"$states") (logs in $ROOT/log)"
    sleep 0.2
  done
}

stop_pid_file() {
  local pid_file="$1" pid
  alive "$pid_file" || { rm -f "$pid_file"; return; }
  pid="$(cat "$pid_file" 2>/dev/null)" || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do alive "$pid_file" || { rm -f "$pid_file"; return; }; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$pid_file"
}

stop_slurmds() {
  local n
  for n in $(node_names) $(ls "$ROOT/run" 2>/dev/null | sed -nE 's/^slurmd-(.*)\.pid$/\1/p'); do
    stop_pid_file "$(slurmd_pid_file "$n")"
  done
}

# Job steps run under slurmstepd, which outlives slurmd: cancel every job first and wait
# until no step is left, then kill any stepd that still holds a step socket in our spool.
cancel_jobs() {
  alive "$CTLD_PID" || return 0
  local jobs
  jobs="$(squeue -h -o %i 2>/dev/null || true)"
  [ -z "$jobs" ] && return 0
  log "cancelling jobs: $(tr '\n' ' ' <<<"$jobs")"
  scancel $jobs 2>/dev/null || true
  for _ in $(seq 150); do
    [ -z "$(squeue -h -o %i 2>/dev/null || true)" ] && return 0
    sleep 0.2
  done
  log "jobs still listed after 30 s; stopping daemons anyway"
}

kill_orphan_stepds() {
  # This script owns the only Slurm on the host (it writes /etc/slurm/slurm.conf), so any
  # slurmstepd left once its slurmd is gone belongs to this cluster.
  local pid
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    [ "$(readlink "/proc/$pid/exe" 2>/dev/null || true)" = /usr/sbin/slurmstepd ] || continue
    grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null && continue
    log "killing leftover slurmstepd $pid"
    kill -KILL "$pid" 2>/dev/null || true
  done
}

cmd_start() {
  [ "$(id -u)" = 0 ] || die "run as root (the daemons and /etc/slurm need it)"
  install_packages
  start_munge
  start_slurmctld
  start_slurmds
  wait_idle
  log "up: $(sinfo -h -o '%P %D %T %N' | tr '\n' ' ')"
}

cmd_stop() {
  cancel_jobs
  stop_slurmds
  stop_pid_file "$CTLD_PID"
  kill_orphan_stepds
  stop_pid_file "$MUNGE_PID"
  log "stopped"
}

cmd_status() {
  local ok=0 n
  alive "$MUNGE_PID" && echo "munged: running ($(cat "$MUNGE_PID"))" || { echo "munged: stopped"; ok=1; }
  alive "$CTLD_PID" && echo "slurmctld: running ($(cat "$CTLD_PID"))" || { echo "slurmctld: stopped"; ok=1; }
  for n in $(node_names); do
    if alive "$(slurmd_pid_file "$n")"; then echo "slurmd $n: running ($(cat "$(slurmd_pid_file "$n")"))"
    else echo "slurmd $n: stopped"; ok=1; fi
  done
  if [ $ok = 0 ]; then sinfo -N -o '%N %P %T %c %m'; squeue; fi
  return $ok
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
