"""Multi-host: the launch script's dry run for a two-host hostfile, the rank -> node map and topology from
emulated hostnames, and the rehearsal itself (launch/rehearse_multinode.sh: the real `deepspeed` launcher on
two hosts made of network + UTS namespaces on this machine)."""
import json
import os
import shutil
import subprocess

import pytest

from eb_deepspeed.core.topology import TOPOLOGIES, node_map, resolve_topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "train_multinode.sh")


def _dry_run(tmp_path, hostfile_text, *args, **env):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(hostfile_text)
    return subprocess.run(["bash", SCRIPT, "--dry-run", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "HOSTFILE": str(hostfile), **env}), hostfile


@pytest.mark.unit
def test_the_dry_run_of_a_two_host_hostfile_names_the_world_deepspeed_reads_from_it(tmp_path):
    from deepspeed.launcher.runner import fetch_hostfile
    res, hostfile = _dry_run(tmp_path, "gpu-node-1 slots=8\n# spare\ngpu-node-2 slots=8\n", "--steps", "10")
    assert res.returncode == 0, res.stderr
    pool = fetch_hostfile(str(hostfile))                       # DeepSpeed's own hostfile parser
    assert list(pool) == ["gpu-node-1", "gpu-node-2"] and sum(pool.values()) == 16
    assert "2 nodes (gpu-node-1 gpu-node-2), 16 ranks (slots 8 8), master gpu-node-1:29500, ep_size 16" in res.stdout
    command = res.stdout.strip().splitlines()[-1]
    assert command.startswith(f"deepspeed --hostfile {hostfile} --master_addr gpu-node-1 --master_port 29500 "
                              "examples/train_moe_lm.py")
    assert "--ep-size 16" in command and command.endswith("--steps 10")


@pytest.mark.unit
def test_the_no_ssh_dry_run_is_one_node_of_the_job(tmp_path):
    res, _ = _dry_run(tmp_path, "a slots=2\nb slots=2\n", "--no-ssh", NODE_RANK="1", MASTER_ADDR="10.1.2.3")
    assert res.returncode == 0, res.stderr
    assert "--master_addr 10.1.2.3 --master_port 29500 --no_ssh --node_rank 1 examples/train_moe_lm.py" in res.stdout


@pytest.mark.unit
@pytest.mark.parametrize("hostfile, env, message", [
    ("a 2\n", {}, "expected 'HOSTNAME slots=N', got: a 2"),
    ("# nothing\n", {}, "lists no host"),
    ("a slots=2\nb slots=2\n", {"NODE_RANK": "2"}, "NODE_RANK=2, expected 0 .. 1"),
])
def test_bad_hostfiles_and_node_ranks_are_refused_before_launching(tmp_path, hostfile, env, message):
    res, _ = _dry_run(tmp_path, hostfile, *(["--no-ssh"] if env else []), **env)
    assert res.returncode == 2 and message in res.stderr


@pytest.mark.unit
def test_emulated_hostnames_give_two_nodes_and_the_multi_node_topology():
    hosts = ["eb-host-a", "eb-host-a", "eb-host-b", "eb-host-b"]     # what the rehearsal's ranks report
    assert node_map(hosts) == [0, 0, 1, 1]
    name, note = resolve_topology("pcie", explicit=False, num_nodes=2)
    assert name == "multi_node" and "ranks span 2 nodes" in note and TOPOLOGIES[name].inter_bw < TOPOLOGIES[name].intra_bw
    name, note = resolve_topology("nvlink", explicit=True, num_nodes=2)
    assert name == "nvlink" and "priced at its one bandwidth" in note


def _can_make_hosts() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network and UTS namespaces"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs `{tool}`"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_can_make_hosts() is not None, reason=f"this machine cannot make two hosts: {_can_make_hosts()}")
def test_the_rehearsal_trains_and_serves_across_two_hosts(tmp_path):
    run_dir = tmp_path / "rehearse"
    res = subprocess.run(["bash", os.path.join(ROOT, "launch", "rehearse_multinode.sh")], capture_output=True, text=True,
                         timeout=900, cwd=ROOT, env={**os.environ, "REHEARSE_RUN_DIR": str(run_dir)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    last = json.loads(res.stdout.strip().splitlines()[-1])
    assert last["nodes"] == 2 and last["ranks_per_node"] == [2] and last["hosts"] == ["eb-host-a", "eb-host-b"]
    assert last["rank_to_node"] == [0, 0, 1, 1] and last["topology"] == "multi_node"
    assert last["allreduces_per_step"] == [1]                   # one all-reduce per step, across the nodes
    assert last["outputs_equal"] is True and last["cross_node_route_fraction_plain"] > 0   # routes cross the nodes
    full = json.loads((run_dir / "rehearsal.json").read_text())
    assert full["train"]["view_steps"] == full["train"]["steps"] and full["serve"]["replans"] >= 1
    assert "ranks span 2 nodes" in full["serve"]["topology_warnings"][0]
    assert (run_dir / "balance" / "balance.jsonl").exists() and (run_dir / "ckpt" / "latest").exists()
    # torn down: no namespace or interface of the rehearsal is left
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "ebrh" not in netns and "ebrh" not in links


@pytest.mark.unit
def test_a_hostfile_without_a_final_newline_keeps_its_last_host(tmp_path):
    res, _ = _dry_run(tmp_path, "a slots=2\nb slots=2")
    assert res.returncode == 0 and "2 nodes (a b), 4 ranks" in res.stdout
