"""Core split between servers and trainer; when periodic work is due."""

import pytest

from asyncrl.config.schema import SaverConfig
from asyncrl.launch import SchedulerError, split_cores
from asyncrl.observe.periodic import Periodic


@pytest.mark.parametrize("cores, inference, trainer, n_servers, expected", [
    ([0, 1], None, None, 1, ([[1]], [0])),  # the 2-core machine: one core each
    (list(range(8)), None, None, 2, ([[4, 5], [6, 7]], [0, 1, 2, 3])),
    (list(range(8)), 2, None, 1, ([[6, 7]], [0, 1, 2, 3, 4, 5])),
    (list(range(8)), None, 6, 1, ([[6, 7]], [0, 1, 2, 3, 4, 5])),
    ([0], None, None, 1, ([[0]], [0])),  # one core: shared, with a warning
])
def test_cores_are_split_between_servers_and_trainer(cores, inference, trainer, n_servers,
                                                      expected):
    assert split_cores(cores, inference, trainer, n_servers) == expected


def test_fewer_inference_cores_than_servers_is_an_error():
    with pytest.raises(SchedulerError, match="inference_threads=1 is fewer than rollout.n_servers=2"):
        split_cores([0, 1, 2, 3], 1, None, 2)


def test_periodic_is_due_by_steps_epochs_or_seconds():
    every_3 = Periodic(SaverConfig(freq_steps=3), steps_per_epoch=10)
    assert [s for s in range(1, 10) if every_3.due(s, now=0.0)] == [3, 6, 9]
    per_epoch = Periodic(SaverConfig(freq_epochs=1), steps_per_epoch=4)
    assert [s for s in range(1, 10) if per_epoch.due(s, now=0.0)] == [4, 8]
    timed = Periodic(SaverConfig(freq_secs=60.0), steps_per_epoch=4, now=0.0)
    assert [timed.due(1, 30.0), timed.due(2, 61.0), timed.due(3, 100.0), timed.due(4, 122.0)] \
        == [False, True, False, True]
    assert not Periodic(SaverConfig(), steps_per_epoch=4).enabled


def test_the_trainer_gets_its_cores_back_after_a_run(tmp_path):
    import os

    import torch

    from asyncrl.config.schema import SchedulerConfig
    from asyncrl.launch import LocalScheduler

    before = (os.sched_getaffinity(0), torch.get_num_threads())
    with LocalScheduler(SchedulerConfig(), tmp_path) as scheduler:
        scheduler.trainer_cores = sorted(before[0])[:1]
        assert scheduler.pin_trainer() == 1
        assert os.sched_getaffinity(0) == set(scheduler.trainer_cores)
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == before


# -- the local scheduler through the Scheduler protocol ------------------------------------

# A worker: writes its environment to argv[3] (unless "-"), then answers /health with 200.
HEALTH_SERVER = r"""
import http.server, json, os, sys
host, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if out != "-":
    with open(out + ".tmp", "w") as f:
        json.dump(dict(os.environ, AFFINITY=sorted(os.sched_getaffinity(0))), f)
    os.replace(out + ".tmp", out)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')
    def log_message(self, *args):
        pass
http.server.HTTPServer((host, port), Health).serve_forever()
"""


def health_server(env_file: str = "-") -> list[str]:
    """argv of a worker that records its environment and serves /health."""
    import sys

    return [sys.executable, "-c", HEALTH_SERVER, "{host}", "{port}", env_file]


def pid_alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.fixture
def local(tmp_path):
    from asyncrl.config.schema import SchedulerConfig
    from asyncrl.launch import LocalScheduler

    with LocalScheduler(SchedulerConfig(startup_timeout=20), tmp_path) as scheduler:
        yield scheduler


