#!/usr/bin/env bash
# Two hosts on this machine, for trying a two-node launch by hand (root): the same setup as the tests'
# fixture (tests/common/netns.rs): network namespaces harpe-a and harpe-b joined by a veth pair, 10.77.0.1
# and 10.77.0.2, loopback up, and per-host /etc/hosts naming node01 and node02 (with --debian, each host's
# own name is 127.0.1.1 there, as Debian's default /etc/hosts has it). No link to the machine's network.
#
#   scripts/two-hosts.sh up [--debian]
#   scripts/two-hosts.sh run a|b COMMAND...   # COMMAND on node01 (a) or node02 (b), under that host name
#   scripts/two-hosts.sh down
set -euo pipefail
NET=10.77.0
up() {
  local debian="${1:-}"
  ip netns add harpe-a
  ip netns add harpe-b
  ip link add harpe-va type veth peer name harpe-vb
  local i=1
  for h in a b; do
    ip link set "harpe-v$h" netns "harpe-$h"
    ip -n "harpe-$h" addr add "$NET.$i/24" dev "harpe-v$h"
    ip -n "harpe-$h" link set "harpe-v$h" up
    ip -n "harpe-$h" link set lo up
    mkdir -p "/etc/netns/harpe-$h"
    {
      echo "127.0.0.1 localhost"
      for j in 1 2; do
        if [ "$debian" = "--debian" ] && [ "$j" = "$i" ]; then echo "127.0.1.1 node0$j"; else echo "$NET.$j node0$j"; fi
      done
    } > "/etc/netns/harpe-$h/hosts"
    i=$((i + 1))
  done
  echo "node01 = $NET.1 (harpe-a), node02 = $NET.2 (harpe-b); run: $0 run a|b COMMAND...; tear down: $0 down" >&2
}
down() {
  ip netns del harpe-a 2>/dev/null || true
  ip netns del harpe-b 2>/dev/null || true
  rm -rf /etc/netns/harpe-a /etc/netns/harpe-b
}
case "${1:-}" in
  up) shift; up "$@" ;;
  down) down ;;
  run)
    h="$2"; shift 2
    name=node01; [ "$h" = b ] && name=node02
    exec ip netns exec "harpe-$h" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$name" "$@"
    ;;
  *) echo "usage: $0 up [--debian] | run a|b COMMAND... | down" >&2; exit 2 ;;
esac
