#!/usr/bin/env bash
# A real single-host Slurm cluster whose emulated nodes n[1-4] each have their own address.
#
#   bash scripts/slurm_cluster.sh start    # idempotent; installs slurm-wlm + munge (apt, root) on first use
#   bash scripts/slurm_cluster.sh status   # daemons, nodes, network, queue; exit 1 if not fully up
#   bash scripts/slurm_cluster.sh stop     # cancels jobs, stops every daemon by its pid file,
#                                          # removes the namespaces and links it made (by name)
#
# Used by the tests marked `slurm` and by CI. Debian's slurm-wlm is built with
# MULTIPLE_SLURMD, so one slurmd per emulated node (`slurmd -N nK`) runs on its own port.
# Settings and the reasons for them: the comments below and slurm/README.md ("A real cluster on one machine").
#
# Network (SAO_SLURM_NET, default auto = netns when `ip netns add` works, else loopback):
#   netns     each node nK is a network namespace `sao-nK` whose only interface `eth0` (a veth)
#             has $SUBNET.(10+K)/24 on the bridge `saobr0` (the controller: $SUBNET.1 on the
#             bridge). Nothing is routed off the machine. The node's slurmd (and so every job
#             process on it) also gets its own UTS namespace with hostname nK and an /etc/hosts
#             (bind-mounted in its own mount namespace; a copy in /etc/netns/sao-nK for `ip netns
#             exec`) where every node name resolves to that node's address, never to loopback.
#             127.0.0.1 inside a node reaches that node only, as on a real cluster.
#   loopback  fallback without CAP_NET_ADMIN: node nK listens on 127.0.0.(10+K); with
#             `unshare` allowed each slurmd still gets hostname nK and the same hosts file.
# Node count, CPUs and memory per node can be changed with SAO_SLURM_NODES (default 4),
# SAO_SLURM_CPUS (8) and SAO_SLURM_MEM_MB (16000), the subnet with SAO_SLURM_SUBNET
# (default 10.77.0); they apply at the next cold start.
set -euo pipefail

ROOT="${SAO_SLURM_ROOT:-/var/lib/sao-slurm}"
CONF=/etc/slurm/slurm.conf          # where every Slurm client looks without SLURM_CONF
NUM_NODES="${SAO_SLURM_NODES:-4}"
NODE_CPUS="${SAO_SLURM_CPUS:-8}"
NODE_MEM_MB="${SAO_SLURM_MEM_MB:-16000}"
NET_MODE="${SAO_SLURM_NET:-auto}"
SUBNET="${SAO_SLURM_SUBNET:-10.77.0}"
BRIDGE=saobr0
NETNS_PREFIX=sao-                   # namespace sao-nK, host-side veth end sao-nK
CTLD_PORT=16817                     # off the default 6817 so a real installation is never hit
NODE_PORT0=17001
MUNGE_PID=/run/munge/munged.pid
CTLD_PID="$ROOT/run/slurmctld.pid"
NET_FILE="$ROOT/run/net"            # the network mode of the running cluster (stop/status read it)
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

# --- network identity of the nodes -------------------------------------------------------
net_mode() { cat "$NET_FILE" 2>/dev/null || echo none; }
netns_of() { echo "${NETNS_PREFIX}n$1"; }
node_addr() {  # node index -> the address other nodes reach it at
  if [ "$(net_mode)" = netns ]; then echo "$SUBNET.$((10 + $1))"; else echo "127.0.0.$((10 + $1))"; fi
}
ctld_addr() { if [ "$(net_mode)" = netns ]; then echo "$SUBNET.1"; else echo 127.0.0.1; fi; }
HOSTS_FILE="$ROOT/run/hosts"          # every node's (and the controller's) /etc/hosts

choose_net_mode() {
  case "$NET_MODE" in
    netns | loopback) echo "$NET_MODE" ;;
    auto)
      local probe="${NETNS_PREFIX}probe-$$"
      if ip netns add "$probe" 2>/dev/null; then ip netns del "$probe"; echo netns; else echo loopback; fi ;;
    *) die "SAO_SLURM_NET=$NET_MODE: use auto, netns or loopback" ;;
  esac
}

# What a node sees in /etc/hosts: its own and every other node's name on their addresses.
write_hosts() {
  local i
  mkdir -p "$(dirname "$1")"
  { echo "127.0.0.1 localhost"
    echo "::1 localhost ip6-localhost ip6-loopback"
    echo "$(ctld_addr) $HOST"
    for ((i = 1; i <= NUM_NODES; i++)); do echo "$(node_addr "$i") n$i"; done
  } >"$1"
}

netns_up() {
  local i ns
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge \
    || die "cannot create bridge $BRIDGE: rerun with SAO_SLURM_NET=loopback"
  ip addr replace "$SUBNET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for ((i = 1; i <= NUM_NODES; i++)); do
    ns="$(netns_of "$i")"
    [ -e "/run/netns/$ns" ] || ip netns add "$ns"
    ip -n "$ns" link show eth0 >/dev/null 2>&1 || ip link add "$ns" type veth peer name eth0 netns "$ns"
    ip link set "$ns" master "$BRIDGE" up
    ip -n "$ns" addr replace "$(node_addr "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    cp "$HOSTS_FILE" "/etc/netns/$ns/hosts" 2>/dev/null \
      || { mkdir -p "/etc/netns/$ns"; cp "$HOSTS_FILE" "/etc/netns/$ns/hosts"; }  # for `ip netns exec`
  done
}

