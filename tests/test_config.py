"""The easybalance ds_config block: defaults from seed 000's tuning table, presets, strict errors (every bad
value, tried as a hostile user would: a clear error naming its JSON path; the user's dict never changed)."""
import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eb_deepspeed import ConfigError, EasyBalanceConfig
from eb_deepspeed.core.config import TrainPlacementConfig

pytestmark = pytest.mark.unit


def test_no_block_or_no_config_gives_a_disabled_config():
    assert EasyBalanceConfig.from_ds_config({"train_batch_size": 8}).enabled is False
    assert EasyBalanceConfig.from_ds_config(None).enabled is False


def test_an_empty_block_enables_balancing_with_the_seed_tuning_table_defaults():
    cfg = EasyBalanceConfig.from_ds_config({"easybalance": {}})
    assert cfg.enabled and cfg.mode == "balance"
    assert cfg.ema_alpha == 0.3 and cfg.inference.topology == "pcie"
    assert 3 <= cfg.warmup_batches <= 5
    # window null: 5 layers for a 32-layer model, 8 for a 61-layer one (seed 000 §5.1)
    assert cfg.window_for(32) == 5 and cfg.window_for(61) == 8 and cfg.window_for(4) == 5


def test_enabled_false_disables_balancing():
    assert EasyBalanceConfig.from_ds_config({"easybalance": {"enabled": False, "mode": "observe"}}).enabled is False


def test_the_config_reads_a_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4, "easybalance": {"mode": "observe", "window": 7}}))
    cfg = EasyBalanceConfig.from_ds_config(str(path))
    assert cfg.mode == "observe" and cfg.window_for(100) == 7


@pytest.mark.parametrize("block", [{"mode": "observe", "inference": {"topology": "nvlink"}, "log": {"interval": 3}},
                                   {"aux": {"policy": "bias", "bias_rate": "x"}}])
def test_the_users_dict_is_never_changed_whether_it_parses_or_fails(block):
    user = {"easybalance": block}
    before = copy.deepcopy(user)
    try:
        EasyBalanceConfig.from_ds_config(user)
    except ConfigError:
        pass
    assert user == before


