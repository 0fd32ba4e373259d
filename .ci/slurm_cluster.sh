#!/usr/bin/env bash
# A real Slurm cluster on this machine for tests/multihost/test_slurm.py: Debian's slurm-wlm
# (slurmctld + slurmd on localhost, munge for authentication), no systemd needed.
#
#   .ci/slurm_cluster.sh up      # idempotent: installs the packages when missing, starts what is not running
#   .ci/slurm_cluster.sh down    # stop slurmd, slurmctld and munged (the ones this script started)
#
# The configuration goes to /etc/slurm/slurm.conf (where srun/sbatch look by default), the daemons' state,
# logs and pid files to $HVD_SLURM_DIR (default /tmp/hvd-slurm).  One partition "ci" (the default) with this
# host as its only node.  When the network-namespace hosts of .ci/netns_hosts.sh are up (run it first), a
# second partition "hosts" has two of them as nodes (hvdh1, hvdh2 at their bridge addresses), each with its
# own slurmd started inside its namespace, so that `srun -p hosts -N 2` runs a task on each and the tasks
# talk across the bridge; slurmctld then listens at the bridge's address (127.0.0.1 inside a namespace is
# its own loopback).  Without the namespaces there is no "hosts" partition.  Every node has its own spool,
# pid and log files and TmpFS (%n: the nodes share one filesystem, and Slurm's PMIx plugin makes the same
# spmix_appdir_<uid>_<job>.<step> directory under TmpFS on every node of a step).  Also MpiDefault=none
# (Slurm's default: srun wires MPI only when asked, --mpi=pmix or pmi2), and 8 CPUs advertised whatever the
# machine has (SlurmdParameters=config_overrides) so that a 2-task step fits on a 2-core machine while a
# finished step is still being cleaned up.
set -euo pipefail

STATE=${HVD_SLURM_DIR:-/tmp/hvd-slurm}
CONF=/etc/slurm/slurm.conf
NODE=$(hostname -s)
NETNS_ENV=${HVD_NETNS_DIR:-/tmp/hvd-netns}/hosts.env
NS_NODES=(hvdh1 hvdh2)
CTLD_ADDR=127.0.0.1
NS_UP=()       # the namespace hosts that exist, with their addresses in NS_ADDR
declare -A NS_ADDR=()

# The namespace hosts of .ci/netns_hosts.sh that exist (all of NS_NODES or none), and the bridge's address.
find_netns_hosts() {
  [ -f "$NETNS_ENV" ] || return 0
  local bridge addr h
  bridge=$(sed -n 's/^HVD_NETNS_BRIDGE_ADDR=//p' "$NETNS_ENV")
  [ -n "$bridge" ] && ip -4 -o addr show 2>/dev/null | grep -qF " $bridge/" || return 0
  for h in "${NS_NODES[@]}"; do
    addr=$(ip -n "$h" -4 -o addr show dev eth0 2>/dev/null | awk '{print $4}' | cut -d/ -f1)
    [ -n "$addr" ] || { NS_UP=(); NS_ADDR=(); return 0; }
    NS_UP+=("$h"); NS_ADDR[$h]=$addr
  done
  CTLD_ADDR=$bridge
}

