"""The Slurm scheduler's sbatch scripts, run by a fake sbatch/srun that starts tasks here."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_scheduler import health_server, pid_alive

from asyncrl.config.schema import SchedulerConfig
from asyncrl.launch import SchedulerError, WorkerSpec, read_registry
from asyncrl.launch.announce import tasks_on_node
from asyncrl.launch.slurm import SlurmScheduler

# sbatch, srun, squeue, scancel and scontrol on one node: sbatch runs the script at once
# (job ids 100, 101, ...), srun starts --ntasks local processes with Slurm's variables.
FAKE_SLURM = r"""
import json, os, re, signal, subprocess, sys
from pathlib import Path

state = Path(os.environ["FAKE_SLURM_DIR"])
tool, args = Path(sys.argv[0]).name, sys.argv[1:]
with open(state / "calls.jsonl", "a") as f:
    f.write(json.dumps([tool, *args]) + "\n")


def alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


if tool == "sbatch":
    script = Path(args[-1])
    opts = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script.read_text(), re.M))
    job = str(100 + len(list(state.glob("*.job"))))
    env = dict(os.environ, SLURM_JOB_ID=job, SLURM_JOB_NODELIST="localhost",
               SLURM_NTASKS=opts["ntasks"], SLURM_CPUS_PER_TASK=opts["cpus-per-task"],
               SLURM_TASKS_PER_NODE=opts["ntasks"], SLURM_NODEID="0")
    with open(opts["output"].replace("%j", job), "a") as out:
        proc = subprocess.Popen(["bash", str(script)], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    (state / f"{job}.job").write_text(str(proc.pid))
    print(job)
elif tool == "srun":
    opts = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
    command = args[next(i for i, a in enumerate(args) if not a.startswith("--")):]
    tasks = [subprocess.Popen(command, stdout=open(opts["output"].replace("%t", str(t)), "a"),
                              stderr=subprocess.STDOUT,
                              env=dict(os.environ, SLURM_PROCID=str(t), SLURM_LOCALID=str(t),
                                       SLURMD_NODENAME="localhost"))
             for t in range(int(opts["ntasks"]))]
    sys.exit(max(t.wait() for t in tasks))
elif tool == "scontrol":
    print("localhost")
elif tool == "squeue":
    job = state / (args[args.index("-j") + 1] + ".job")
    if job.exists() and alive(int(job.read_text())):
        print("RUNNING")
elif tool == "scancel":
    for job in args:
        try:
            os.killpg(int((state / f"{job}.job").read_text()), signal.SIGTERM)
        except ProcessLookupError:
            pass
"""


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """Fake Slurm commands on PATH; returns a function listing the calls made to them."""
    bin_dir, state = tmp_path / "bin", tmp_path / "slurm-state"
    bin_dir.mkdir()
    state.mkdir()
    for tool in ("sbatch", "srun", "squeue", "scancel", "scontrol"):
        (bin_dir / tool).write_text(f"#!{sys.executable}\n{FAKE_SLURM}")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_DIR", str(state))

    def calls(tool: str) -> list[list[str]]:
        lines = (state / "calls.jsonl").read_text().splitlines()
        return [c[1:] for c in map(json.loads, lines) if c[0] == tool]

    return calls


@pytest.fixture
def slurm(fake_slurm, tmp_path):
    with SlurmScheduler(SchedulerConfig(startup_timeout=20), tmp_path / "run",
                        bind_host="127.0.0.1", poll_interval=0.1) as scheduler:
        yield scheduler


def test_the_sbatch_script_asks_for_the_roles_resources_and_runs_announce_under_srun(tmp_path):
    scheduler = SlurmScheduler(SchedulerConfig(), tmp_path, n_nodes=4, n_gpus_per_node=4,
                               partition="gpu", account="rl", time_limit="2:00:00")
    spec = WorkerSpec("trainer", 8, ["train", "--port", "{port}"], cpus=16, gpus=1,
                      memory_gb=10.5, torch_distributed=True)
    lines = scheduler.script(spec).splitlines()
    directives = [line.split(" ", 1)[1] for line in lines if line.startswith("#SBATCH")]
    # 8 ranks x 1 GPU on nodes of 4 GPUs: 2 nodes, 4 ranks x 10.5 GB = 42 GB on each
    for expected in ("--nodes=2", "--ntasks=8", "--cpus-per-task=16", "--gpus-per-task=1",
                     "--mem=42G", "--partition=gpu", "--account=rl", "--time=2:00:00"):
        assert expected in directives
    assert any(line.startswith("export MASTER_ADDR=\"$(scontrol show hostnames") for line in lines)
    assert any(line.startswith("export MASTER_PORT=$(") for line in lines)
    srun = lines[-1].split()
    assert srun[:2] == ["srun", "--ntasks=8"] and f"--output={tmp_path}/logs/trainer-%t.log" in srun
    assert srun[srun.index("-m") + 1] == "asyncrl.launch.announce"
    assert srun[srun.index("--dir") + 1] == str(tmp_path / "services" / "trainer")
    one = scheduler.script(spec, index=3)
    assert "#SBATCH --ntasks=1" in one and "--index 3" in one and "#SBATCH --nodes=1" in one


def test_trainer_ranks_start_through_sbatch_with_torchrun_variables(slurm, fake_slurm, tmp_path):
    env_file = str(tmp_path / "env-{index}.json")
    spec = WorkerSpec("trainer", 2, health_server(env_file), env={"WHO": "rank{index}"},
                      torch_distributed=True)
    workers = slurm.create_workers(spec)
    assert [(w.host, w.job_id, w.node_id) for w in workers] == [("127.0.0.1", "100", "localhost")] * 2
    assert slurm.check_health("trainer") == [True, True]
    envs = [json.loads((tmp_path / f"env-{i}.json").read_text()) for i in range(2)]
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "WHO",
            "OMP_NUM_THREADS")
    assert [[e[k] for k in keys] for e in envs] == [
        ["0", "2", "0", "2", "localhost", "rank0", "1"],
        ["1", "2", "1", "2", "localhost", "rank1", "1"]]
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and envs[0]["MASTER_PORT"].isdigit()
    assert fake_slurm("sbatch") == [["--parsable", str(tmp_path / "run/slurm/trainer.sbatch")]]
    registry = read_registry(tmp_path / "run")
    assert registry["scheduler"] == "slurm" and registry["jobs"] == {"trainer": ["100"]}
    assert registry["workers"] == workers
    slurm.delete_workers("trainer")
    assert fake_slurm("scancel") == [["100"]]
    deadline = time.monotonic() + 10
    while any(pid_alive(w.pid) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(w.pid) for w in workers)
    assert read_registry(tmp_path / "run")["workers"] == []


def test_a_dead_task_is_restarted_as_a_job_of_its_own(slurm, fake_slurm, tmp_path):
    workers = slurm.create_workers(WorkerSpec("inference", 2, health_server()))
    with pytest.raises(SchedulerError, match="cannot stop one task of job 100"):
        slurm.restart_worker("inference", 1)
    os.kill(workers[1].pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(workers[1].pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slurm.check_health("inference") == [True, False]
    new = slurm.restart_worker("inference", 1)
    assert new.job_id == "101" and new.pid != workers[1].pid
    assert slurm.check_health("inference") == [True, True]
    script = (tmp_path / "run/slurm/inference-1.sbatch").read_text()
    assert "#SBATCH --ntasks=1" in script and "--index 1" in script
    assert read_registry(tmp_path / "run")["jobs"] == {"inference": ["100", "101"]}


def test_a_worker_that_exits_during_start_up_is_an_error_with_its_log(slurm):
    crash = [sys.executable, "-c", "raise SystemExit('no model at port {port}')"]
    with pytest.raises(SchedulerError, match=r"ended \(job 100(.|\n)*no model at port \d+"):
        slurm.create_workers(WorkerSpec("inference", 1, crash))
    assert slurm.get_workers("inference") == []


def test_announce_picks_a_port_writes_where_and_becomes_the_command(tmp_path):
    command = [sys.executable, "-c", "import os, sys; print(os.getpid(), *sys.argv[1:])",
               "{host}", "{port}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.launch.announce", "--dir", str(tmp_path),
         "--host", "127.0.0.1", "--", *command],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, SLURM_PROCID="3"))
    out, _ = proc.communicate(timeout=20)
    where = json.loads((tmp_path / "3.json").read_text())
    assert where["host"] == "127.0.0.1" and where["pid"] == proc.pid
    assert out.split() == [str(proc.pid), "127.0.0.1", str(where["port"])]


@pytest.mark.parametrize("tasks_per_node, node, expected", [
    ("4", 0, 4), ("2(x3),1", 1, 2), ("2(x3),1", 3, 1)])
def test_slurm_tasks_per_node_is_read_per_node(tasks_per_node, node, expected):
    assert tasks_on_node(tasks_per_node, node) == expected


def test_make_scheduler_passes_the_slurm_section(tmp_path):
    from asyncrl.config.schema import ClusterConfig, SlurmConfig
    from asyncrl.launch import make_scheduler

    cfg = SchedulerConfig(type="slurm")
    slurm_cfg = SlurmConfig(partition="gpu", time="1:00:00", extra_sbatch_args=["--qos=high"])
    scheduler = make_scheduler(cfg, ClusterConfig(n_nodes=2, n_gpus_per_node=8), tmp_path,
                               slurm_cfg=slurm_cfg, bind_host="127.0.0.1")
    assert isinstance(scheduler, SlurmScheduler) and scheduler.bind_host == "127.0.0.1"
    assert scheduler.directives == ["--partition=gpu", "--time=1:00:00", "--qos=high"]
    assert (scheduler.n_nodes, scheduler.n_gpus_per_node) == (2, 8)
