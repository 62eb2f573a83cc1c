"""Which placement serving chooses from the view (pure: no ranks)."""
import pytest
import torch

from eb_deepspeed.planning.placement import MIN_GAIN, choose_placement, expected_padded_cost, plan_placement, static_placement

pytestmark = pytest.mark.unit
HOME = static_placement(1, 4, 2)                       # 4 experts on 2 ranks, DeepSpeed's layout


def plan(heat):
    return plan_placement(heat, 2, 3, previous=HOME)    # one extra slot per rank


def test_a_hot_expert_moves_serving_to_replicas():
    # home: 4 slots x 80 = 320; replicated: 6 slots x 40 (the hot expert on both ranks) = 240, 25 % less
    heat = torch.tensor([[80.0, 30, 25, 25]])
    choice = choose_placement(heat, HOME, HOME, 1.5, plan)
    assert choice is not HOME and choice.slots_per_device == 3
    assert float(expected_padded_cost(heat, choice).sum()) < (1 - MIN_GAIN) * 320


def test_balanced_traffic_keeps_deepspeeds_layout_and_a_small_gain_is_not_taken():
    assert choose_placement(torch.tensor([[40.0, 40, 40, 40]]), HOME, HOME, 1.5, plan) is None   # below the threshold
    # above the threshold but replicas gain < 10 %: home 4 x 60 = 240 against 6 x 39 = 234 at best
    heat = torch.tensor([[60.0, 39, 39, 22]])
    assert choose_placement(heat, HOME, HOME, 1.2, plan) is HOME


def test_a_move_is_taken_only_when_its_gain_over_the_horizon_pays_for_its_weight_copies():
    heat = torch.tensor([[80.0, 30, 25, 25]])          # replicas save 320 - 240 = 80 per view step (above)
    price = lambda p: 400.0                            # the copies stall the busiest receiver for 400 routes
    assert choose_placement(heat, HOME, HOME, 1.5, plan, move_cost=price, horizon=4) is HOME      # 320 < 400
    moved = choose_placement(heat, HOME, HOME, 1.5, plan, move_cost=price, horizon=6)             # 480 > 400
    assert moved is not HOME and moved.slots_per_device == 3


def test_serving_returns_to_deepspeeds_layout_when_the_hot_expert_cools():
    replicated = plan(torch.tensor([[80.0, 30, 25, 25]]))
    balanced = torch.tensor([[40.0, 40, 40, 40]])
    # replicated costs 6 x 40 = 240 on balanced traffic, home 4 x 40 = 160: back home, below any threshold
    assert choose_placement(balanced, replicated, HOME, 1.5, plan) is HOME


def test_replica_slots_past_the_planners_slots_a_layer_are_refused_before_any_expert_is_copied():
    from deepspeed.moe.layer import MoE

    from eb_deepspeed.adapters.deepspeed.serving import MoEStore
    from eb_deepspeed.adapters.serving.engine import ServingEngine
    from eb_deepspeed.core.config import MAX_REPLICA_SLOTS, EasyBalanceConfig
    from eb_deepspeed.planning.placement import MAX_SLOTS
    assert MAX_REPLICA_SLOTS == MAX_SLOTS - 1        # the config's static bound: one rank, one home expert
    model = torch.nn.Sequential(MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=1, k=1))
    config = EasyBalanceConfig.from_block({"mode": "balance", "inference": {"replica_slots": MAX_SLOTS - 3}})
    # 1 rank x (4 home + 65533 replica slots) = 65537 > 65536: refused with the most that fits (65532)
    with pytest.raises(ValueError, match=r"replica_slots \(65533\).*65536 slots per layer.*; use at most 65532$"):
        ServingEngine(MoEStore(model), config)
    assert len(model[0].deepspeed_moe.experts.deepspeed_experts) == 4


