"""`aux.batch_scope`'s pieces on their own: the sequence-wise loss, GlobalShares, and the gates' scope losses."""
import pytest
import torch
import torch.nn.functional as F

from eb_deepspeed.core.losses import sequence_balance_loss

pytestmark = pytest.mark.unit


def test_the_sequence_loss_is_one_at_balance_and_hand_derived_otherwise():
    probs_TE = torch.full((4, 2), 0.5)
    balanced_TK = torch.tensor([[0], [1], [1], [0]])                 # each sequence of 2 uses both experts
    assert float(sequence_balance_loss(probs_TE, balanced_TK, 2, 2)) == pytest.approx(1.0)
    probs_TE = torch.tensor([[0.9, 0.1], [0.7, 0.3], [0.2, 0.8], [0.4, 0.6]], requires_grad=True)
    skewed_TK = torch.tensor([[0], [0], [1], [0]])
    loss = sequence_balance_loss(probs_TE, skewed_TK, 2, 2)
    # sequence 0: f = (1, 0), P = (0.8, 0.2): 2 x 0.8; sequence 1: f = (0.5, 0.5), P = (0.3, 0.7): 2 x 0.5
    assert float(loss.detach()) == pytest.approx((1.6 + 1.0) / 2)
    loss.backward()                                                  # f is a count: only P carries gradient
    torch.testing.assert_close(probs_TE.grad, torch.tensor([[0.5, 0.0], [0.5, 0.0], [0.25, 0.25], [0.25, 0.25]]))
    # pooled over the whole batch instead, the two sequences would cancel: the micro-batch loss is lower
    pooled = sequence_balance_loss(probs_TE.detach(), skewed_TK, 4, 2)
    assert float(pooled) < float(loss)


def test_the_sequence_loss_leaves_padding_out_and_refuses_a_ragged_batch():
    probs_TE = torch.tensor([[0.9, 0.1], [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])
    selected_TK = torch.tensor([[0], [1], [0], [1]])
    valid_T = torch.tensor([True, False, False, False])              # sequence 1 is all padding: no loss of its own
    assert float(sequence_balance_loss(probs_TE, selected_TK, 2, 2, valid_T)) == pytest.approx(2 * 0.9)
    assert float(sequence_balance_loss(probs_TE[:0], selected_TK[:0], 2, 2)) == 0.0
    with pytest.raises(ValueError, match=r"tokens \(3\) must be a multiple of the sequence length \(2\)"):
        sequence_balance_loss(probs_TE[:3], selected_TK[:3], 2, 2)


def test_the_expert_loss_is_one_at_balance_and_e_times_f_dot_p_otherwise():
    from eb_deepspeed.core.losses import expert_balance_loss
    probs_TE = torch.full((4, 2), 0.5)
    assert float(expert_balance_loss(probs_TE, torch.tensor([2, 2]), k=1)) == pytest.approx(1.0)
    probs_TE = torch.tensor([[0.9, 0.1], [0.7, 0.3], [0.6, 0.4], [0.8, 0.2]])      # P = (0.75, 0.25)
    # f = (3, 1) / 4: 2 x (0.75 x 0.75 + 0.25 x 0.25) = 1.25; a global f of (0.5, 0.5) instead: 1.0
    assert float(expert_balance_loss(probs_TE, torch.tensor([3, 1]), k=1)) == pytest.approx(1.25)
    assert float(expert_balance_loss(probs_TE, torch.tensor([3, 1]), k=1, share_E=torch.tensor([0.5, 0.5]))) == \
        pytest.approx(1.0)


def test_the_deepspeed_gate_takes_the_sequence_loss_over_its_sequences():
    from deepspeed.moe.sharded_moe import TopKGate
    from eb_deepspeed.adapters.deepspeed.gate import CrossLayerGate
    torch.manual_seed(0)
    M, E = 16, 8
    gate = CrossLayerGate.from_topk_gate(TopKGate(M, E, k=1, capacity_factor=8.0, min_capacity=4), layer_index=0)
    gate.controls.batch_scope = "sequence"
    gate.controls.seq_len = 8
    x = torch.randn(32, M)
    out = gate(x, None, True, False)
    probs_TE = F.softmax(x @ gate.wg.weight.detach().t(), dim=1)
    wanted = sequence_balance_loss(probs_TE, out[3].t(), 8, E)
    torch.testing.assert_close(out[0].detach(), wanted)
    gate.controls.seq_len = None                                      # unknown: the forward is one sequence
    torch.testing.assert_close(gate(x, None, True, False)[0].detach(), sequence_balance_loss(probs_TE, out[3].t(), 32, E))