def test_local_workers_become_healthy_and_are_registered(local, tmp_path):
    import json

    from asyncrl.launch import WorkerSpec, read_registry

    workers = local.create_workers(WorkerSpec("agent", 2, health_server(), cpus=0))
    assert [w.index for w in workers] == [0, 1] and workers[0].port != workers[1].port
    assert all(w.address == f"http://127.0.0.1:{w.port}" for w in workers)
    assert local.check_health("agent") == [True, True]
    raw = json.loads((tmp_path / "services.json").read_text())
    assert raw["scheduler"] == "local"
    assert [(w["role"], w["index"], w["address"], w["pid"]) for w in raw["workers"]] == [
        ("agent", w.index, w.address, w.pid) for w in workers]
    assert read_registry(tmp_path)["workers"] == workers
    assert workers[1].log_path == str(tmp_path / "logs" / "agent-1.log")


def test_a_core_share_widens_affinity_keeps_home_threads_and_is_removed(tmp_path):
    import json
    import os

    import torch

    from asyncrl.api import cores
    from asyncrl.config.schema import SchedulerConfig
    from asyncrl.launch import LocalScheduler, WorkerSpec

    machine = sorted(os.sched_getaffinity(0))
    if len(machine) < 2:
        pytest.skip("needs 2 cores")
    with LocalScheduler(SchedulerConfig(startup_timeout=20), tmp_path) as scheduler:
        path = scheduler.open_core_share()
        spec = WorkerSpec("inference", 1, health_server(str(tmp_path / "env.json")),
                          env={cores.ENV: f"{path},{{index}}"}, cores=[machine[1:2]],
                          affinity=machine[:2])
        scheduler.create_workers(spec)
        env = json.loads((tmp_path / "env.json").read_text())
        # it may run on both cores, but its home (OpenMP team) is its own one
        assert (env["AFFINITY"], env["OMP_NUM_THREADS"], env[cores.ENV]) == (
            machine[:2], "1", f"{path},0")
        assert scheduler.pin_trainer(machine[:1], shared=machine[:2]) == 1
        assert os.sched_getaffinity(0) == set(machine[:2])
        share = cores.current()
        assert (share.path, share.slot, share.home) == (path, cores.TRAINER_SLOT, 1)
    assert cores.current() is None and not os.path.exists(path)
    assert os.sched_getaffinity(0) == set(machine) and torch.get_num_threads() >= 1


def test_local_torch_distributed_workers_get_rank_variables_cores_and_threads(local, tmp_path):
    import json
    import os

    from asyncrl.launch import WorkerSpec

    core = min(os.sched_getaffinity(0))
    spec = WorkerSpec("trainer", 2, health_server(str(tmp_path / "env-{index}.json")),
                      env={"WHO": "rank{index}"}, torch_distributed=True, cores=[[core], [core]])
    local.create_workers(spec)
    envs = [json.loads((tmp_path / f"env-{i}.json").read_text()) for i in range(2)]
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "WHO",
            "OMP_NUM_THREADS")
    assert [[e[k] for k in keys] for e in envs] == [
        ["0", "2", "0", "2", "127.0.0.1", "rank0", "1"], ["1", "2", "1", "2", "127.0.0.1", "rank1", "1"]]
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and envs[0]["AFFINITY"] == [core]