install_packages() {
  if ! command -v slurmctld >/dev/null 2>&1 || ! command -v slurmd >/dev/null 2>&1 \
      || ! command -v srun >/dev/null 2>&1 || [ ! -x /usr/sbin/munged ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # No recommends: they pull in ~30 plugin packages (HDF5, IPMI, ROCm...) the tests never load.
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  fi
}

MARK="# Written by .ci/slurm_cluster.sh (Horovod CI): a one-node cluster on this host."

write_conf() {
  if [ -s "$CONF" ] && ! head -n 1 "$CONF" | grep -qxF "$MARK"; then
    echo "slurm_cluster.sh: $CONF exists and is not ours (a real cluster's?): not touching it" >&2
    exit 1
  fi
  mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d" "$STATE/log"
  cat >"$CONF.new" <<EOF
$MARK
ClusterName=hvdci
SlurmctldHost=$NODE($CTLD_ADDR)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d/%n
TmpFS=$STATE/tmp/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
MinJobAge=4
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=ci Nodes=$NODE Default=YES MaxTime=10 State=UP OverSubscribe=NO
EOF
  if [ ${#NS_UP[@]} -gt 0 ]; then
    local h
    for h in "${NS_UP[@]}"; do
      echo "NodeName=$h NodeAddr=${NS_ADDR[$h]} CPUs=8 State=UNKNOWN" >>"$CONF.new"
    done
    local IFS=,
    echo "PartitionName=hosts Nodes=${NS_UP[*]} MaxTime=10 State=UP OverSubscribe=NO" >>"$CONF.new"
  fi
  if cmp -s "$CONF.new" "$CONF"; then rm -f "$CONF.new"; return 1; fi
  mv "$CONF.new" "$CONF"
  return 0
}

# The pid file's process runs (a zombie does not count: in a container PID 1 may never reap a killed daemon).
alive() {
  local pid state
  [ -f "$1" ] || return 1
  pid=$(cat "$1")
  state=$(ps -o stat= -p "$pid" 2>/dev/null) || return 1
  [ -n "$state" ] && [ "${state#Z}" = "$state" ]
}

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
  [ -s /etc/munge/munge.key ] || { mungekey -c -f -k /etc/munge/munge.key; chown munge:munge /etc/munge/munge.key; }
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- /usr/sbin/munged --force
  for _ in $(seq 50); do
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return
    sleep 0.1
  done
  echo "slurm_cluster.sh: munged did not come up" >&2; exit 1
}

node_ready() { sinfo -h -N -n "$1" -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; }
all_ready() { local n; for n in "$NODE" "${NS_UP[@]}"; do node_ready "$n" || return 1; done; }

up() {
  [ "$(id -u)" = 0 ] || { echo "slurm_cluster.sh: must run as root" >&2; exit 1; }
  install_packages
  local changed=0 n pid
  find_netns_hosts
  write_conf && changed=1
  start_munge
  if [ "$changed" = 1 ]; then stop_slurm; fi
  alive "$STATE/slurmctld.pid" || slurmctld -i
  for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.1; done
  for n in "$NODE" "${NS_UP[@]}"; do mkdir -p "$STATE/d/$n" "$STATE/tmp/$n"; done
  alive "$STATE/slurmd-$NODE.pid" || slurmd -N "$NODE" \
    || { echo "slurm_cluster.sh: slurmd did not start:" >&2; tail -n 5 "$STATE/log/slurmd-$NODE.log" >&2; exit 1; }
  for n in "${NS_UP[@]}"; do
    # Only the network namespace: `ip netns exec` would also remount /sys, without the cgroup mounts that
    # slurmd 22.05 insists on reading.
    if alive "$STATE/slurmd-$n.pid" && [ "$(stat -L -c %i "/proc/$(cat "$STATE/slurmd-$n.pid")/ns/net")" \
        != "$(stat -L -c %i "/run/netns/$n")" ]; then
      # Left in a namespace that .ci/netns_hosts.sh has since deleted and made anew: unreachable.
      pid=$(cat "$STATE/slurmd-$n.pid"); kill "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      rm -f "$STATE/slurmd-$n.pid"
    fi
    alive "$STATE/slurmd-$n.pid" || nsenter --net="/run/netns/$n" slurmd -N "$n" \
      || { echo "slurm_cluster.sh: slurmd of $n did not start:" >&2; tail -n 5 "$STATE/log/slurmd-$n.log" >&2; exit 1; }
  done
  for _ in $(seq 150); do
    all_ready && break
    sleep 0.2
  done
  for n in "$NODE" "${NS_UP[@]}"; do
    if ! node_ready "$n"; then
      # A node left DOWN/DRAINED by an earlier run (killed daemons) is brought back.
      scontrol update NodeName="$n" State=RESUME 2>/dev/null || true
    fi
  done
  for _ in $(seq 50); do all_ready && break; sleep 0.2; done
  if ! all_ready; then
    echo "slurm_cluster.sh: nodes are not up: $(sinfo -N 2>&1 | tail -n +2)" >&2
    tail -n 20 "$STATE/log/slurmctld.log" "$STATE/log/"slurmd-*.log >&2 || true
    exit 1
  fi
  if [ ${#NS_UP[@]} -gt 0 ]; then
    echo "slurm cluster up: node $NODE, partition ci; nodes ${NS_UP[*]} (network namespaces), partition" \
      "hosts; state in $STATE"
  else
    echo "slurm cluster up: node $NODE, partition ci (no network-namespace hosts: no partition hosts); state in $STATE"
  fi
}

stop_slurm() {
  local pid f
  # Every node's slurmd (slurmd-<node>.pid; slurmd.pid from an older version of this script), then slurmctld.
  for f in "$STATE"/slurmd*.pid "$STATE/slurmctld.pid"; do
    [ -e "$f" ] || continue
    if alive "$f"; then
      pid=$(cat "$f")
      kill "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$f"
  done
}

down() {
  stop_slurm
  if [ -f /run/munge/munged.pid ]; then kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true; fi
}

case "${1:-up}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
