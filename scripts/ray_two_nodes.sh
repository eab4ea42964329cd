#!/usr/bin/env bash
# A two-node Ray cluster on one machine: two network namespaces joined by a veth pair
# (10.200.0.1 "head", 10.200.0.2 "worker"), `ray start --head` in one and
# `ray start --address=10.200.0.1:PORT` in the other, so the nodes talk over a real
# network interface. Runs CMD inside the head namespace with RAY_ADDRESS set, then
# tears everything down (trap: ray stop, namespaces, temp dir), and exits with CMD's
# status.
#
#   sudo scripts/ray_two_nodes.sh [--] CMD [ARGS...]
#
# Environment: RAY (the `ray` executable; default: next to $PYTHON or on PATH),
# RAY_NODE_CPUS (logical CPUs per node, default 1), FE_RAY_NET (the /24 prefix,
# default 10.200.0), FE_RAY_INFO (a file that gets "head_ns=.. worker_ns=.." lines).
# Needs root (ip netns). Exit 2: namespaces cannot be created here.
set -euo pipefail
[[ "${1:-}" == "--" ]] && shift
if [[ $# -eq 0 ]]; then echo "usage: $0 [--] CMD [ARGS...]" >&2; exit 64; fi

RAY=${RAY:-$(command -v ray || true)}
if [[ -z "$RAY" ]]; then echo "ray_two_nodes: no 'ray' executable (pip install flowengine[ray])" >&2; exit 2; fi
NET=${FE_RAY_NET:-10.200.0}
CPUS=${RAY_NODE_CPUS:-1}
ID=$$
HEAD_NS=fe-ray-h$ID WORKER_NS=fe-ray-w$ID
HEAD_IF=ferh$ID WORKER_IF=ferw$ID
HEAD_IP=$NET.1 WORKER_IP=$NET.2
PORT=6379
TMP=$(mktemp -d /tmp/fe-ray-XXXXXX)

cleanup() {
  set +e
  ip netns exec "$WORKER_NS" "$RAY" stop --force >/dev/null 2>&1
  ip netns exec "$HEAD_NS" "$RAY" stop --force >/dev/null 2>&1
  # Whatever is left in the namespaces (ray stop missed it) is ours: end it by pid.
  for ns in "$WORKER_NS" "$HEAD_NS"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
  done
  ip netns del "$WORKER_NS" 2>/dev/null
  ip netns del "$HEAD_NS" 2>/dev/null  # also removes the veth pair
  rm -rf "$TMP" "$TMP.head.log" "$TMP.worker.log"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if ! ip netns add "$HEAD_NS" 2>/dev/null; then
  echo "ray_two_nodes: 'ip netns add' is not permitted here" >&2; exit 2
fi
ip netns add "$WORKER_NS"
ip link add "$HEAD_IF" type veth peer name "$WORKER_IF"
ip link set "$HEAD_IF" netns "$HEAD_NS"
ip link set "$WORKER_IF" netns "$WORKER_NS"
ip -n "$HEAD_NS" addr add "$HEAD_IP/24" dev "$HEAD_IF"
ip -n "$WORKER_NS" addr add "$WORKER_IP/24" dev "$WORKER_IF"
for ns in "$HEAD_NS" "$WORKER_NS"; do ip -n "$ns" link set lo up; done
ip -n "$HEAD_NS" link set "$HEAD_IF" up
ip -n "$WORKER_NS" link set "$WORKER_IF" up

export RAY_USAGE_STATS_ENABLED=0
# A small object store: the engine passes no objects through it.
COMMON=(--num-cpus="$CPUS" --num-gpus=0 --object-store-memory=$((128 << 20)) --disable-usage-stats)
ip netns exec "$HEAD_NS" "$RAY" start --head --node-ip-address="$HEAD_IP" --port="$PORT" \
  --include-dashboard=false --temp-dir="$TMP/head" "${COMMON[@]}" >"$TMP.head.log" 2>&1 \
  || { cat "$TMP.head.log" >&2; exit 1; }
# Both nodes share this machine's file system: each gets its own temp dir (sockets, logs).
ip netns exec "$WORKER_NS" "$RAY" start --address="$HEAD_IP:$PORT" --node-ip-address="$WORKER_IP" \
  --temp-dir="$TMP/worker" "${COMMON[@]}" >"$TMP.worker.log" 2>&1 \
  || { cat "$TMP.worker.log" >&2; exit 1; }
rm -f "$TMP.head.log" "$TMP.worker.log"
if [[ -n "${FE_RAY_INFO:-}" ]]; then
  printf 'head_ns=%s\nworker_ns=%s\nhead_ip=%s\nworker_ip=%s\n' \
    "$HEAD_NS" "$WORKER_NS" "$HEAD_IP" "$WORKER_IP" >"$FE_RAY_INFO"
fi
set +e
ip netns exec "$HEAD_NS" env RAY_ADDRESS="$HEAD_IP:$PORT" "$@"
rc=$?
exit $rc
