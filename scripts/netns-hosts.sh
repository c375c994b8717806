#!/usr/bin/env bash
# Several "hosts" on one machine, for multi-host tests, made of Linux network
# namespaces joined by a bridge.
#
# Usage (as root):
#   scripts/netns-hosts.sh check        exit 0 when namespaces can be made here,
#                                       else print the reason on stderr, exit 1
#   scripts/netns-hosts.sh up N         make hosts fth0 .. fth{N-1} (1 <= N <= 253)
#   scripts/netns-hosts.sh down         remove everything "up" made (no-op if none)
#   scripts/netns-hosts.sh link HOST down|up
#                                       take HOST's eth0 down (a network partition
#                                       of that host) or bring it back up
#   scripts/netns-hosts.sh shape HOST [--delay-ms D] [--loss-pct L] [--rate-mbit R]
#                                       shape what HOST sends (see below)
#   scripts/netns-hosts.sh unshape HOST remove any shaping from HOST
#
# HOST is an index (0) or a namespace name (fth0).
#
# Layout after "up N": a bridge ftbr0 in the root namespace (up, no address);
# for each host i a namespace fth{i} holding lo (up) and eth0 with
# 10.231.0.{i+1}/24, the peer of a veth whose root end fth{i}-br is enslaved to
# ftbr0 (up, no address). No default route, no NAT, no forwarding: traffic
# between the hosts stays on the bridge and nothing leaves the machine. Run a
# program on a host with `ip netns exec fth{i} PROGRAM...`.
#
# "up N" when exactly those N hosts already exist only brings their links up
# again (running programs and shaping are kept); any other state (another N,
# a half-made set) is torn down and rebuilt. "down" SIGKILLs every process
# still inside an fth namespace, then deletes the namespaces, the fth*-br
# links and the bridge.
#
# Shaping (egress of HOST's eth0, i.e. what HOST sends):
#   --delay-ms given: one netem qdisc (delay, plus loss and rate when given).
#       Where the kernel has no netem (CONFIG_NET_SCH_NETEM unset) this exits
#       with code 3 and says so, so the caller can skip.
#   no --delay-ms: works without netem: a tbf qdisc for --rate-mbit and an
#       nftables table "fusetrain_shape" in HOST's namespace dropping
#       L% of what leaves eth0 at random (numgen random mod 10000 < L*100)
#       for --loss-pct: in the netdev egress hook (every frame, ARP too, and
#       the sender sees no error, as on a lossy wire), or where the kernel
#       has no egress hook (< 5.16) in the inet output hook (IP only; a
#       dropped send fails with EPERM). Exits 3 when nft (package nftables)
#       or the kernel's nf_tables is missing.
#   A new "shape" replaces the host's previous shaping; one that fails
#   (exit 3 included) leaves the host unshaped.
#
# Note: where the br_netfilter module is loaded and
# net.bridge.bridge-nf-call-iptables=1, bridged frames pass the root
# namespace's iptables FORWARD chain; a DROP policy there (Docker sets one)
# would cut the hosts off from each other.
set -euo pipefail

export PATH="/usr/sbin:/sbin:/usr/bin:/bin:$PATH"

BRIDGE=ftbr0
NS_PREFIX=fth
SUBNET=10.231.0
IFACE=eth0
NFT_TABLE=fusetrain_shape
LOCK=/run/lock/fusetrain-netns-hosts.lock
EXIT_UNSUPPORTED=3

die() { echo "netns-hosts: $*" >&2; exit 1; }
unsupported() { echo "netns-hosts: $*" >&2; exit "$EXIT_UNSUPPORTED"; }

usage() {
  sed -n '5,16p' "$0" | sed 's/^# \{0,1\}//'
}

