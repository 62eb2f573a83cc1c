"""One multi-node job, both halves: train the example MoE LM with eb_deepspeed, then serve a skewed MoE
layer with plain DeepSpeed and with eb_deepspeed side by side in the same processes. Run it under the
`deepspeed` launcher on every node (launch/rehearse_multinode.sh runs it on two emulated hosts):

    deepspeed --hostfile HOSTFILE --no_ssh --node_rank N --master_addr ADDR --master_port PORT \
        examples/multinode_rehearsal.py --run-dir runs/rehearse

Rank 0 writes RUN_DIR/rehearsal.json: the hosts and the rank -> node map every layer of the stack
learned, the topology serving resolved (and its warning), the all-reduces the balancer made per
training step, the losses, and for serving the replicas' node spread and the share of routes (and
bytes) that crossed nodes with plain DeepSpeed and with ours, plus whether the outputs were equal.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout: benchmarks/ (Zipf router)
from moe_lm import MoELM, StdlibCorpus, run_and_exit  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--run-dir", default="runs/rehearse")
    p.add_argument("--steps", type=int, default=8, help="training steps")
    p.add_argument("--serve-batches", type=int, default=16, help="serving batches after 4 warm-up ones")
    p.add_argument("--tokens", type=int, default=512, help="serving tokens per rank and batch")
    return p.parse_args(argv)


class _AllReduceCounter:
    """Counts torch.distributed.all_reduce calls while `active` (the balancer's step)."""

    def __init__(self):
        self.active, self.calls = False, 0
        self._orig = torch.distributed.all_reduce

        def counting(*args, **kwargs):
            if self.active:
                self.calls += 1
            return self._orig(*args, **kwargs)
        torch.distributed.all_reduce = counting

    def wrap(self, balancer, per_step: list):
        step = balancer.step

        def counted_step(*args, **kwargs):
            self.active, self.calls = True, 0
            try:
                return step(*args, **kwargs)
            finally:
                self.active = False
                per_step.append(self.calls)
        balancer.step = counted_step


def train(args, rank: int, world: int, counter: _AllReduceCounter) -> dict:
    import eb_deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6,
              "easybalance": {"enabled": True, "mode": "balance", "warmup_batches": 2,
                              "log": {"interval": 2, "dir": os.path.join(args.run_dir, "balance")}}}
    torch.manual_seed(1234)
    model = MoELM(layers=2, hidden=64, experts=8, ep_size=world, k=2, seq_len=64)
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    engine, _, _, _ = eb_deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    balancer = engine.easybalance
    per_step: list[int] = []
    counter.wrap(balancer, per_step)
    corpus = StdlibCorpus(max_bytes=300_000)
    losses = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = corpus.batch("train", 4, 64, g)
        logits, l_aux = engine(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        engine.backward(loss + 0.01 * sum(l_aux))
        engine.step()
        losses.append(round(loss.item(), 4))
    engine.save_checkpoint(os.path.join(args.run_dir, "ckpt"), client_state={"step": args.steps})
    return {"steps": args.steps, "lm_loss_first": losses[0], "lm_loss_last": losses[-1],
            "rank_to_node": list(balancer.shape.rank_to_node), "num_nodes": balancer.num_nodes,
            "allreduces_per_step": sorted(set(per_step)), "view_steps": int(balancer.view.steps)}


def _route_devices(out, slots_per_device: int) -> torch.Tensor:
    """The device of every route from a gate's sparse 7-tuple (index 3: the slot or expert of each route)."""
    idx = out[3]
    if isinstance(idx, (list, tuple)):
        idx = torch.stack([torch.as_tensor(i) for i in idx])
    idx = idx.flatten().long()
    return idx[idx >= 0] // slots_per_device


def serve(args, rank: int, world: int, node_of_rank: list[int]) -> dict:
    from eb_deepspeed import init_inference
    from eb_deepspeed.adapters.deepspeed.engine import find_moe_layers
    from benchmarks.infer import ZipfModel, zipf_batches

    E, hidden = 8, 64
    # replicas re-planned across the two hosts (the view every batch, a re-plan every 4); where routes go is
    # recorded beside plain DeepSpeed's
    block = {"mode": "balance", "warmup_batches": 2,
             "inference": {"replica_slots": 1, "view_interval": 1, "replan_interval": 4},
             "log": {"dir": os.path.join(args.run_dir, "serve_balance")}}
    plain = ZipfModel(E, hidden, world, False)
    for _, moe in find_moe_layers(plain):
        moe.set_deepspeed_parallelism()
    plain.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = init_inference(ZipfModel(E, hidden, world, False), config={"easybalance": block})
    serving = engine.serving
    my_node = node_of_rank[rank]
    counts = {"plain": [0, 0], "ours": [0, 0]}           # [routes, cross-node routes]
    padded = {"plain": [0, 0], "ours": [0, 0]}           # [slots x capacity sent, of it to other nodes]

    def hook(name, slots_of):
        def record(module, inputs, out):
            if not counting[0]:
                return
            S = slots_of()
            dev = _route_devices(out, S)
            counts[name][0] += int(dev.numel())
            counts[name][1] += int((torch.tensor(node_of_rank)[dev] != my_node).sum())
            P = int(out[2])
            cap = int(out[1])
            other = sum(1 for p in range(P) if node_of_rank[p // S] != my_node)
            padded[name][0] += P * cap
            padded[name][1] += other * cap
        return record

    counting = [False]
    plain.layer.deepspeed_moe.gate.register_forward_hook(hook("plain", lambda: E // world))
    for gate in serving.gates:
        gate.register_forward_hook(hook("ours", lambda: serving.S))
    batches = zipf_batches(plain.classes, 4 + args.serve_batches, args.tokens, 1.0, rank)
    equal = True
    with torch.no_grad():
        for b, x in enumerate(batches):
            counting[0] = b >= 4
            ours = engine(x)[0]
            ref = plain(x)[0]
            equal &= bool(torch.equal(ours, ref))
    totals = torch.tensor([*counts["plain"], *counts["ours"], *padded["plain"], *padded["ours"]], dtype=torch.float64)
    torch.distributed.all_reduce(totals)
    t = totals.tolist()
    placement = serving.placement
    cnt = placement.logcnt[0]
    dev_ER = placement.expert_devices()[0]
    nodes = max(node_of_rank) + 1
    spread = [len({node_of_rank[int(d)] for d in dev_ER[e] if d >= 0}) == min(int(cnt[e]), nodes)
              for e in range(E) if int(cnt[e]) >= 2]
    bytes_per_route = hidden * 4 * 2                     # fp32 activations, dispatch and combine
    return {"topology": serving.topology, "topology_warnings": [str(w.message) for w in caught
                                                               if "topology" in str(w.message)],
            "rank_to_node": list(serving.rank_to_node), "replans": serving.replans,
            "replicated_experts": len(spread), "replicas_node_spread": all(spread) if spread else None,
            "outputs_equal": equal,
            "cross_node_route_fraction": {"plain": round(t[1] / t[0], 4), "ours": round(t[3] / t[2], 4)},
            "cross_node_route_bytes": {"plain": int(t[1] * bytes_per_route), "ours": int(t[3] * bytes_per_route)},
            "padded_cross_node_fraction": {"plain": round(t[5] / t[4], 4), "ours": round(t[7] / t[6], 4)}}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    hosts = [None] * world
    torch.distributed.all_gather_object(hosts, socket.gethostname())
    counter = _AllReduceCounter()
    trained = train(args, rank, world, counter)
    served = serve(args, rank, world, trained["rank_to_node"])
    if rank == 0:
        per_node = {}
        for h in hosts:
            per_node[h] = per_node.get(h, 0) + 1
        result = {"hosts": hosts, "nodes": len(per_node), "ranks_per_node": sorted(set(per_node.values())),
                  "world_size": world, "train": trained, "serve": served}
        os.makedirs(args.run_dir, exist_ok=True)
        with open(os.path.join(args.run_dir, "rehearsal.json"), "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()     # while Python runs, not at the interpreter's exit (gloo)
    return 0


if __name__ == "__main__":
    run_and_exit(main)
