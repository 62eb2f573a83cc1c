"""The easybalance ds_config block: defaults from seed 000's tuning table, presets, strict errors."""
import copy
import json

import pytest

from eb_deepspeed import ConfigError, EasyBalanceConfig


def test_no_block_or_no_config_gives_a_disabled_config():
    assert EasyBalanceConfig.from_ds_config({"train_batch_size": 8}).enabled is False
    assert EasyBalanceConfig.from_ds_config(None).enabled is False


def test_an_empty_block_enables_balancing_with_the_seed_tuning_table_defaults():
    cfg = EasyBalanceConfig.from_ds_config({"easybalance": {}})
    assert cfg.enabled and cfg.mode == "balance"
    assert (cfg.weights.intra, cfg.weights.cross, cfg.weights.comm) == (0.3, 0.5, 0.2)
    assert cfg.ema_alpha == 0.3 and cfg.decision_batch == 8
    assert 3 <= cfg.warmup_batches <= 5
    # window "auto": 5 layers for a 32-layer model, 8 for a 61-layer one (seed 000 §5.1)
    assert cfg.window_for(32) == 5 and cfg.window_for(61) == 8 and cfg.window_for(4) == 5


def test_enabled_false_disables_balancing():
    assert EasyBalanceConfig.from_ds_config({"easybalance": {"enabled": False, "mode": "observe"}}).enabled is False


@pytest.mark.parametrize("topology, expected", [("nvlink", (0.3, 0.6, 0.1)), ("pcie", (0.3, 0.5, 0.2)),
                                                ("multi_node", (0.2, 0.4, 0.4))])
def test_topology_presets_set_the_cost_weights_the_way_the_seed_says(topology, expected):
    w = EasyBalanceConfig.from_ds_config({"easybalance": {"topology": topology}}).weights
    assert (w.intra, w.cross, w.comm) == expected


def test_explicit_weights_override_the_preset_key_by_key():
    w = EasyBalanceConfig.from_ds_config({"easybalance": {"topology": "multi_node", "weights": {"comm": 0.7}}}).weights
    assert (w.intra, w.cross, w.comm) == (0.2, 0.4, 0.7)


def test_the_config_reads_a_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4, "easybalance": {"mode": "observe", "window": 7}}))
    cfg = EasyBalanceConfig.from_ds_config(str(path))
    assert cfg.mode == "observe" and cfg.window_for(100) == 7


def test_the_users_dict_is_never_changed():
    user = {"easybalance": {"mode": "observe", "weights": {"comm": 0.5}, "log": {"interval": 3}}}
    before = copy.deepcopy(user)
    EasyBalanceConfig.from_ds_config(user)
    assert user == before


@pytest.mark.parametrize("block, message", [
    ({"ema_alfa": 0.3}, r"easybalance\.ema_alfa: unknown key; valid keys: aux, decision_batch, ema_alpha, enabled"),
    ({"weights": {"crosss": 0.5}}, r"easybalance\.weights\.crosss: unknown key; valid keys: comm, cross, intra"),
    ({"log": {"every": 2}}, r"easybalance\.log\.every: unknown key; valid keys: dir, interval, wandb"),
    ({"mode": "fast"}, r"easybalance\.mode \('fast'\) must be one of: observe, balance"),
    ({"topology": "infiniband"}, r"easybalance\.topology \('infiniband'\) must be one of: pcie, nvlink, multi_node"),
    ({"ema_alpha": 1.5}, r"easybalance\.ema_alpha \(1\.5\) must be in \(0, 1\]"),
    ({"ema_alpha": 0}, r"easybalance\.ema_alpha \(0\.0\) must be in \(0, 1\]"),
    ({"ema_alpha": "0.3"}, r"easybalance\.ema_alpha \('0\.3'\) must be a finite number"),
    ({"decision_batch": 0}, r"easybalance\.decision_batch \(0\) must be >= 1"),
    ({"window": -1}, r"easybalance\.window \(-1\) must be >= 0 or \"auto\""),
    ({"window": 2.5}, r"easybalance\.window \(2\.5\) must be an integer >= 0 or \"auto\""),
    ({"warmup_batches": True}, r"easybalance\.warmup_batches \(True\) must be an integer >= 0"),
    ({"weights": {"cross": 1.2}}, r"easybalance\.weights\.cross \(1\.2\) must be in \[0, 1\]"),
    ({"weights": {"intra": 0, "cross": 0, "comm": 0}}, r"easybalance\.weights: intra, cross and comm .* must not all be 0"),
    ({"enabled": "yes"}, r"easybalance\.enabled \('yes'\) must be true or false"),
    ({"log": {"interval": 0}}, r"easybalance\.log\.interval \(0\) must be >= 1"),
    ([1, 2], r"easybalance must be a JSON object, got list"),
])
def test_each_bad_config_names_its_json_path_and_the_valid_values(block, message):
    with pytest.raises(ConfigError, match=message):
        EasyBalanceConfig.from_ds_config({"easybalance": block})


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_observe_mode_reports_the_decision_options_it_ignores():
    cfg = EasyBalanceConfig.from_ds_config({"easybalance": {"mode": "observe", "weights": {"comm": 0.4},
                                                            "decision_batch": 4, "ema_alpha": 0.2}})
    assert cfg.ignored_options() == ["decision_batch", "weights"]
    assert EasyBalanceConfig.from_ds_config({"easybalance": {"decision_batch": 4}}).ignored_options() == []
