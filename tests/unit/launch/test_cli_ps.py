"""`asyncrl ps | logs | stop` on a run's services.json."""

import os
import socket
import sys
import time
from pathlib import Path

import pytest
from test_scheduler import health_server, pid_alive

from asyncrl.cli import main
from asyncrl.config.schema import SchedulerConfig
from asyncrl.launch import LocalScheduler, Worker, WorkerSpec
from asyncrl.launch.base import write_registry


@pytest.fixture
def run(tmp_path):
    """A run with two healthy local workers and one that exited."""
    with LocalScheduler(SchedulerConfig(startup_timeout=20), tmp_path) as scheduler:
        scheduler.create_workers(WorkerSpec("inference", 2, health_server(), cpus=0))
        code = "import time; print(*(f'line {i}' for i in range(5)), sep='\\n'); time.sleep(60)"
        say = [sys.executable, "-uc", code]
        [agent] = scheduler.create_workers(WorkerSpec("agent", 1, say, cpus=0, health_path=None))
        deadline = time.monotonic() + 10
        while "line 4" not in Path(agent.log_path).read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        scheduler.procs["agent"][0].proc.kill()
        scheduler.procs["agent"][0].proc.wait()
        yield scheduler


def test_ps_lists_each_worker_with_its_state(run, tmp_path, capsys):
    assert main(["ps", "--run", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "scheduler: local" and lines[1].split()[:3] == ["ROLE", "INDEX", "ADDRESS"]
    rows = {(r.split()[0], r.split()[1]): r.split() for r in lines[2:]}
    agent, server = run.get_workers("agent")[0], run.get_workers("inference")[1]
    assert rows[("agent", "0")][5] == "exited"
    assert rows[("inference", "1")][2:4] == [server.address, str(server.pid)]
    assert rows[("inference", "1")][5] == "healthy" and rows[("agent", "0")][6] == agent.log_path


def test_logs_shows_the_last_lines_of_one_worker(run, tmp_path, capsys):
    assert main(["logs", "--run", str(tmp_path), "agent", "0", "-n", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"==> {tmp_path}/logs/agent-0.log <==", "line 3", "line 4"]
    assert main(["logs", "--run", str(tmp_path), "trainer"]) == 1
    assert "no logs of 'trainer'" in capsys.readouterr().err


def test_stop_terminates_local_workers(run, tmp_path, capsys):
    pids = [w.pid for w in run.get_workers("inference")]
    assert main(["stop", "--run", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"already gone: agent 0 (pid {run.get_workers('agent')[0].pid})"] + [
        f"stopped: inference {i} (pid {pid})" for i, pid in enumerate(pids)]
    for proc in run.procs["inference"]:
        proc.proc.wait(10)
    assert not any(map(pid_alive, pids))


def test_stop_cancels_slurm_jobs_and_names_ray_workers_it_cannot_reach(tmp_path, monkeypatch,
                                                                        capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scancel").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/scancelled\n")
    (bin_dir / "scancel").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    far = Worker("inference", 0, "10.0.0.2", 8000, "http://10.0.0.2:8000", "node-b", 42,
                 "/x.log", hostname="gpu-node-7", job_id="17")
    write_registry(tmp_path / "slurm-run", "slurm", [far], jobs={"inference": ["17", "18"]})
    assert main(["stop", "--run", str(tmp_path / "slurm-run")]) == 0
    assert capsys.readouterr().out.split("\n")[:2] == ["cancelled Slurm job 17",
                                                       "cancelled Slurm job 18"]
    assert (tmp_path / "scancelled").read_text().split() == ["17", "18"]
    write_registry(tmp_path / "ray-run", "ray", [far])
    assert main(["stop", "--run", str(tmp_path / "ray-run")]) == 0
    assert "not stopped: inference 0 (pid 42) runs on gpu-node-7" in capsys.readouterr().out
    assert socket.gethostname() != "gpu-node-7"


def test_a_directory_without_services_is_an_error(tmp_path, capsys):
    assert main(["ps", "--run", str(tmp_path)]) == 1
    assert "no services.json in" in capsys.readouterr().err