# Sets up the nodes' network (the mode chosen at a cold start stays until `stop`).
net_up() {
  [ -s "$NET_FILE" ] || { mkdir -p "$(dirname "$NET_FILE")"; choose_net_mode >"$NET_FILE"; }
  write_hosts "$HOSTS_FILE"
  if [ "$(net_mode)" = netns ]; then netns_up; fi
}

# Removes what netns_up made, by name; a process still inside a node namespace is a leftover
# of a job of this cluster (the daemons are stopped by then): killed by its pid.
net_down() {
  local ns pid
  for ns in $(ls /run/netns 2>/dev/null | grep -E "^${NETNS_PREFIX}n[0-9]+\$" || true); do
    for pid in $(ip netns pids "$ns" 2>/dev/null || true); do
      log "killing leftover process $pid in $ns"
      kill -KILL "$pid" 2>/dev/null || true
    done
    ip netns del "$ns" 2>/dev/null || log "could not delete namespace $ns"
    ip link del "$ns" 2>/dev/null || true  # normally gone with its peer
    rm -rf "/etc/netns/$ns"
  done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE"; fi
  rm -f "$NET_FILE" "$HOSTS_FILE"
}

# Runs a daemon as node i: in its network namespace (netns mode) with its own hostname and
# hosts file, where unshare is allowed (else plainly, loopback mode only). Not `ip netns exec`:
# it remounts /sys without the cgroup file system, and slurmd refuses to start without it.
run_as_node() {
  local i="$1"; shift
  local enter=()
  [ "$(net_mode)" = netns ] && enter=(nsenter "--net=/run/netns/$(netns_of "$i")" --)
  if "${enter[@]}" unshare --uts --mount --propagation private -- true 2>/dev/null; then
    "${enter[@]}" unshare --uts --mount --propagation private -- \
      sh -c 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"' "n$i" "$HOSTS_FILE" "$@"
  else
    [ "$(net_mode)" = loopback ] || die "cannot enter namespace $(netns_of "$i") with its own hostname"
    "$@"
  fi
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

# netns: every daemon and srun binds to its own node's address, never to every interface. The
# loopback fallback cannot: a connection to 127.0.0.12 leaves from 127.0.0.1, so the step daemons
# would call srun back on 127.0.0.1 while it listens on 127.0.0.11 ("Slurmd could not connect IO").
comm_parameters() {
  if [ "$(net_mode)" = netns ]; then
    echo "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny"
  else
    echo "# loopback fallback: srun and slurmd bind to every address (replies come from 127.0.0.1)"
    echo "CommunicationParameters=NoCtldInAddrAny"
  fi
}

node_lines() {
  local i
  for ((i = 1; i <= NUM_NODES; i++)); do
    echo "NodeName=n$i NodeHostname=n$i NodeAddr=$(node_addr "$i") Port=$((NODE_PORT0 + i - 1))" \
         "CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB State=UNKNOWN"
  done
}

write_conf() {
  # Job ids restart at 1 when state is wiped, and a reused %j folder hands submitit an
  # old result: start each cold cluster at an id taken from the clock (1 per 0.25 s,
  # wrapping after ~190 days below Slurm's MaxJobId).
  local first_job_id=$(( ($(date +%s) * 4) % 67000000 + 1 ))
  mkdir -p /etc/slurm
  cat >"$CONF" <<EOF
# Written by scripts/slurm_cluster.sh (emulated single-host cluster, network: $(net_mode)); rewritten on each cold start.
ClusterName=sao
SlurmctldHost=$HOST($(ctld_addr))
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Requeued jobs wait cred_expire s before rerunning (default 120; below 5 is ignored).
AuthInfo=cred_expire=10
$(comm_parameters)
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
$(node_lines)
PartitionName=debug Nodes=n[1-$NUM_NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

start_slurmctld() {
  alive "$CTLD_PID" && return
  # Cold start: no slurmd may survive from an earlier cluster (it would hold the ports).
  stop_slurmds
  rm -rf "$ROOT/state" "$ROOT/spool"
  mkdir -p "$ROOT/state" "$ROOT/run" "$ROOT/log"
  net_down
  net_up
  write_conf
  # NoCtldInAddrAny binds slurmctld to what its hostname resolves to: on the bridge, not loopback.
  if [ "$(net_mode)" = netns ]; then
    unshare --mount --propagation private -- \
      sh -c 'mount --bind "$0" /etc/hosts && exec "$@"' "$HOSTS_FILE" /usr/sbin/slurmctld -c -f "$CONF"
  else
    /usr/sbin/slurmctld -c -f "$CONF"
  fi
  for _ in $(seq 100); do alive "$CTLD_PID" && return; sleep 0.1; done
  die "slurmctld did not start (see $ROOT/log/slurmctld.log)"
}

start_slurmds() {
  local n
  for n in $(node_names); do
    alive "$(slurmd_pid_file "$n")" && continue
    mkdir -p "$ROOT/spool/$n"
    run_as_node "${n#n}" /usr/sbin/slurmd -N "$n" -f "$CONF"
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
  net_up  # a no-op when up; recreates links a crash or a manual `ip` took away
  start_slurmds
  wait_idle
  log "up: $(sinfo -h -o '%P %D %T %N' | tr '\n' ' ')"
}

cmd_stop() {
  cancel_jobs
  stop_slurmds
  stop_pid_file "$CTLD_PID"
  kill_orphan_stepds
  net_down
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
  echo "network: $(net_mode)$( [ "$(net_mode)" = netns ] && echo " (bridge $BRIDGE, namespaces ${NETNS_PREFIX}n*)")"
  if [ $ok = 0 ]; then sinfo -N -o '%N %P %T %c %m %o'; squeue; fi
  return $ok
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