@pytest.mark.parametrize("block, message", [
    ({"ema_alfa": 0.3}, r"easybalance\.ema_alfa: unknown key; valid keys: aux, checkpoint, ema_alpha, enabled, inference, log"),
    ({"inference": {"replicas": 1}}, r"easybalance\.inference\.replicas: unknown key; valid keys: "
                                     r"replan_interval, replan_threshold, replica_slots, split, topology, view_interval$"),
    ({"aux": {"smoothing": 0.5}}, r"easybalance\.aux\.smoothing: unknown key; valid keys: "
                                  r"bias_rate, gain, loss_coeff, policy, weight_range$"),
    ({"inference": {"split": "fast"}}, r"easybalance\.inference\.split \('fast'\) must be one of: view, exact"),
    ({"log": {"every": 2}}, r"easybalance\.log\.every: unknown key; valid keys: dir, interval, wandb"),
    ({"train_placement": {"every": 2}}, r"easybalance\.train_placement\.every: unknown key; valid keys: enabled, interval, replica_slots$"),
    ({"train_placement": {"replica_slots": -1}}, r"easybalance\.train_placement\.replica_slots \(-1\) must be >= 0"),
    ({"train_placement": {"interval": 0}}, r"easybalance\.train_placement\.interval \(0\) must be >= 1"),
    ({"train_placement": {"enabled": "yes"}}, r"easybalance\.train_placement\.enabled \('yes'\) must be true or false"),
    ({"mode": "fast"}, r"easybalance\.mode \('fast'\) must be one of: observe, balance"),
    ({"inference": {"topology": "infiniband"}},
     r"easybalance\.inference\.topology \('infiniband'\) must be one of: pcie, nvlink, multi_node"),
    ({"ema_alpha": 1.5}, r"easybalance\.ema_alpha \(1\.5\) must be in \(0, 1\]"),
    ({"ema_alpha": 0}, r"easybalance\.ema_alpha \(0\.0\) must be in \(0, 1\]"),
    ({"ema_alpha": "0.3"}, r"easybalance\.ema_alpha \('0\.3'\) must be a finite number"),
    ({"inference": {"view_interval": 0}}, r"easybalance\.inference\.view_interval \(0\) must be >= 1"),
    ({"inference": {"replica_slots": -1}}, r"easybalance\.inference\.replica_slots \(-1\) must be >= 0"),
    ({"inference": {"replica_slots": 65536}}, r"easybalance\.inference\.replica_slots \(65536\) must be <= 65535"),
    ({"inference": {"replan_threshold": 0.9}}, r"easybalance\.inference\.replan_threshold \(0\.9\) must be >= 1"),
    ({"inference": {"replan_interval": 0}}, r"easybalance\.inference\.replan_interval \(0\) must be >= 1"),
    ({"inference": []}, r"easybalance\.inference must be a JSON object, got list"),
    ({"window": -1}, r"easybalance\.window \(-1\) must be >= 0 or null"),
    ({"window": 2.5}, r"easybalance\.window \(2\.5\) must be an integer >= 0 or null"),
    ({"window": "auto"}, r"easybalance\.window \('auto'\) must be an integer >= 0 or null"),   # Accelerate's word
    ({"warmup_batches": True}, r"easybalance\.warmup_batches \(True\) must be an integer >= 0"),
    ({"warmup_batches": 10 ** 400}, r"easybalance\.warmup_batches \(1000.*\.\.\.\) must be <= 2147483647"),
    ({"window": 2 ** 63}, r"easybalance\.window \(9223372036854775808\) must be <= 2147483647"),
    ({"ema_alpha": 10 ** 400}, r"easybalance\.ema_alpha \(1000.*\.\.\.\) must be a finite number"),
    ({1: 2}, r"easybalance: keys must be strings, got \[1\]"),
    ({"log": {"dir": "a\x00b"}}, r"easybalance\.log\.dir .* must be a non-empty string"),
    ({"aux": {"policy": "sometimes"}}, r"easybalance\.aux\.policy \('sometimes'\) must be one of: fixed, cross_layer, "
                                       r"bias, bias_cross_layer"),
    ({"aux": {"weight_range": [1.5, 2.0]}}, r"easybalance\.aux\.weight_range \(\[1\.5, 2\.0\]\) must be \[min, max\] "
                                            r"with 0 < min <= 1 <= max"),
    ({"aux": {"weight_range": 2}}, r"easybalance\.aux\.weight_range \(2\) must be \[min, max\]"),
    ({"aux": {"gain": 0}}, r"easybalance\.aux\.gain \(0\.0\) must be in \(0, 10\]"),
    ({"aux": {"bias_rate": -1e-3}}, r"easybalance\.aux\.bias_rate \(-0\.001\) must be in \(0, 1\]"),
    ({"aux": {"loss_coeff": -0.1}}, r"easybalance\.aux\.loss_coeff \(-0\.1\) must be in \[0, 1e6\]"),
    (None, r'easybalance \(null\) must be a JSON object; use \{"enabled": false\}'),
    ({"enabled": "yes"}, r"easybalance\.enabled \('yes'\) must be true or false"),
    ({"log": {"interval": 0}}, r"easybalance\.log\.interval \(0\) must be >= 1"),
    ([1, 2], r"easybalance must be a JSON object, got list"),
])
def test_each_bad_config_names_its_json_path_and_the_valid_values(block, message):
    with pytest.raises(ConfigError, match=message):
        EasyBalanceConfig.from_ds_config({"easybalance": block})


def test_a_config_error_is_caught_where_value_errors_are_with_its_path():
    # a launcher's `except ValueError` (and the eb CLI's) sees it, message and all
    with pytest.raises(ValueError, match=r"^easybalance\.mode \('watch'\) must be one of: observe, balance") as info:
        EasyBalanceConfig.from_ds_config({"easybalance": {"mode": "watch"}})
    assert type(info.value) is ConfigError