def test_the_engine_plans_replica_counts_for_the_views_swing_under_an_even_split(monkeypatch, tmp_path):
    from deepspeed.moe.layer import MoE

    import eb_deepspeed.adapters.serving.engine as engine_module
    from eb_deepspeed.adapters.deepspeed.serving import MoEStore
    from eb_deepspeed.core.config import EasyBalanceConfig
    model = torch.nn.Sequential(MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=1, k=1))
    config = EasyBalanceConfig.from_block({"mode": "balance", "log": {"dir": str(tmp_path)}})
    engine = engine_module.ServingEngine(MoEStore(model), config)
    seen = {}
    real = engine_module.plan_placement
    monkeypatch.setattr(engine_module, "plan_placement", lambda *a, **kw: seen.update(kw) or real(*a, **kw))
    view = engine.balancer.view
    view.var_LE = torch.tensor([[0.0, 4.0, 9.0, 0.0]])
    engine._plan(torch.tensor([[8.0, 1, 1, 1]]))
    assert engine.model.padded and torch.equal(seen["swing_LE"], torch.tensor([[0.0, 2.0, 3.0, 0.0]]))


def test_replica_slots_a_re_plan_could_not_plan_are_refused_at_start_up():
    from deepspeed.moe.layer import MoE

    from eb_deepspeed.adapters.deepspeed.serving import MoEStore
    from eb_deepspeed.adapters.serving.engine import ServingEngine
    from eb_deepspeed.core.config import EasyBalanceConfig
    # 300 layers x (4 + 60000) slots: within 65536 a layer, past 2^24 in all, which every re-plan would refuse; what
    # fits: 2^24 // 300 = 55924 slots a layer, 55920 of them replicas
    model = torch.nn.Sequential(*[MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=1, k=1) for _ in range(300)])
    config = EasyBalanceConfig.from_block({"mode": "balance", "inference": {"replica_slots": 60000}})
    with pytest.raises(ValueError, match=r"replica_slots \(60000\): 300 layers x 60004 slots .* more than the planner"
                                         r".*; use at most 55920$"):
        ServingEngine(MoEStore(model), config)


def test_a_checkpoint_with_a_tensor_of_another_size_loads_nothing(tmp_path):
    # torch's load_state_dict copies what fits and raises at the end: before, the fitting tensors were already in
    from deepspeed.moe.layer import MoE

    from eb_deepspeed import load_moe_checkpoint
    torch.manual_seed(0)
    model = torch.nn.Sequential(MoE(8, torch.nn.Linear(8, 8), num_experts=2, ep_size=1, k=1), torch.nn.Linear(8, 8))
    folder = tmp_path / "t"
    folder.mkdir()
    (tmp_path / "latest").write_text("t")
    prefix = "0.deepspeed_moe.experts.deepspeed_experts."
    state = model.state_dict()
    dense = {k: v.clone() for k, v in state.items() if prefix not in k}
    dense["1.weight"] = torch.zeros(8, 4)                      # another model's layer
    dense["0.deepspeed_moe.gate.wg.weight"] = torch.full_like(state["0.deepspeed_moe.gate.wg.weight"], 7.0)
    torch.save({"module": dense}, folder / "mp_rank_00_model_states.pt")
    for e in range(2):
        torch.save({k: v.clone() for k, v in state.items() if k.startswith(f"{prefix}{e}.")},
                   folder / f"layer_0_expert_{e}_mp_rank_00_model_states.pt")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"of another size \['1\.weight'\]\); nothing was loaded"):
        load_moe_checkpoint(model, str(tmp_path))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())     # the gate's 7s did not go in


def test_the_deepspeed_moe_door_refuses_a_model_without_moe_layers_before_deepspeed_is_touched(monkeypatch):
    import deepspeed

    from eb_deepspeed.adapters.deepspeed.serving import init_inference
    monkeypatch.setattr(deepspeed, "init_inference", lambda *a, **k: pytest.fail("DeepSpeed was called"))
    with pytest.raises(ValueError, match=r"no deepspeed.moe.layer.MoE layers \(an AutoEP-converted model"):
        init_inference(torch.nn.Sequential(torch.nn.Linear(8, 8)), config={"easybalance": {"mode": "observe"}})
