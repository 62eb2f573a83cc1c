"""The deferred `LayerTally` against adding one forward at a time, and the replica gate's tally.

Shape legend: E experts, G EP ranks (devices), T tokens, K routes per token, W packed width.
"""
import random

import pytest
import torch

from eb_deepspeed.core.tally import Tally, TallyLayout, LayerTally, logit_sums

pytestmark = pytest.mark.unit
E, G = 6, 3


def nonfinite_tokens(logits_TE):
    """Tokens whose router logits hold a NaN or Inf, counted directly (the reference for the tally's fold)."""
    return (~torch.isfinite(logits_TE).all(1)).sum()


class OneAtATime:
    """The reference: every forward added to the packed row [W] at once, as the tally did before it
    deferred (three index_add_ per forward, -1 routes onto the scratch slots)."""

    def __init__(self, num_experts, num_devices=0):
        self.layout = TallyLayout(num_experts, num_devices)
        self.row_W, self.undo = None, None
        self.tokens = self.forwards = 0

    def add(self, routed_E, expert_R, tokens, nonfinite, l_aux, device_R=None):
        lay = self.layout
        self.undo = (None if self.row_W is None else self.row_W.clone(), self.tokens, self.forwards)
        if self.row_W is None:
            self.row_W = torch.zeros(lay.width, dtype=torch.float64)
        row = self.row_W
        row[lay.span("routed")] += routed_E
        ones_R = torch.ones(expert_R.numel(), dtype=torch.float64)
        row.index_add_(0, expert_R.long() + lay.start["kept"], ones_R)
        if lay.num_devices:
            row.index_add_(0, device_R.long() + lay.start["device"], ones_R)
        if isinstance(tokens, int):
            self.tokens += tokens
        else:
            row[lay.start["tokens"]] += tokens
        at = lay.start["nonfinite"]
        row[at:at + 2] += torch.stack((nonfinite.double(), l_aux.double()))
        self.forwards += 1

    def discard_last(self):
        if self.undo is not None:
            self.row_W, self.tokens, self.forwards = self.undo
        self.undo = None

    def take(self):
        lay, self.undo = self.layout, None
        out = torch.zeros(lay.width, dtype=torch.float64) if self.row_W is None else self.row_W
        out[lay.scratch] = 0.0
        out[lay.start["aux"]] = out[lay.start["aux"]].nan_to_num(0.0, 0.0, 0.0)
        out[lay.start["tokens"]] += self.tokens
        out[lay.start["forwards"]] += self.forwards
        self.row_W, self.tokens, self.forwards = None, 0, 0
        return out


def random_forward(g: torch.Generator, kind: str, device_E: torch.Tensor):
    """One forward's arguments for `add_routes` and the same forward for `OneAtATime.record`."""
    T, K = int(torch.randint(1, 40, (1, ), generator=g)), 2
    logits_TE = torch.randn(T, E, generator=g)
    bad_T = torch.rand(T, generator=g) < 0.1           # a few tokens with NaN or Inf logits
    logits_TE[bad_T, 0] = torch.tensor([float("nan"), float("inf"), -float("inf")])[int(T) % 3]
    expert_TK = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    routed_E = torch.bincount(expert_TK.reshape(-1).long(), minlength=E)
    if kind != "dropless":                              # the capacity limit dropped some routes
        expert_TK = torch.where(torch.rand(T, K, generator=g) < 0.3, -1, expert_TK)
    if kind == "mixed":                                 # forwards of every kind in one tally
        kind = random.Random(T).choice(["by map", "by route"])
    by_map = kind in ("dropless", "by map")             # devices by expert (the home layout's way)
    # else each route's own device (replicas: one expert's routes on several ranks)
    device_TK = device_E[expert_TK.long().clamp_min(0)] if by_map else torch.randint(0, G, (T, K), generator=g)
    device_TK = torch.where(expert_TK >= 0, device_TK, -1)
    l_aux = torch.rand((), generator=g) * 2
    if float(torch.rand((), generator=g)) < 0.05:
        l_aux = torch.tensor(float("nan"))              # a NaN aux, as NaN logits give
    tokens = T if float(torch.rand((), generator=g)) < 0.5 else torch.tensor(T)
    kwargs = dict(routed_E=routed_E, l_aux=l_aux, tokens=tokens)
    if by_map:
        kwargs["device_E"] = device_E
    else:
        kwargs["device_TK"] = device_TK
    if kind == "dropless":                              # the gate's own counts: every route kept
        kwargs["kept_E"] = routed_E
    kwargs["logit_sums_T"] = logit_sums(logits_TE)      # non-finite tokens counted at the fold
    reference = (routed_E, expert_TK.reshape(-1), tokens, nonfinite_tokens(logits_TE), l_aux, device_TK.reshape(-1))
    return expert_TK, kwargs, reference