# Why namespaces cannot be made here (empty when they can).
check_reason() {
  if [ "$(id -u)" -ne 0 ]; then
    echo "not root (network namespaces need root)"; return
  fi
  if ! command -v ip >/dev/null 2>&1; then
    echo "'ip' not found (install iproute2)"; return
  fi
  local probe="ftcheck$$" err
  if ! err=$(ip netns add "$probe" 2>&1); then
    echo "network namespaces not permitted here: ip netns add: $err"; return
  fi
  # veth and bridge, made inside the throwaway namespace so the root one is untouched.
  if ! err=$(ip -n "$probe" link add ftcheck-a type veth peer name ftcheck-b 2>&1); then
    ip netns del "$probe" 2>/dev/null || true
    echo "veth links not available: $err"; return
  fi
  if ! err=$(ip -n "$probe" link add ftcheck-br type bridge 2>&1); then
    ip netns del "$probe" 2>/dev/null || true
    echo "bridge links not available: $err"; return
  fi
  if ! err=$(ip netns del "$probe" 2>&1); then
    echo "cannot delete a network namespace: $err"; return
  fi
}

need_root() {
  [ "$(id -u)" -eq 0 ] || die "not root (network namespaces need root)"
  command -v ip >/dev/null 2>&1 || die "'ip' not found (install iproute2)"
}

need_netns() {
  local why
  why=$(check_reason)
  [ -z "$why" ] || die "$why"
}

# One invocation at a time changes the hosts.
take_lock() {
  mkdir -p "$(dirname "$LOCK")"
  exec 9>"$LOCK"
  flock -w 60 9 || die "timed out waiting for $LOCK"
}

our_namespaces() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${NS_PREFIX}[0-9]+\$" || true
}

our_links() {
  ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 \
    | grep -E "^${NS_PREFIX}[0-9]+-br\$" || true
}

have_link() { ip link show dev "$1" >/dev/null 2>&1; }

# HOST (index or fthI) -> namespace name, which must exist.
host_ns() {
  local h=$1
  [[ $h =~ ^${NS_PREFIX}([0-9]+)$ ]] && h=${BASH_REMATCH[1]}
  [[ $h =~ ^[0-9]+$ ]] || die "bad host '$1' (an index or ${NS_PREFIX}N)"
  local ns="${NS_PREFIX}$((10#$h))"
  ip netns list | awk '{print $1}' | grep -qx "$ns" || die "no host $ns (run: $0 up N)"
  echo "$ns"
}

# True when exactly hosts 0..N-1 exist, each fully wired.
is_up() {
  local n=$1 i ns
  have_link "$BRIDGE" || return 1
  [ "$(our_namespaces | sort)" = "$(for ((i = 0; i < n; i++)); do echo "${NS_PREFIX}$i"; done | sort)" ] || return 1
  [ "$(our_links | sort)" = "$(for ((i = 0; i < n; i++)); do echo "${NS_PREFIX}$i-br"; done | sort)" ] || return 1
  for ((i = 0; i < n; i++)); do
    ns="${NS_PREFIX}$i"
    ip -o link show dev "$ns-br" 2>/dev/null | grep -q "master $BRIDGE " || return 1
    ip -n "$ns" -4 -o addr show dev "$IFACE" 2>/dev/null | grep -q " $SUBNET.$((i + 1))/24 " || return 1
  done
}

cmd_down() {
  local ns link pids
  for ns in $(our_namespaces); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    if [ -n "$pids" ]; then
      # shellcheck disable=SC2086
      kill -KILL $pids 2>/dev/null || true
    fi
    ip netns del "$ns" 2>/dev/null || true
  done
  # Deleting a veth end deletes its peer, also where a namespace lingers.
  for link in $(our_links); do
    ip link del dev "$link" 2>/dev/null || true
  done
  if have_link "$BRIDGE"; then
    ip link del dev "$BRIDGE"
  fi
  [ -z "$(our_namespaces)" ] || die "namespaces left: $(our_namespaces | tr '\n' ' ')"
  [ -z "$(our_links)" ] || die "links left: $(our_links | tr '\n' ' ')"
}

