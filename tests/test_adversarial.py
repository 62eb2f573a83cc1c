"""Hostile input, tried as a hostile user would: every bad value gets a clear error naming where it is,
and nothing half-applied. Property tests (hypothesis) over the config parser and the planners."""
import copy
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eb_deepspeed import ConfigError, EasyBalanceConfig, sequence_length_weights

pytestmark = pytest.mark.unit

VALID = {"enabled": True, "mode": "balance", "ema_alpha": 0.3, "window": "auto", "warmup_batches": 4,
         "seq_len_weighting": False, "log": {"interval": 10, "dir": "x", "wandb": True},
         "aux": {"policy": "bias", "weight_range": [0.5, 2.0], "smoothing": 0.3, "bias_rate": 0.001,
                 "device_weight": 0.5, "aux_scale": 1.0},
         "inference": {"replica_slots": 1, "split": "view", "topology": "pcie", "weights": {"intra": 0.3},
                       "decision_batch": 8, "replan_threshold": 1.5, "replan_interval": 50, "view_interval": 8}}

EDGES = st.sampled_from([10 ** 400, -10 ** 400, 2 ** 63, 2 ** 31, -1, 0, float("nan"), float("inf"), "", "\x00", [], {}])
JSONISH = st.recursive(
    EDGES | st.none() | st.booleans() | st.integers(min_value=-10**400, max_value=10**400)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6) | st.integers(), children,
                                                                      max_size=3),
    max_leaves=6)


def paths(block, prefix=()):
    for key, value in block.items():
        yield prefix + (key, )
        if isinstance(value, dict):
            yield from paths(value, prefix + (key, ))


PATHS = list(paths(VALID))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(where=st.sampled_from(PATHS), value=JSONISH, extra=st.one_of(st.none(), st.tuples(st.text(max_size=6), JSONISH)))
def test_every_mutated_block_is_valid_or_a_config_error_naming_its_path(where, value, extra):
    block = copy.deepcopy(VALID)
    node = block
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    if extra is not None:
        node[extra[0]] = extra[1]
    try:
        cfg = EasyBalanceConfig.from_ds_config({"easybalance": block})
    except ConfigError as e:
        assert str(e).startswith("easybalance"), str(e)
        assert len(str(e)) < 1000          # a huge value never makes a huge message
        return
    # what parsed is usable: the numbers that reach the loop are finite and in range
    assert 0 < cfg.ema_alpha <= 1 and cfg.window_for(64) < 2 ** 31 and cfg.inference.view_interval >= 1
    cfg.ignored_options("train"), cfg.ignored_options("inference"), cfg.to_dict()


@pytest.mark.parametrize("block, message", [
    ({"decision_batch": 1}, r"moved to easybalance\.inference\.decision_batch"),
    ({"warmup_batches": 10 ** 400}, r"easybalance\.warmup_batches \(1000.*\.\.\.\) must be <= 2147483647"),
    ({"window": 2 ** 63}, r"easybalance\.window \(9223372036854775808\) must be <= 2147483647"),
    ({"ema_alpha": 10 ** 400}, r"easybalance\.ema_alpha \(1000.*\.\.\.\) must be a finite number"),
    ({1: 2}, r"easybalance: keys must be strings, got \[1\]"),
    ({"log": {"dir": "a\x00b"}}, r"easybalance\.log\.dir .* must be a non-empty string"),
])
def test_hostile_values_get_a_config_error_with_the_path(block, message):
    with pytest.raises(ConfigError, match=message):
        EasyBalanceConfig.from_ds_config({"easybalance": block})


def test_a_null_block_is_an_error_not_a_silent_switch_off():
    with pytest.raises(ConfigError, match=r'easybalance \(null\) must be a JSON object; use \{"enabled": false\}'):
        EasyBalanceConfig.from_ds_config({"easybalance": None})
    assert EasyBalanceConfig.from_ds_config({"easybalance": {"enabled": False}}).enabled is False


def test_a_missing_or_broken_config_file_is_a_config_error_naming_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.json: cannot read the DeepSpeed config"):
        EasyBalanceConfig.from_ds_config(str(tmp_path / "nope.json"))
    broken = tmp_path / "broken.json"
    broken.write_text('{"easybalance": {')
    with pytest.raises(ConfigError, match=r"broken\.json: not a JSON DeepSpeed config"):
        EasyBalanceConfig.from_ds_config(str(broken))


def test_nan_or_infinite_sequence_lengths_are_refused():
    for bad in (float("nan"), math.inf):
        with pytest.raises(ValueError, match=r"sequence lengths must be in \[0, 4\]"):
            sequence_length_weights(torch.tensor([2.0, bad]), seq_len=4)


def test_the_user_config_is_not_mutated_by_any_failure():
    block = {"easybalance": {"aux": {"policy": "bias", "bias_rate": "x"}}}
    before = json.dumps(block)
    with pytest.raises(ConfigError):
        EasyBalanceConfig.from_ds_config(block)
    assert json.dumps(block) == before