@pytest.mark.parametrize("block, context, ignored", [
    # observe changes nothing: every decision option is ignored, in training and in serving
    ({"mode": "observe", "inference": {"view_interval": 2}, "warmup_batches": 2, "ema_alpha": 0.2,
      "aux": {"policy": "bias"}}, "train",
     ["easybalance.aux.policy", "easybalance.inference.view_interval", "easybalance.warmup_batches"]),
    ({"mode": "observe", "window": 3}, "serve", ["easybalance.window"]),
    # balance, training: inference options, and the aux options the policy does not read
    ({"inference": {"replica_slots": 2, "topology": "nvlink"}, "aux": {"policy": "cross_layer", "bias_rate": 0.1}},
     "train", ["easybalance.aux.bias_rate", "easybalance.inference.replica_slots", "easybalance.inference.topology"]),
    # the topology prices training placement's weight copies too
    ({"inference": {"topology": "nvlink"}, "train_placement": {"interval": 5}}, "train", []),
    # fixed acts on nothing the view holds: window and warm-up are ignored too
    ({"aux": {"policy": "fixed"}, "window": 3, "warmup_batches": 2}, "train",
     ["easybalance.warmup_batches", "easybalance.window"]),
    # balance, serving: the training controls
    ({"aux": {"gain": 0.5}, "inference": {"replica_slots": 2}}, "serve", ["easybalance.aux.gain"]),
    ({"inference": {"view_interval": 2}, "aux": {"policy": "bias", "bias_rate": 0.01}}, "serve",
     ["easybalance.aux.bias_rate", "easybalance.aux.policy"]),
    ({"ema_alpha": 0.2}, "train", []),
    # training placement: a training option; in observe it still reads the view's warm-up
    ({"train_placement": {"enabled": True}}, "serve", ["easybalance.train_placement.enabled"]),
    ({"train_placement": {"interval": 5}}, "serve", ["easybalance.train_placement.enabled",
                                                     "easybalance.train_placement.interval"]),
    ({"mode": "observe", "train_placement": {"enabled": True}, "warmup_batches": 2}, "train", []),
])
def test_every_option_set_without_effect_is_named_by_its_json_path(block, context, ignored):
    assert EasyBalanceConfig.from_ds_config({"easybalance": block}).ignored_options(context) == ignored


def test_the_readme_block_of_defaults_warns_about_nothing_and_a_changed_key_still_warns():
    import json
    import os
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    start = readme.index("```json", readme.index("The block, with its defaults")) + len("```json")
    doc = json.loads("{" + readme[start:readme.index("```", start)] + "}")
    cfg = EasyBalanceConfig.from_ds_config(doc)
    assert cfg.ignored_options("train") == [] and cfg.ignored_options("serve") == []
    doc["easybalance"]["inference"]["replica_slots"] = 3
    doc["easybalance"]["aux"].update(policy="fixed", gain=0.5)  # the fixed policy has no gain
    assert EasyBalanceConfig.from_ds_config(doc).ignored_options("train") == [
        "easybalance.aux.gain", "easybalance.inference.replica_slots"]



def test_the_readme_block_passes_through_accelerates_fill_of_auto_values_as_the_trainer_gives_it():
    # Hugging Face Trainer, TRL: Accelerate fills every "auto" in the ds_config before deepspeed.initialize, and
    # refuses one it has no value for (the block's "window" was "auto" once)
    import json
    import os
    from accelerate.utils import DeepSpeedPlugin
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    start = readme.index("```json", readme.index("The block, with its defaults")) + len("```json")
    block = json.loads("{" + readme[start:readme.index("```", start)] + "}")["easybalance"]
    for given, ok in ((block, True), ({**block, "window": "auto"}, False)):
        plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": "auto", "easybalance": given,
                                               "zero_optimization": {"stage": 0}})
        try:
            plugin.deepspeed_config_process(must_match=False, train_micro_batch_size_per_gpu=4)
        except ValueError as e:
            assert not ok and "easybalance.window" in str(e)
        else:
            assert ok and plugin.deepspeed_config["easybalance"] == block

