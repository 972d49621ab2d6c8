"""Async RL under the Ray scheduler on a simulated 2-node cluster (one machine, loopback only).

Run inside a private network namespace where `lo` is the only interface (Ray binds every
interface):
    RAY_AUTH_MODE=disabled unshare --net sh -c \\
        'ip link set lo up; exec .venv/bin/pytest -q -m ray tests/integration/test_ray_e2e.py'
"""

import os
import socket
from pathlib import Path

import pytest
from tiny_run import tiny_run_config

from asyncrl.controller.rl import train
from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats

pytestmark = [pytest.mark.ray, pytest.mark.integration]
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of 1 and 2 CPUs: a server and two trainer ranks of one CPU each fill
    both, whatever Ray's placement."""
    if [name for _, name in socket.if_nameindex()] != ["lo"]:
        pytest.skip("Ray tests start Ray, which binds every interface: run them inside a "
                    "network namespace with only lo (see the module docstring)")
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


# broadcast: the same run with the weights sent over the trainer's process group, as in
# test_services_e2e (slow: a second two-node run).
@pytest.mark.parametrize("sync", ["disk", pytest.param("broadcast", marks=pytest.mark.slow)])
def test_two_trainer_ranks_and_a_server_on_two_ray_nodes(cluster, tmp_path, sync):
    model = make_tiny_model(tmp_path / "model", arch="llama")
    cfg = tiny_run_config(tmp_path, model, "scheduler.type=ray", "cluster.n_nodes=2",
                          f"ray.address={cluster.address}", "allocation_mode=local:d1+fsdp:d2",
                          f"actor.weight_update_mode={sync}", name="ray")
    summary = train(cfg)
    rows = [r for r in read_stats(Path(summary["run_dir"]) / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/grad_norm"] > 0 and r["train/n_seqs"] == 4 for r in rows)
    nodes = {(s["role"], s["index"]): s["node_id"] for s in summary["services"]}
    # Under Ray every role is a service: the router and the weight update too, which take
    # no CPU and fit beside the 3 CPUs' worth of workers on nodes of 1 and 2.
    assert set(nodes) == {("inference", 0), ("router", 0), ("trainer", 0), ("trainer", 1),
                          ("weight_update", 0)}
    heavy = {k: v for k, v in nodes.items() if k[0] in ("inference", "trainer")}
    assert len(set(heavy.values())) == 2
    published = Path(summary["run_dir"]) / "weights" / "v2" / "model.safetensors"
    assert published.is_file() == (sync == "disk")
    if sync == "broadcast":
        assert all(r["perf/weights_broadcast_s"] > 0 for r in rows)