def test_local_restart_after_a_kill_and_delete_leave_no_process(local):
    import os
    import signal
    import time

    from asyncrl.launch import WorkerSpec

    [old] = local.create_workers(WorkerSpec("inference", 1, health_server(), cpus=0))
    os.kill(old.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while pid_alive(old.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert local.check_health("inference") == [False]
    with pytest.raises(SchedulerError, match="died"):
        local.check_alive()
    new = local.restart_worker("inference", 0)
    assert new.pid != old.pid and new.port == old.port  # the same address for its clients
    assert local.check_health("inference") == [True]
    local.delete_workers()
    assert not pid_alive(new.pid) and local.get_workers("inference") == []


def test_a_fixed_port_is_kept_and_a_taken_one_is_an_error(local):
    import socket

    from asyncrl.launch import WorkerSpec
    from asyncrl.launch.base import free_port

    port = free_port()
    [worker] = local.create_workers(WorkerSpec("agent", 1, health_server(), cpus=0, port=port))
    assert worker.address == f"http://127.0.0.1:{port}" and local.check_health("agent") == [True]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        with pytest.raises(SchedulerError, match=f"port {taken} on 127.0.0.1, which is taken"):
            local.create_workers(WorkerSpec("other", 1, health_server(), cpus=0, port=taken))


def test_a_worker_that_exits_during_start_up_is_an_error_with_its_log(local):
    import sys

    from asyncrl.launch import WorkerSpec

    crash = [sys.executable, "-c", "import sys; print('no model at {port}'); sys.exit(3)"]
    with pytest.raises(SchedulerError, match=r"exited with code 3 during start-up(.|\n)*no model"):
        local.create_workers(WorkerSpec("inference", 1, crash, cpus=0))
    assert local.get_workers("inference") == []


def test_workers_started_without_waiting_are_waited_for_later(local, tmp_path):
    import sys

    from asyncrl.launch import WorkerSpec, read_registry

    workers = local.create_workers(WorkerSpec("agent", 1, health_server(), cpus=0), wait=False)
    assert not (tmp_path / "services.json").exists()  # registered once healthy
    local.wait_workers("agent")
    assert local.check_health("agent") == [True]
    assert read_registry(tmp_path)["workers"] == workers
    # A worker that dies while the caller does its own loading fails the wait, with its log.
    crash = [sys.executable, "-c", "import sys; print('no model at {port}'); sys.exit(3)"]
    local.create_workers(WorkerSpec("inference", 1, crash, cpus=0), wait=False)
    with pytest.raises(SchedulerError, match=r"exited with code 3 during start-up(.|\n)*no model"):
        local.wait_workers("inference")
    assert local.get_workers("inference") == []


def test_launch_inference_servers_pins_cpu_servers_and_gives_gpu_servers_their_device(tmp_path):
    import os
    from types import SimpleNamespace

    from asyncrl.config.schema import LocalEngineConfig, SchedulerConfig
    from asyncrl.launch import LocalScheduler

    cores = sorted(os.sched_getaffinity(0))
    scheduler = LocalScheduler(SchedulerConfig(inference_threads=1, trainer_threads=1), tmp_path)
    specs = []
    scheduler.create_workers = lambda spec: specs.append(spec) or [
        SimpleNamespace(address=f"http://127.0.0.1:{9000 + i}") for i in range(spec.count)]
    assert scheduler.launch_inference_servers("/m", LocalEngineConfig(), n_servers=1,
                                              seed=5) == ["http://127.0.0.1:9000"]
    assert specs[0].cores == [[cores[1 % len(cores)]]] and scheduler.trainer_cores == cores[:1]
    assert specs[0].worker_args == [["--seed", "5"]]
    scheduler.launch_inference_servers("/m", LocalEngineConfig(), n_servers=1, seed=5,
                                       backend="vllm", device="cuda", first_gpu=2)
    assert specs[1].gpu_ids == [[2]] and specs[1].cores == [[]] and scheduler.trainer_cores == []
    assert specs[1].env["VLLM_CACHE_ROOT"] == os.environ.get(
        "VLLM_CACHE_ROOT", str(tmp_path / "logs" / "vllm-cache"))


def test_make_scheduler_picks_the_configured_type(tmp_path):
    from types import SimpleNamespace

    from asyncrl.config.schema import ClusterConfig, SchedulerConfig
    from asyncrl.launch import LocalScheduler, make_scheduler

    assert isinstance(make_scheduler(SchedulerConfig(), ClusterConfig(), tmp_path), LocalScheduler)
    with pytest.raises(ValueError, match="scheduler.type='mesos' is not one of"):
        make_scheduler(SimpleNamespace(type="mesos"), ClusterConfig(), tmp_path)