# No IPv6 link-local address either on the root namespace's links.
no_addresses() {
  ip link set dev "$1" addrgenmode none 2>/dev/null \
    || { [ -w "/proc/sys/net/ipv6/conf/$1/disable_ipv6" ] && echo 1 >"/proc/sys/net/ipv6/conf/$1/disable_ipv6"; } \
    || true
}

build() {
  local n=$1 i ns
  ip link add name "$BRIDGE" type bridge stp_state 0
  no_addresses "$BRIDGE"
  ip link set dev "$BRIDGE" up
  for ((i = 0; i < n; i++)); do
    ns="${NS_PREFIX}$i"
    ip netns add "$ns"
    ip -n "$ns" link set dev lo up
    ip link add name "$ns-br" type veth peer name "$IFACE" netns "$ns"
    no_addresses "$ns-br"
    ip link set dev "$ns-br" master "$BRIDGE"
    ip link set dev "$ns-br" up
    ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev "$IFACE"
    ip -n "$ns" link set dev "$IFACE" up
  done
}

cmd_up() {
  local n=${1:-}
  [[ $n =~ ^[0-9]+$ ]] && ((10#$n >= 1 && 10#$n <= 253)) || die "up N: N must be 1..253, got '${n}'"
  n=$((10#$n))
  if is_up "$n"; then
    local i
    ip link set dev "$BRIDGE" up
    for ((i = 0; i < n; i++)); do
      ip link set dev "${NS_PREFIX}$i-br" up
      ip -n "${NS_PREFIX}$i" link set dev lo up
      ip -n "${NS_PREFIX}$i" link set dev "$IFACE" up
    done
    return 0
  fi
  cmd_down
  # A failing step ends the script (set -e); the trap then removes the half-made set.
  trap up_failed EXIT
  build "$n"
  trap - EXIT
}

up_failed() {
  echo "netns-hosts: up failed; removing what it made" >&2
  cmd_down || true
}

cmd_link() {
  local ns state=${2:-}
  ns=$(host_ns "${1:-}")
  case "$state" in
    up|down) ip -n "$ns" link set dev "$IFACE" "$state" ;;
    *) die "link HOST down|up, got '$state'" ;;
  esac
}

unshape_ns() {
  local ns=$1
  ip netns exec "$ns" tc qdisc del dev "$IFACE" root 2>/dev/null || true
  if command -v nft >/dev/null 2>&1; then
    ip netns exec "$ns" nft delete table netdev "$NFT_TABLE" 2>/dev/null || true
    ip netns exec "$ns" nft delete table inet "$NFT_TABLE" 2>/dev/null || true
  fi
}

is_number() { [[ $1 =~ ^[0-9]+([.][0-9]+)?$ ]]; }

cmd_shape() {
  local ns delay="" loss="" rate=""
  ns=$(host_ns "${1:-}")
  shift
  while (($#)); do
    case "$1" in
      --delay-ms) delay=${2:-}; shift 2 || die "--delay-ms needs a value" ;;
      --loss-pct) loss=${2:-}; shift 2 || die "--loss-pct needs a value" ;;
      --rate-mbit) rate=${2:-}; shift 2 || die "--rate-mbit needs a value" ;;
      *) die "shape: unknown argument '$1'" ;;
    esac
  done
  [ -z "$delay" ] || is_number "$delay" || die "--delay-ms: not a number: '$delay'"
  [ -z "$loss" ] || { is_number "$loss" && awk -v l="$loss" 'BEGIN{exit !(l <= 100)}'; } \
    || die "--loss-pct: want 0..100, got '$loss'"
  [ -z "$rate" ] || { is_number "$rate" && awk -v r="$rate" 'BEGIN{exit !(r > 0)}'; } \
    || die "--rate-mbit: want a positive number, got '$rate'"
  [ -n "$delay$loss$rate" ] || die "shape: give --delay-ms, --loss-pct and/or --rate-mbit"

  unshape_ns "$ns"
  local err
  if [ -n "$delay" ]; then
    local args=(delay "${delay}ms")
    [ -z "$loss" ] || args+=(loss "${loss}%")
    [ -z "$rate" ] || args+=(rate "${rate}mbit")
    if ! err=$(ip netns exec "$ns" tc qdisc replace dev "$IFACE" root netem "${args[@]}" 2>&1); then
      if grep -qiE "unknown|not supported|no such file" <<<"$err"; then
        unsupported "netem is not available in this kernel (CONFIG_NET_SCH_NETEM): $err"
      fi
      die "tc netem: $err"
    fi
    return 0
  fi

  local cut=0
  [ -z "$loss" ] || cut=$(awk -v l="$loss" 'BEGIN{printf "%d", l * 100 + 0.5}')
  if ((cut > 0)); then
    command -v nft >/dev/null 2>&1 || unsupported "loss without netem needs nft (apt-get install nftables)"
    # numgen gives 0..9999: drop when below L*100 (every packet at 100%).
    local match="numgen random mod 10000 < $cut "
    ((cut < 10000)) || match=""
    # The netdev egress hook (kernel >= 5.16) drops like a lossy wire: the
    # sender sees no error. Without it, the inet output hook, where a dropped
    # packet fails the sender's send with EPERM.
    if ! err=$(ip netns exec "$ns" nft -f - 2>&1 <<EOF
table netdev $NFT_TABLE {
  chain out {
    type filter hook egress device "$IFACE" priority 0; policy accept;
    ${match}counter drop
  }
}
EOF
    ); then
      echo "netns-hosts: no netdev egress hook ($err); dropping in the inet output hook" \
           "(senders see EPERM for dropped packets)" >&2
      if ! err=$(ip netns exec "$ns" nft -f - 2>&1 <<EOF
table inet $NFT_TABLE {
  chain out {
    type filter hook output priority 0; policy accept;
    oifname "$IFACE" ${match}counter drop
  }
}
EOF
      ); then
        unshape_ns "$ns"
        if grep -qiE "not supported|protocol not supported|no such file" <<<"$err"; then
          unsupported "nftables is not available in this kernel: $err"
        fi
        die "nft: $err"
      fi
    fi
  fi
  if [ -n "$rate" ]; then
    # burst: 10 ms at the rate, at least 16 KiB; queue up to 50 ms.
    local burst
    burst=$(awk -v r="$rate" 'BEGIN{b = r * 1e6 / 8 / 100; if (b < 16384) b = 16384; printf "%d", b}')
    if ! err=$(ip netns exec "$ns" tc qdisc replace dev "$IFACE" root tbf rate "${rate}mbit" \
                 burst "$burst" latency 50ms 2>&1); then
      unshape_ns "$ns"
      if grep -qiE "unknown|not supported" <<<"$err"; then
        unsupported "tbf is not available in this kernel: $err"
      fi
      die "tc tbf: $err"
    fi
  fi
}

cmd_unshape() {
  local ns
  ns=$(host_ns "${1:-}")
  unshape_ns "$ns"
}

main() {
  local cmd=${1:-}
  (($#)) && shift
  case "$cmd" in
    check)
      local why
      why=$(check_reason)
      if [ -n "$why" ]; then
        echo "netns-hosts: $why" >&2
        exit 1
      fi
      ;;
    up) need_netns; take_lock; cmd_up "$@" ;;
    down) need_root; take_lock; cmd_down ;;
    link) need_root; take_lock; cmd_link "$@" ;;
    shape) need_root; take_lock; cmd_shape "$@" ;;
    unshape) need_root; take_lock; cmd_unshape "$@" ;;
    -h|--help|help) usage ;;
    *) usage >&2; exit 2 ;;
  esac
}

main "$@"
