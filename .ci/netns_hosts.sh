#!/usr/bin/env bash
# Fake cluster on one machine for the multi-host tests: network-namespace "hosts" on a bridge, each with
# its own address on a NIC called eth0 and its own sshd (key auth for root, port 2222).
#
#   .ci/netns_hosts.sh up      # idempotent; writes $HVD_NETNS_DIR/hosts.env for the tests
#   .ci/netns_hosts.sh down    # stop the sshds, delete the namespaces and the bridge
#
# Hosts hvdh1..hvdh3 (10.213.0.11-13) run sshd; hvdh4 (10.213.0.14) exists but runs none (a host that
# refuses ssh).  Inside a namespace the names resolve through /etc/netns/<ns>/hosts, which `ip netns exec`
# mounts over /etc/hosts for that namespace only.  The root namespace is the bridge (10.213.0.1).
set -euo pipefail

STATE=${HVD_NETNS_DIR:-/tmp/hvd-netns}
BR=hvdbr0
NET=10.213.0
SSH_HOSTS=(hvdh1 hvdh2 hvdh3)
ALL_HOSTS=(hvdh1 hvdh2 hvdh3 hvdh4)
PORT=2222

addr_of() { echo "$NET.$((10 + ${1#hvdh}))"; }

install_tools() {
  local need=()
  command -v ip >/dev/null 2>&1 || need+=(iproute2)
  [ -x /usr/sbin/sshd ] || need+=(openssh-server)
  command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
  if [ ${#need[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need[@]}" >/dev/null
  fi
}

up() {
  [ "$(id -u)" = 0 ] || { echo "netns_hosts.sh: must run as root" >&2; exit 1; }
  install_tools
  mkdir -p "$STATE" /run/sshd
  chmod 700 "$STATE"
  [ -f "$STATE/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C hvd-netns -f "$STATE/id_ed25519"
  [ -f "$STATE/host_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C hvd-netns-host -f "$STATE/host_ed25519"
  cp "$STATE/id_ed25519.pub" "$STATE/authorized_keys"
  chmod 600 "$STATE/authorized_keys"

  if ! ip link show "$BR" >/dev/null 2>&1; then
    ip link add "$BR" type bridge
    ip addr add "$NET.1/24" dev "$BR"
  fi
  ip link set "$BR" up

  local hosts_file="$STATE/etc_hosts"
  { echo "127.0.0.1 localhost"; for h in "${ALL_HOSTS[@]}"; do echo "$(addr_of "$h") $h"; done; } >"$hosts_file"

  for h in "${ALL_HOSTS[@]}"; do
    local n=${h#hvdh}
    if ! ip netns list | grep -qw "$h"; then
      ip netns add "$h"
      ip link add "hvdv$n" type veth peer name eth0 netns "$h"
      ip link set "hvdv$n" master "$BR" up
      ip -n "$h" addr add "$(addr_of "$h")/24" dev eth0
      ip -n "$h" link set eth0 up
      ip -n "$h" link set lo up
    fi
    mkdir -p "/etc/netns/$h"
    cp "$hosts_file" "/etc/netns/$h/hosts"
  done

  for h in "${SSH_HOSTS[@]}"; do
    local conf="$STATE/sshd_$h.conf" pidfile="$STATE/sshd_$h.pid"
    cat >"$conf" <<EOF
Port $PORT
ListenAddress $(addr_of "$h")
HostKey $STATE/host_ed25519
PidFile $pidfile
AuthorizedKeysFile $STATE/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
MaxStartups 100:30:200
MaxSessions 100
LogLevel ERROR
EOF
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      continue
    fi
    ip netns exec "$h" /usr/sbin/sshd -f "$conf" -E "$STATE/sshd_$h.log"
  done

  cat >"$STATE/hosts.env" <<EOF
HVD_NETNS_HOSTS="${SSH_HOSTS[*]}"
HVD_NETNS_REFUSING=hvdh4
HVD_NETNS_BRIDGE_ADDR=$NET.1
HVD_NETNS_SSH_PORT=$PORT
HVD_NETNS_KEY=$STATE/id_ed25519
EOF
  # Each host must reach every other over ssh before the tests may rely on them.
  for h in "${SSH_HOSTS[@]}"; do
    for _ in $(seq 50); do
      if ip netns exec hvdh1 ssh -p "$PORT" -i "$STATE/id_ed25519" -o BatchMode=yes \
          -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR "$h" true; then
        break
      fi
      sleep 0.1
    done
  done
  echo "netns hosts up: ${SSH_HOSTS[*]} (sshd on port $PORT), refusing: hvdh4; state in $STATE"
}

down() {
  for h in "${SSH_HOSTS[@]}"; do
    local pidfile="$STATE/sshd_$h.pid"
    if [ -f "$pidfile" ]; then kill "$(cat "$pidfile")" 2>/dev/null || true; rm -f "$pidfile"; fi
  done
  for h in "${ALL_HOSTS[@]}"; do
    ip netns del "$h" 2>/dev/null || true
    rm -rf "/etc/netns/$h"
  done
  ip link del "$BR" 2>/dev/null || true
  rm -f "$STATE/hosts.env"
}

case "${1:-up}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
