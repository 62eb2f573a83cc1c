#!/usr/bin/env bash
# Multi-host rehearsal on one machine: the real `deepspeed` launcher, a hostfile of two hosts x 2 ranks,
# each host its own network namespace (a veth pair between them, addresses of their own) and its own
# hostname (UTS namespace). Trains the example MoE LM with eb_deepspeed and serves a skewed MoE layer
# with plain DeepSpeed and with ours (examples/multinode_rehearsal.py), then tears everything down.
#   bash launch/rehearse_multinode.sh            (root, `ip` and `unshare` needed; ~2-4 min here)
# Exits 0 on success; the last line is one JSON object (nodes, ranks per node, cross-node route
# fractions of plain DeepSpeed and ours, ...); the full result is in runs/rehearse/rehearsal.json.
# Each "node" runs what the launcher's pdsh path would run over ssh on a real cluster:
#   deepspeed --hostfile H --no_ssh --node_rank N --master_addr A --master_port P SCRIPT ...
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_cpu.sh"
cd "$EB_ROOT"

if [ "$(id -u)" != 0 ] || ! command -v ip > /dev/null || ! command -v unshare > /dev/null; then
  echo "rehearse_multinode: needs root, iproute2 (ip) and util-linux (unshare) to make two hosts" >&2
  exit 2
fi

run_dir="${REHEARSE_RUN_DIR:-runs/rehearse}"
case "$run_dir" in ""|/|.|..|"$HOME") echo "rehearse_multinode: REHEARSE_RUN_DIR=$run_dir is not a run directory" >&2; exit 2 ;; esac
tag="ebrh$$"                                      # namespaces and interfaces of this run only (<= 15 chars)
ns=("${tag}a" "${tag}b")
veth=("${tag}va" "${tag}vb")
hosts=("eb-host-a" "eb-host-b")
subnet="10.213.$(( $$ % 250 ))"
addr=("$subnet.1" "$subnet.2")
port=$(( 20000 + $$ % 20000 ))                   # the namespaces are fresh: any port is free there
work="$(mktemp -d)"
pids=()

cleanup() {
  for pid in "${pids[@]+"${pids[@]}"}"; do kill -- "-$pid" 2> /dev/null || kill "$pid" 2> /dev/null || true; done
  for n in "${ns[@]}"; do
    ip netns pids "$n" 2> /dev/null | xargs -r kill -9 2> /dev/null || true
    ip netns del "$n" 2> /dev/null || true
  done
  ip link del "${veth[0]}" 2> /dev/null || true
  rm -f /dev/shm/deepspeed_allreduce_buffer_*_"$port"_* 2> /dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# Two hosts: a network namespace each, joined by a veth pair.
for i in 0 1; do ip netns add "${ns[$i]}"; done
ip link add "${veth[0]}" type veth peer name "${veth[1]}"
for i in 0 1; do
  ip link set "${veth[$i]}" netns "${ns[$i]}"
  ip -n "${ns[$i]}" addr add "${addr[$i]}/24" dev "${veth[$i]}"
  ip -n "${ns[$i]}" link set lo up
  ip -n "${ns[$i]}" link set "${veth[$i]}" up
done
printf '%s slots=2\n%s slots=2\n' "${hosts[0]}" "${hosts[1]}" > "$work/hostfile"
rm -rf "$run_dir"

# One launcher per host, each with its own hostname; gloo talks over the veth pair.
for i in 0 1; do
  setsid ip netns exec "${ns[$i]}" unshare --uts bash -c "
    hostname ${hosts[$i]}
    exec env GLOO_SOCKET_IFNAME=${veth[$i]} deepspeed --hostfile $(printf %q "$work/hostfile") --no_ssh \
      --node_rank $i --master_addr ${addr[0]} --master_port $port examples/multinode_rehearsal.py \
      --run-dir $(printf %q "$run_dir")" \
    > "$work/node$i.log" 2>&1 &
  pids+=($!)
done

status=0
for i in 0 1; do
  if ! timeout "${REHEARSE_TIMEOUT:-900}" tail --pid="${pids[$i]}" -f /dev/null; then
    status=124                                     # hung: stop both hosts' launchers, then collect them
    for pid in "${pids[@]}"; do kill -- "-$pid" 2> /dev/null || true; done
  fi
  wait "${pids[$i]}" || status=$((status ? status : $?))
done
if [ "$status" != 0 ] || [ ! -f "$run_dir/rehearsal.json" ]; then
  for i in 0 1; do echo "--- ${hosts[$i]} (node rank $i), last lines:" >&2; tail -n 40 "$work/node$i.log" >&2; done
  echo "rehearse_multinode: failed (status $status)" >&2
  exit 1
fi
for i in 0 1; do cp "$work/node$i.log" "$run_dir/node$i.log"; done
python - "$run_dir/rehearsal.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
s = r["serve"]
print(json.dumps({"nodes": r["nodes"], "ranks_per_node": r["ranks_per_node"], "hosts": sorted(set(r["hosts"])),
                  "rank_to_node": r["train"]["rank_to_node"], "topology": s["topology"],
                  "allreduces_per_step": r["train"]["allreduces_per_step"], "replicas_node_spread": s["replicas_node_spread"],
                  "cross_node_route_fraction_plain": s["cross_node_route_fraction"]["plain"],
                  "cross_node_route_fraction_ours": s["cross_node_route_fraction"]["ours"],
                  "outputs_equal": s["outputs_equal"]}))
PY