@pytest.mark.parametrize("fold_every", [1, 3, 16])
@pytest.mark.parametrize("kind", ["dropless", "by map", "by route", "mixed"])
def test_a_deferred_tally_gives_the_rows_of_adding_one_forward_at_a_time(kind, fold_every):
    g = torch.Generator().manual_seed(7 * fold_every + len(kind))
    device_E = torch.tensor([0, 0, 1, 2, 2, 1])
    tally, reference = LayerTally(E, G), OneAtATime(E, G)
    tally.fold_every = fold_every
    rows, rng = 0, random.Random(fold_every)
    for step in range(60):                              # more forwards than the fold bound between takes
        expert_TK, kwargs, args = random_forward(g, kind, device_E)
        tally.add_routes(expert_TK, **kwargs)
        reference.add(*args)
        assert len(tally._pending) <= fold_every     # memory stays bounded without a take
        if rng.random() < 0.15:                         # a skipped micro-batch: forget its forward (once)
            tally.discard(last_forward_only=True)
            reference.discard_last()
            if rng.random() < 0.5:
                tally.discard(last_forward_only=True)
        if rng.random() < 0.1 or step == 59:
            got, want = tally.take(), reference.take()
            assert torch.equal(got, want), (step, (got - want).abs().max())
            rows += 1
    assert rows >= 3


def test_the_fold_adds_aux_in_the_order_added_not_just_to_the_same_sum():
    # 1e16 + 1 + 1 in that order stays 1e16 in float64 (each 1 is half an ulp, rounded to even), while
    # 1 + 1 first would give 1e16 + 2: only the order added matches adding one forward at a time.
    tally, reference = LayerTally(2), OneAtATime(2)
    for w in (1e16, 1.0, 1.0):
        w = torch.tensor(w, dtype=torch.float64)
        tally.add_routes(torch.tensor([[0]]), routed_E=torch.tensor([1, 0]), l_aux=w)
        reference.add(torch.tensor([1, 0]), torch.tensor([0]), 1, torch.tensor(0), w)
    row = tally.take()
    tally = Tally.unpack(row[None], 2)
    assert torch.equal(row, reference.take())
    assert tally.aux_L.tolist() == [1e16]


def test_discarding_the_last_forward_forgets_exactly_that_forward_even_right_after_a_fold():
    tally = LayerTally(2)
    tally.fold_every = 2
    for expert in (0, 1, 1):                            # the third add_routes folds the first two
        tally.add_routes(torch.tensor([[expert]]), routed_E=torch.eye(2)[expert], l_aux=torch.tensor(0.5))
    tally.discard(last_forward_only=True)
    tally.discard(last_forward_only=True)            # forgets nothing more
    tally = Tally.unpack(tally.take()[None], 2)
    assert tally.kept_LE.tolist() == [[1.0, 1.0]] and tally.forwards_L.tolist() == [2.0]
    assert tally.tokens_L.tolist() == [2.0] and tally.aux_L.tolist() == [1.0]


def test_a_tally_with_devices_refuses_routes_without_their_devices():
    with pytest.raises(ValueError, match="3 devices needs the device of every route"):
        LayerTally(E, 3).add_routes(torch.zeros(4, 2, dtype=torch.long), routed_E=torch.zeros(E))


def test_a_counted_aux_loss_keeps_no_autograd_graph_until_the_take():
    tally = LayerTally(2)
    w = torch.ones((), requires_grad=True)
    tally.add_routes(torch.tensor([[0]]), routed_E=torch.tensor([1, 0]), l_aux=w * 2)
    assert not tally._pending[0].l_aux.requires_grad
    assert Tally.unpack(tally.take()[None], 2).aux_L.tolist() == [2.0]


def replica_gate(num_devices: int, log2phy_ER: torch.Tensor, slots_per_device: int, drop_tokens: bool):
    from deepspeed.moe.sharded_moe import TopKGate

    from eb_deepspeed.adapters.deepspeed.replicas import ReplicaGate
    from eb_deepspeed.adapters.routing import SlotTable
    torch.manual_seed(0)
    plain = TopKGate(16, E, 2, 1.0, 0.5, 1, None, drop_tokens, False, None, True).eval()
    return ReplicaGate.from_gate(plain, num_devices, slots_per_device, table=SlotTable.even(log2phy_ER))


