"""The Ray scheduler on a simulated 2-node cluster (one machine, loopback only).

Ray binds every interface, so these tests run only inside a private network namespace
where `lo` is the only interface:
    RAY_AUTH_MODE=disabled unshare --net sh -c \
        'ip link set lo up; exec .venv/bin/pytest -q -m ray tests/unit/launch/test_ray_scheduler.py'
"""

import json
import os
import signal
import socket
import time

import pytest
from test_scheduler import health_server, pid_alive

from asyncrl.config.schema import ClusterConfig, SchedulerConfig
from asyncrl.launch import SchedulerError, WorkerSpec, make_scheduler, read_registry

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

ONLY_LOOPBACK = [name for _, name in socket.if_nameindex()] == ["lo"]


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of 2 CPUs and 2 (pretend) GPUs each, on 127.0.0.1."""
    if not ONLY_LOOPBACK:
        pytest.skip("Ray tests start Ray, which binds every interface: run them inside a "
                    "network namespace with only lo (unshare --net, see the module docstring)")
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    node = {"num_cpus": 2, "num_gpus": 2, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True,
                      head_node_args=dict(node, include_dashboard=False, resources={"a": 1}))
    cluster.add_node(**node, resources={"b": 1})
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def scheduler(cluster, tmp_path):
    from asyncrl.launch.ray import RayScheduler

    cfg = SchedulerConfig(type="ray", startup_timeout=30)
    with make_scheduler(cfg, ClusterConfig(n_nodes=2, n_gpus_per_node=2), tmp_path) as scheduler:
        assert isinstance(scheduler, RayScheduler)  # joined the test cluster, did not start one
        yield scheduler


def node_ids() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def test_workers_that_need_a_whole_node_spread_over_both_and_are_registered(scheduler,
                                                                            tmp_path):
    workers = scheduler.create_workers(WorkerSpec("inference", 2, health_server(), cpus=2))
    assert {w.node_id for w in workers} == node_ids()  # one per node: each node has 2 CPUs
    assert [w.host for w in workers] == ["127.0.0.1"] * 2
    assert scheduler.check_health("inference") == [True, True]
    registry = read_registry(tmp_path)
    assert registry["scheduler"] == "ray" and registry["workers"] == workers
    assert registry["ray_address"] == ray.get_runtime_context().gcs_address
    assert all(os.path.exists(w.log_path) for w in workers)


def test_trainer_ranks_pack_and_get_torchrun_variables_and_their_gpus(scheduler, tmp_path):
    env_file = str(tmp_path / "env-{index}.json")
    workers = scheduler.create_workers(WorkerSpec("trainer", 4, health_server(env_file), cpus=1,
                                                  gpus=1, torch_distributed=True))
    envs = [json.loads((tmp_path / f"env-{i}.json").read_text()) for i in range(4)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"} and {e["OMP_NUM_THREADS"] for e in envs} == {"1"}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {
        ("127.0.0.1", envs[0]["MASTER_PORT"])}
    for node in node_ids():  # 2 CPUs and 2 GPUs a node: two ranks on each
        ranks = [r for r, w in enumerate(workers) if w.node_id == node]
        assert [envs[r]["LOCAL_RANK"] for r in ranks] == ["0", "1"]
        assert {envs[r]["LOCAL_WORLD_SIZE"] for r in ranks} == {"2"}
        assert sorted(envs[r]["CUDA_VISIBLE_DEVICES"] for r in ranks) == ["0", "1"]


def test_a_killed_worker_restarts_and_delete_leaves_no_process(scheduler):
    from ray.util.placement_group import placement_group_table

    workers = scheduler.create_workers(WorkerSpec("agent", 2, health_server(), cpus=1))
    os.kill(workers[1].pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while scheduler.check_health("agent")[1] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert scheduler.check_health("agent") == [True, False]
    new = scheduler.restart_worker("agent", 1)
    assert new.pid != workers[1].pid and new.node_id == workers[1].node_id
    assert scheduler.check_health("agent") == [True, True]
    scheduler.delete_workers("agent")
    deadline = time.monotonic() + 10
    pids = [workers[0].pid, new.pid]
    while any(map(pid_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(pid_alive, pids))
    assert {g["state"] for g in placement_group_table().values()} == {"REMOVED"}
    assert scheduler.get_workers("agent") == []


def test_a_role_larger_than_the_cluster_config_is_refused(scheduler):
    with pytest.raises(SchedulerError, match="5 workers x 1 GPUs do not fit cluster.n_nodes=2"):
        scheduler.create_workers(WorkerSpec("trainer", 5, health_server(), gpus=1))


def test_a_worker_whose_actor_died_restarts_in_a_new_actor_in_its_bundle(scheduler):
    [old] = scheduler.create_workers(WorkerSpec("agent", 1, health_server(), cpus=1))
    ray.kill(scheduler.roles["agent"].actors[0])  # the worker dies with it (PR_SET_PDEATHSIG)
    deadline = time.monotonic() + 10
    while pid_alive(old.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(old.pid)
    new = scheduler.restart_worker("agent", 0)
    assert new.pid != old.pid and scheduler.check_health("agent") == [True]


def test_a_worker_that_exits_during_start_up_is_an_error_with_its_log(scheduler):
    import sys

    crash = [sys.executable, "-c", "import sys; print('no model on {host}'); sys.exit(3)"]
    with pytest.raises(SchedulerError, match=r"exited \(code 3\)(.|\n)*no model on 127.0.0.1"):
        scheduler.create_workers(WorkerSpec("inference", 1, crash))
    assert scheduler.get_workers("inference") == []