def test_readmes_block_and_config_mds_table_are_the_key_table():
    import json
    import os
    import re
    from eb_deepspeed.core.config import KEYS
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "README.md")).read()
    start = readme.index("```json", readme.index("The block, with its defaults")) + len("```json")
    block = json.loads("{" + readme[start:readme.index("```", start)] + "}")["easybalance"]
    assert block == EasyBalanceConfig.from_block({}).to_dict()         # every key, each at its default
    rows = re.findall(r"^\| `([a-z_.]+)` \| (.*?) \| (.*?) \| (.*?) \| .* \|$",
                      open(os.path.join(root, "docs", "config.md")).read(), re.M)
    assert [r[0] for r in rows] == list(KEYS)
    for path, default, valid, acts in rows:
        assert default.startswith(f"`{json.dumps(KEYS[path].default)}`"), path
        assert (valid, acts) == (KEYS[path].valid.text, ", ".join(KEYS[path].acts)), path


def test_a_config_file_with_a_key_given_twice_is_refused_as_deepspeed_refuses_it(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "easybalance": {"mode": "observe", "mode": "balance"}}')
    with pytest.raises(ConfigError, match=r"ds\.json: duplicate keys in the DeepSpeed config: \['mode'\]"):
        EasyBalanceConfig.from_ds_config(str(path))
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError, match=r"\['train_batch_size'\]"):
        EasyBalanceConfig.from_ds_config(str(path))


def test_a_missing_or_broken_config_file_is_a_config_error_naming_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.json: cannot read the DeepSpeed config"):
        EasyBalanceConfig.from_ds_config(str(tmp_path / "nope.json"))
    broken = tmp_path / "broken.json"
    broken.write_text('{"easybalance": {')
    with pytest.raises(ConfigError, match=r"broken\.json: not a JSON DeepSpeed config"):
        EasyBalanceConfig.from_ds_config(str(broken))


VALID = {"enabled": True, "mode": "balance", "ema_alpha": 0.3, "window": None, "warmup_batches": 4,
         "checkpoint": "strict", "log": {"interval": 10, "dir": "x", "wandb": True},
         "aux": {"policy": "bias", "weight_range": [0.5, 2.0], "gain": 0.02, "bias_rate": 0.001,
                 "loss_coeff": 0.01},
         "inference": {"replica_slots": 1, "split": "view", "topology": "pcie",
                       "replan_threshold": 1.5, "replan_interval": 24, "view_interval": 4},
         "train_placement": {"enabled": False, "interval": 50, "replica_slots": 1}}
EDGES = st.sampled_from([10 ** 400, -10 ** 400, 2 ** 63, 2 ** 31, -1, 0, float("nan"), float("inf"), "", "\x00", [], {}])
JSONISH = st.recursive(
    EDGES | st.none() | st.booleans() | st.integers(min_value=-10**400, max_value=10**400)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6) | st.integers(), children,
                                                                      max_size=3),
    max_leaves=6)


def _paths(block, prefix=()):
    for key, value in block.items():
        yield prefix + (key, )
        if isinstance(value, dict):
            yield from _paths(value, prefix + (key, ))


def test_the_valid_block_has_every_key_and_it_parses_back_from_its_dict():
    def leaves(d):
        return sum(leaves(v) if isinstance(v, dict) else 1 for v in d.values())
    cfg = EasyBalanceConfig.from_ds_config({"easybalance": VALID})
    assert leaves(VALID) == leaves(cfg.to_dict()) == 23          # every key, each with its reason in docs/config.md
    assert EasyBalanceConfig.from_block(cfg.to_dict()) == cfg


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(where=st.sampled_from(list(_paths(VALID))), value=JSONISH,
       extra=st.one_of(st.none(), st.tuples(st.text(max_size=6), JSONISH)))
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
    cfg.ignored_options("train"), cfg.ignored_options("serve"), cfg.to_dict()


def test_the_train_placement_sub_block_is_on_when_present_as_the_block_is():
    read = lambda block: EasyBalanceConfig.from_ds_config({"easybalance": block}).train_placement
    assert not read({}).enabled                                            # no sub-block: off
    assert read({"train_placement": {"interval": 5}}) == TrainPlacementConfig(enabled=True, interval=5)
    assert read({"train_placement": {}}).enabled
    assert not read({"train_placement": {"enabled": False, "interval": 5}}).enabled