@pytest.mark.parametrize("layout", ["home, 3 ranks", "replicas, drops"])
def test_the_replica_gate_tallies_its_kept_routes_by_logical_expert_and_rank(layout):
    if layout == "home, 3 ranks":       # DeepSpeed's layout on 3 ranks of 2 slots: `_home_forward`
        gate, S, P = replica_gate(G, torch.arange(E)[:, None], 2, drop_tokens=False), 2, E
    else:                               # one rank, experts 0 and 1 with a second replica, capacity drops
        log2phy_ER = torch.tensor([[0, E], [1, E + 1]] + [[e, -1] for e in range(2, E)])
        gate, S, P = replica_gate(1, log2phy_ER, E + 2, drop_tokens=True), E + 2, E + 2
    assert gate.home_layout == (layout == "home, 3 ranks")
    phy2log_P = torch.full((P, ), -1)
    for expert, slots in enumerate(gate.table.log2phy_ER.tolist()):
        phy2log_P[[p for p in slots if p >= 0]] = expert
    reference, g = OneAtATime(E, gate.G), torch.Generator().manual_seed(1)
    for forward in range(20):           # more than `fold_every`: a fold happens during the forwards too
        x_TM = torch.randn(int(torch.randint(8, 40, (1, ), generator=g)), 16, generator=g)
        if forward == 3:
            x_TM[0, 0] = float("inf")   # a non-finite token
        with torch.no_grad():
            l_aux, _, _, slot_KT, _, _, counts_E = gate(x_TM, None, True, False)
        slot_R = slot_KT.t().reshape(-1).long()
        kept_R = slot_R >= 0
        logits_TE = x_TM @ gate.wg.weight.t()
        reference.add(counts_E, torch.where(kept_R, phy2log_P[slot_R.clamp_min(0)], -1), x_TM.shape[0],
                         nonfinite_tokens(logits_TE), l_aux, torch.where(kept_R, slot_R // S, -1))
    tally = Tally.unpack(gate.tally.take()[None], E, gate.G)
    want = Tally.unpack(reference.take()[None], E, gate.G)
    for name in ("routed_LE", "kept_LE", "device_LG", "tokens_L", "nonfinite_L", "aux_L", "forwards_L"):
        assert torch.equal(getattr(tally, name), getattr(want, name)), name
    assert tally.nonfinite_L.tolist() == [1.0] and tally.forwards_L.tolist() == [20.0]
    assert (layout == "replicas, drops") == bool((tally.kept_LE < tally.routed_LE).any())


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["routes", "kept", "same", "tensor_tokens"])
def test_taking_every_layer_at_once_gives_each_layers_own_rows(kind):
    from eb_deepspeed.core.tally import take_all
    g = torch.Generator().manual_seed(3)
    L, E, T, K, n = 3, 5, 7, 2, 3
    pairs = [(LayerTally(E), LayerTally(E)) for _ in range(L)]
    for layer, (a, b) in enumerate(pairs):
        for _ in range(n):
            expert_TK = torch.randint(-1, E, (T, K), generator=g)
            routed_E = torch.randint(0, 9, (E, ), generator=g).float()
            sums_T = torch.randn(T, generator=g)
            sums_T[layer] = float("nan") if layer == 1 else sums_T[layer]       # layer 1: a non-finite token
            kw = dict(routed_E=routed_E, logit_sums_T=sums_T, l_aux=torch.rand((), generator=g),
                      kept_E={"routes": None, "kept": routed_E - 1, "same": routed_E, "tensor_tokens": None}[kind],
                      tokens=torch.tensor(5) if kind == "tensor_tokens" else None)
            for t in (a, b):
                t.add_routes(expert_TK, **kw)
    together = take_all([b for _, b in pairs], "cpu")
    assert torch.equal(together, torch.stack([a.take() for a, _ in pairs]))
    assert all(not b._pending and b.generation == 1 for _, b in pairs)


@pytest.mark.unit
def test_taking_every_layer_at_once_declines_layers_whose_forwards_differ_and_keeps_their_routes():
    from eb_deepspeed.core.tally import take_all
    a, b = LayerTally(4), LayerTally(4)
    a.add_routes(torch.tensor([[0, 1]]))
    b.add_routes(torch.tensor([[0, 1], [2, 3]]))          # another number of tokens
    assert take_all([a, b], "cpu") is None
    assert len(a._pending) == len(b._pending) == 1 and a.generation == b.generation == 0
