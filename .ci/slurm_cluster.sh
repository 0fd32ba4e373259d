#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine for tests/multihost/test_slurm.py: Debian's slurm-wlm
# (slurmctld + slurmd on localhost, munge for authentication), no systemd needed.
#
#   .ci/slurm_cluster.sh up      # idempotent: installs the packages when missing, starts what is not running
#   .ci/slurm_cluster.sh down    # stop slurmd, slurmctld and munged (the ones this script started)
#
# The configuration goes to /etc/slurm/slurm.conf (where srun/sbatch look by default), the daemons' state,
# logs and pid files to $HVD_SLURM_DIR (default /tmp/hvd-slurm).  One partition "ci" with this host as its
# only node, MpiDefault=none (Slurm's default: srun wires MPI only when asked, --mpi=pmix or pmi2), and 8
# CPUs advertised whatever the machine has (SlurmdParameters=config_overrides) so that a 2-task step fits on
# a 2-core machine while a finished step is still being cleaned up.
set -euo pipefail

STATE=${HVD_SLURM_DIR:-/tmp/hvd-slurm}
CONF=/etc/slurm/slurm.conf
NODE=$(hostname -s)

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
SlurmctldHost=$NODE(127.0.0.1)
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
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
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

node_ready() { sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; }

up() {
  [ "$(id -u)" = 0 ] || { echo "slurm_cluster.sh: must run as root" >&2; exit 1; }
  install_packages
  local changed=0
  write_conf && changed=1
  start_munge
  if [ "$changed" = 1 ]; then stop_slurm; fi
  alive "$STATE/slurmctld.pid" || slurmctld -i
  for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.1; done
  alive "$STATE/slurmd.pid" || slurmd -N "$NODE"
  for _ in $(seq 150); do
    node_ready && break
    sleep 0.2
  done
  if ! node_ready; then
    # A node left DOWN/DRAINED by an earlier run (killed daemons) is brought back.
    scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true
    for _ in $(seq 50); do node_ready && break; sleep 0.2; done
  fi
  if ! node_ready; then
    echo "slurm_cluster.sh: node $NODE is not up: $(sinfo -N 2>&1 | tail -n +2)" >&2
    tail -n 20 "$STATE/log/slurmctld.log" "$STATE/log/slurmd.log" >&2 || true
    exit 1
  fi
  echo "slurm cluster up: node $NODE, partition ci; state in $STATE"
}

stop_slurm() {
  local pid
  for d in slurmd slurmctld; do
    if alive "$STATE/$d.pid"; then
      pid=$(cat "$STATE/$d.pid")
      kill "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$STATE/$d.pid"
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
