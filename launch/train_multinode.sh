#!/usr/bin/env bash
# Multi-node training of the example MoE LM with the deepspeed launcher (a GPU cluster: NCCL; the CUDA torch
# of your cluster and `pip install -e .` on every node, same path). docs/multinode.md says what to expect.
#
#   HOSTFILE=hostfile bash launch/train_multinode.sh [--dry-run] [examples/train_moe_lm.py arguments]
#       one command on the first node; the launcher starts every node over ssh (pdsh)
#   HOSTFILE=hostfile MASTER_ADDR=10.0.0.1 NODE_RANK=N bash launch/train_multinode.sh --no-ssh [...]
#       one command per node (no ssh between nodes: Slurm steps, containers), N = 0 .. nodes - 1
#
# hostfile: one line per node, `HOSTNAME slots=GPUS`. Environment: MASTER_ADDR (default: the first host),
# MASTER_PORT (29500), EP_SIZE (default: every rank when 16 experts divide evenly, else a node's ranks),
# CONFIG (configs/train_8gpu.json), RUN_DIR (runs/multinode). Set NCCL_SOCKET_IFNAME (and GLOO_SOCKET_IFNAME)
# to the interface between the nodes when hosts have several; the launcher forwards NCCL_* to every rank.
# --dry-run checks the hostfile and prints the world and the command instead of running it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

dry=0; no_ssh=0; args=()
for a in "$@"; do
  case "$a" in
    --dry-run) dry=1 ;;
    --no-ssh) no_ssh=1 ;;
    *) args+=("$a") ;;
  esac
done

hostfile="${HOSTFILE:-hostfile}"
if [ ! -f "$hostfile" ]; then
  echo "train_multinode: no hostfile at $hostfile (one line per node: HOSTNAME slots=GPUS)" >&2
  exit 2
fi
hosts=(); slots=()
while read -r line || [ -n "$line" ]; do   # (the last line may lack its newline)
  line="${line%%#*}"
  [ -z "${line// /}" ] && continue
  if [[ ! "$line" =~ ^[[:space:]]*([^[:space:]]+)[[:space:]]+slots=([1-9][0-9]*)[[:space:]]*$ ]]; then
    echo "train_multinode: $hostfile: expected 'HOSTNAME slots=N', got: $line" >&2
    exit 2
  fi
  hosts+=("${BASH_REMATCH[1]}"); slots+=("${BASH_REMATCH[2]}")
done < "$hostfile"
nodes=${#hosts[@]}
if [ "$nodes" = 0 ]; then echo "train_multinode: $hostfile lists no host" >&2; exit 2; fi
total=0; for s in "${slots[@]}"; do total=$((total + s)); done

master="${MASTER_ADDR:-${hosts[0]}}"
port="${MASTER_PORT:-29500}"
ep="${EP_SIZE:-$( [ $((16 % total)) = 0 ] && echo "$total" || echo "${slots[0]}" )}"
cmd=(deepspeed --hostfile "$hostfile" --master_addr "$master" --master_port "$port")
if [ "$no_ssh" = 1 ]; then
  rank="${NODE_RANK:?--no-ssh runs one node: set NODE_RANK (0 .. $((nodes - 1)))}"
  if ! [[ "$rank" =~ ^[0-9]+$ ]] || [ "$rank" -ge "$nodes" ]; then
    echo "train_multinode: NODE_RANK=$rank, expected 0 .. $((nodes - 1))" >&2
    exit 2
  fi
  cmd+=(--no_ssh --node_rank "$rank")
fi
cmd+=(examples/train_moe_lm.py --deepspeed_config "${CONFIG:-configs/train_8gpu.json}" --ep-size "$ep" --experts 16
      --layers 8 --hidden 512 --run-dir "${RUN_DIR:-runs/multinode}" "${args[@]+"${args[@]}"}")

echo "train_multinode: $nodes nodes (${hosts[*]}), $total ranks (slots ${slots[*]}), master $master:$port, ep_size $ep"
if [ "$dry" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
