"""Hostile input files: every reader of `eb report`, `eb plan`, traces, sweep files and ds_configs reads
only regular files, in bounded memory, and turns what it refuses into one clear error (exit 2 from `eb`).

The cases that would hang or fill the memory of an unguarded reader (a FIFO, a link to /dev/zero) run `eb`
in a child process with a time limit and an address-space limit, so a regression fails the test instead of
the test run.
"""
import io
import json
import os
import resource
import subprocess
import sys
import zipfile

import pytest
import torch

from eb_deepspeed import load_trace
from eb_deepspeed.core.config import ConfigError, EasyBalanceConfig
from eb_deepspeed.observe.report import read_log
from eb_deepspeed.tools.cli import main as eb_main
from benchmarks.__main__ import main as bench_main

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2 ** 20
# The bounds, by hand: a log record 16 MiB, a JSON document 64 MiB, a trace 2 GiB (2^28 float64 counts).
MAX_RECORD_BYTES, MAX_JSON_BYTES, MAX_TRACE_BYTES, MAX_TRACE_COUNTS = 16 * MiB, 64 * MiB, 2048 * MiB, 2 ** 28


def record(step, **extra):
    return {"step": step, "device_max_over_mean": [1.0, 1.2], "device_util_std": 0.1,
            "expert_counts_LE": [[1, 2, 3, 4]], "pressure_LG": [[1.0, 2.0]], **extra}


def write_log(run, lines):
    run.mkdir(exist_ok=True)
    (run / "balance.jsonl").write_text("".join(line + "\n" for line in lines))
    return run


# ---- 1. only regular files, lines of bounded length ----

# Runs every reader on the hostile files in directory argv[1]; prints {reader: [exit code, message]}.
READERS = r"""
import contextlib, io, json, sys
from eb_deepspeed.core.config import ConfigError, EasyBalanceConfig
from eb_deepspeed.tools.cli import main
from benchmarks.__main__ import main as bench_main
d, out = sys.argv[1], {}
plan = ["--devices", "2", "--slots", "2"]
for name, argv in {"eb report": ["report", f"{d}/run"], "eb plan LOG": ["plan", f"{d}/run", *plan],
                   "eb plan PT": ["plan", f"{d}/dump.pt", *plan],
                   "eb bench --from": ["train", "--sweep", "--from", f"{d}/doc.json", "--out", f"{d}/x"],
                   }.items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        out[name] = [(bench_main if name.startswith("eb bench") else main)(argv), err.getvalue()]
for name, read, error in (("ds_config", EasyBalanceConfig.from_ds_config, ConfigError), ):
    try:
        read(f"{d}/doc.json")
        out[name] = [0, ""]
    except error as e:
        out[name] = [2, str(e)]
print(json.dumps(out))
"""


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (6 * 2 ** 30, 6 * 2 ** 30))   # eb needs < 1 GiB; /dev/zero more


@pytest.mark.parametrize("kind, message", [("fifo", "is a FIFO, not a regular file"),
                                           ("device", "is a device or socket, not a regular file")])
def test_every_reader_refuses_a_fifo_or_a_link_to_a_device_without_hanging(tmp_path, kind, message):
    (tmp_path / "run").mkdir()
    paths = {"run/balance.jsonl": ("eb report", "eb plan LOG"), "dump.pt": ("eb plan PT", ),
             "doc.json": ("eb bench --from", "ds_config")}
    for name in paths:
        os.mkfifo(tmp_path / name) if kind == "fifo" else (tmp_path / name).symlink_to("/dev/zero")
    # a child process, limited in time and address space: an unguarded reader fails the test, not the test run
    try:
        proc = subprocess.run([sys.executable, "-c", READERS, str(tmp_path)], cwd=ROOT, text=True,
                              capture_output=True, timeout=60, preexec_fn=_limited)
    except subprocess.TimeoutExpired:
        pytest.fail("a reader still waits on a FIFO after 60 s")
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout)
    for name, readers in paths.items():
        for reader in readers:
            rc, err = results[reader]
            assert rc == 2 and f"{tmp_path / name} {message}: only regular files are read" in err, (reader, err)
            assert "Traceback" not in err


def test_a_link_to_a_regular_log_is_followed(tmp_path):
    real = write_log(tmp_path / "real", [json.dumps(record(1))])
    run = tmp_path / "run"
    run.mkdir()
    (run / "balance.jsonl").symlink_to(real / "balance.jsonl")
    assert [r["step"] for r in read_log(str(run))] == [1]


@pytest.mark.parametrize("newline", [False, True])
def test_a_log_line_longer_than_the_record_bound_is_refused_naming_its_line(tmp_path, newline, capsys):
    run = write_log(tmp_path / "run", [json.dumps(record(1))])
    with open(run / "balance.jsonl", "a") as f:      # 20 MiB in one line (a real record is < 1 MiB)
        f.write('{"step": 2, "x": "' + "a" * (MAX_RECORD_BYTES + 4 * MiB) + ('"}\n' if newline else ""))
    with pytest.raises(ValueError, match=r"balance.jsonl:2: a record longer than 16 MiB"):
        read_log(str(run))
    assert eb_main(["report", str(run)]) == 2
    assert "balance.jsonl:2: a record longer than 16 MiB" in capsys.readouterr().err


# ---- 2. compressed and expanding payloads ----

def deflated_torch_save(obj, path):
    """torch.save(obj), its zip entries recompressed with deflate: a small file of a large payload."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))


def test_a_deflated_torch_file_that_expands_past_the_bound_is_refused_before_loading(tmp_path, capsys):
    path = tmp_path / "bomb.pt"
    deflated_torch_save({"logical_count": torch.zeros(2_500_000, 4, dtype=torch.float64)}, path)   # 80 MB of zeros
    assert path.stat().st_size < MiB
    # the bound: max(64 MiB, 8 x the file's size), never past 2 GiB; 80,000,000 bytes pass 64 MiB = 67,108,864
    with pytest.raises(ValueError, match=r"bomb.pt: its zip entries expand to 8000\d{4} bytes, more than the "
                                         r"67108864 allowed .* at least 64 MiB, never past 2 GiB"):
        load_trace(str(path))
    assert eb_main(["plan", str(path), "--devices", "2", "--slots", "2"]) == 2
    assert "its zip entries expand to" in capsys.readouterr().err


def test_a_deflated_torch_file_within_the_bound_still_loads(tmp_path):
    path = tmp_path / "small.pt"
    deflated_torch_save({"logical_count": torch.arange(24.0).view(2, 3, 4)}, path)
    assert load_trace(str(path)).tolist() == torch.arange(24.0).view(2, 3, 4).tolist()


def test_a_torch_file_larger_than_the_trace_bound_is_refused_before_reading(tmp_path):
    path = tmp_path / "huge.pt"
    with open(path, "wb") as f:
        f.truncate(MAX_TRACE_BYTES + 1)               # sparse: no disk used
    with pytest.raises(ValueError, match=r"huge.pt holds 2147483649 bytes, more than the 2048 MiB"):
        load_trace(str(path))


def test_a_stored_view_that_claims_more_counts_than_its_storage_is_refused_before_any_copy(tmp_path):
    # 3e8 counts on one stored float: 1.5 kB on disk, 2.4 GB as float64 (and a bool copy per check)
    huge = torch.zeros(1, 1, 1, dtype=torch.float64).expand(1000, 1000, 300)
    torch.save({"logical_count": huge}, tmp_path / "view.pt")
    with pytest.raises(ValueError, match=rf"'logical_count' holds 300000000 counts .* than the {MAX_TRACE_COUNTS}"):
        load_trace(str(tmp_path / "view.pt"))
    # SGLang per_pass records: each under the bound, together over it, refused before one is copied
    record_LP = torch.zeros(1, 1).expand(1000, 100_000)
    torch.save({"records": [{"global_physical_count": record_LP}] * 3,
                "last_physical_to_logical_map": torch.zeros(1, 1, dtype=torch.long).expand(1000, 100_000)},
               tmp_path / "passes.pt")
    with pytest.raises(ValueError, match=rf"3 records of .* hold more than the {MAX_TRACE_COUNTS} counts"):
        load_trace(str(tmp_path / "passes.pt"))


@pytest.mark.parametrize("reader", ["ds_config", "sweep"])
def test_a_json_document_larger_than_64_mib_is_refused_before_reading(tmp_path, reader, capsys):
    path = tmp_path / "doc.json"
    with open(path, "wb") as f:
        f.truncate(MAX_JSON_BYTES + 1)                # sparse
    message = r"doc.json holds 67108865 bytes, more than the 64 MiB"
    if reader == "ds_config":
        with pytest.raises(ConfigError, match=message):
            EasyBalanceConfig.from_ds_config(str(path))
    else:
        assert bench_main(["train", "--sweep", "--from", str(path), "--out", str(tmp_path / "out")]) == 2
        assert "doc.json holds 67108865 bytes" in capsys.readouterr().err


# ---- 3. numbers no writer logs ----

@pytest.mark.parametrize("line, message", [
    ('{"step": 2, "device_max_over_mean": [1.0, ' + "9" * 400 + "]}",
     r"balance.jsonl:2: device_max_over_mean\[1\] is 9{37}\.\.\.: out of range"),
    ('{"step": 2, "device_util_std": 1e999}', r"balance.jsonl:2: device_util_std is 1e999: out of range"),
    ('{"step": 2, "pressure_LG": [[1.0, -1e400]]}', r"balance.jsonl:2: pressure_LG\[0\]\[1\] is -1e400"),
    ('{"step": 2, "device_loss_weight": [' + "1" * 21 + "]}", r"balance.jsonl:2: device_loss_weight\[0\] is 1{21}: out of range"),
    ('{"step": 99999999999999999999}', r"balance.jsonl:2: step is 99999999999999999999: out of range"),
    ('{"step": 2, "notes": {"loss": ' + "1" * 5000 + "}}", r"balance.jsonl:2: notes\['loss'\] is 1{37}\.\.\."),
])
def test_a_number_out_of_range_is_refused_naming_the_line_and_the_key(tmp_path, line, message, capsys):
    run = write_log(tmp_path / "run", [json.dumps(record(1)), line, json.dumps(record(3))])
    with pytest.raises(ValueError, match=message):
        read_log(str(run))
    assert eb_main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert "out of range" in err and "Traceback" not in err


def test_nan_infinity_and_the_largest_floats_as_the_writer_logs_them_render_as_gaps(tmp_path):
    run = write_log(tmp_path / "run", [json.dumps(record(1)),
                                       json.dumps(record(2, device_max_over_mean=[float("inf"), float("nan")],
                                                         pressure_LG=[[float("inf"), 1.0]])),
                                       json.dumps(record(2 ** 62, device_util_std=1.7e308))])
    with open(run / "balance.jsonl", "a") as f:     # 3-digit exponents and 20 digits, all within range
        f.write('{"step": 9223372036854775807, "device_loss_weight": [1e300, 1e-999, -1.5E+307, 12345678901234567890]}\n')
    assert "Infinity" in (run / "balance.jsonl").read_text()
    records = read_log(str(run))
    assert [r["step"] for r in records] == [1, 2, 2 ** 62, 2 ** 63 - 1]
    assert records[-1]["device_loss_weight"] == [1e300, 0.0, -1.5e307, 12345678901234567890]
    with pytest.warns(UserWarning, match=r"beyond \+-1e\+300 is drawn as a gap"):    # 1.7e308: no axis spans it
        assert eb_main(["report", str(run)]) == 0


def test_an_integer_of_thousands_of_digits_in_a_ds_config_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "doc.json").write_text('{"easybalance": {"window": ' + "7" * 5000 + "}}")   # past int()'s 4300
    with pytest.raises(ConfigError, match=r"doc.json: not a JSON DeepSpeed config \(Exceeds the limit"):
        EasyBalanceConfig.from_ds_config(str(tmp_path / "doc.json"))


# ---- 4. nesting: a ConfigError or ValueError naming the file, never a RecursionError ----

DEEP = ["[" * 100_000 + "]" * 100_000, '{"easybalance": ' + '{"a": ' * 100_000 + "1" + "}" * 100_001,
        '{"easybalance": {"aux": ' + "[" * 150 + "]" * 150 + "}}"]


@pytest.mark.parametrize("text", DEEP, ids=["list", "object", "deeper_than_100"])
def test_a_deeply_nested_ds_config_file_is_a_config_error_naming_the_file(tmp_path, text):
    (tmp_path / "ds.json").write_text(text)
    with pytest.raises(ConfigError, match=r"ds.json: not a JSON DeepSpeed config \(nested (too deeply|deeper than)"):
        EasyBalanceConfig.from_ds_config(str(tmp_path / "ds.json"))


def test_a_deeply_nested_ds_config_dict_is_a_config_error_naming_where():
    deep = inner = {}
    for _ in range(100_000):
        inner["a"] = {}
        inner = inner["a"]
    with pytest.raises(ConfigError, match=r"ds_config: nested deeper than 100 levels \(at \.easybalance\.aux\.a\.a"):
        EasyBalanceConfig.from_ds_config({"easybalance": {"aux": deep}})
    looped = {"easybalance": {"enabled": True}}
    looped["self"] = looped                              # visited once: ends, and deepcopy copes with it
    assert EasyBalanceConfig.from_ds_config(looped).enabled


@pytest.mark.parametrize("text", DEEP[:2], ids=["list", "object"])
def test_deeply_nested_sweep_files_are_clear_errors(tmp_path, text, capsys):
    (tmp_path / "doc.json").write_text(text)
    assert bench_main(["train", "--sweep", "--from", str(tmp_path / "doc.json"),
                    "--out", str(tmp_path / "out")]) == 2
    assert "doc.json: not a saved sweep result (JSON) (nested too deeply" in capsys.readouterr().err


# ---- 5. trace importers: one validation path, bounded work, a ValueError naming the file ----

@pytest.mark.parametrize("content, message", [
    ({"expert_load_pass": torch.ones(1, 4), "physical_to_logical_map": torch.tensor([[0, 1, 10 ** 9, 2]])},
     r"ids outside \[-1, 4\)"),                                   # would allocate 10^9 experts
    ({"expert_load_pass": torch.ones(1, 4), "physical_to_logical_map": torch.tensor([[0, 1, -2, 2]])},
     r"ids outside \[-1, 4\)"),                                   # would silently drop that slot's counts
    ({"expert_load_pass": torch.ones(1, 4), "physical_to_logical_map": torch.tensor([[0.0, 1.0, float("nan"), 2.0]])},
     "whole expert ids"),
    ({"expert_load_pass": torch.ones(1, 4), "physical_to_logical_map": torch.full((1, 4), -1)}, "no expert"),
    ({"expert_load_pass": torch.ones(0, 4), "physical_to_logical_map": torch.zeros(0, 4)}, "empty"),
    ({"logical_count": torch.full((2, 3), 1e30)}, "counts above"),
    ({"logical_count": torch.ones(2, 3, dtype=torch.complex64)}, "real token counts"),
    ({"logical_count": torch.ones(2, 3, dtype=torch.bool)}, "real token counts"),
])
def test_hostile_trace_files_are_refused_before_any_large_allocation(tmp_path, content, message):
    torch.save(content, tmp_path / "t.pt")
    with pytest.raises(ValueError, match=message):
        load_trace(str(tmp_path / "t.pt"))


@pytest.mark.parametrize("lines, message", [
    (["7"], r"balance.jsonl:1: a balance record is a JSON object with an integer 'step', got int"),
    (['{"step": 1}', "null"], r"balance.jsonl:2: .* got NoneType"),
    (['{"step": "one"}'], r"balance.jsonl:1: .*integer 'step'"),
    (["[" * 100000 + "]" * 100000], r"balance.jsonl:1: not a JSON record"),
    (['{"step": 1, "expert_counts_LE": [[1e30, 1]]}'], "counts above"),
    (['{"step": 1, "expert_counts_LE": [[1, 2]]}', '{"step": 2, "expert_counts_LE": [[1, 2, 3]]}'], "one shape"),
])
def test_hostile_balance_logs_are_refused_with_the_line(tmp_path, lines, message):
    (tmp_path / "balance.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message):
        load_trace(str(tmp_path))
