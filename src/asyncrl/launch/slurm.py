"""The `slurm` scheduler: one sbatch job per role, one srun task per worker.

Each task runs `python -m asyncrl.launch.announce`, which picks a port on its node,
writes <run_dir>/services/<role>/<index>.json and execs the role's command; this side
waits for those files, then for /health. The run directory must be on storage every node
shares (cluster.fileroot). Trainer ranks get torchrun's variables: RANK from the task
index, MASTER_ADDR the job's first host, MASTER_PORT a port free there.
"""

from __future__ import annotations

import json
import logging
import math
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from asyncrl.config.schema import SchedulerConfig
from asyncrl.launch.base import (
    SchedulerError,
    Worker,
    WorkerSpec,
    health_ok,
    log_tail,
    wait_healthy,
    write_registry,
)

logger = logging.getLogger(__name__)
ALIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")


@dataclass
class _Role:
    spec: WorkerSpec
    jobs: list[str]  # the job running each worker (the role's job, or a restart's)
    workers: list[Worker] = field(default_factory=list)


class SlurmScheduler:
    """Submits, watches and cancels the jobs of one run."""

    def __init__(self, cfg: SchedulerConfig, run_dir: Path, *, n_nodes: int = 1,
                 n_gpus_per_node: int = 0, partition: str | None = None,
                 account: str | None = None, time_limit: str | None = None,
                 sbatch_args: Sequence[str] = (), bind_host: str | None = None,
                 python: str = sys.executable, poll_interval: float = 1.0) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.n_nodes, self.n_gpus_per_node = n_nodes, n_gpus_per_node
        self.directives = [f"--{k}={v}" for k, v in (("partition", partition),
                                                     ("account", account),
                                                     ("time", time_limit)) if v]
        self.directives += list(sbatch_args)
        self.bind_host, self.python, self.poll_interval = bind_host, python, poll_interval
        self.roles: dict[str, _Role] = {}

    def __enter__(self) -> SlurmScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create_workers(self, spec: WorkerSpec) -> list[Worker]:
        """Submit the role's job; return its workers once all announced and are healthy."""
        if spec.role in self.roles:
            raise SchedulerError(f"role {spec.role!r} already has workers; delete them first")
        for sub in ("slurm", "logs"):  # Slurm does not create the folders of --output
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        spec_path = self.run_dir / "slurm" / f"{spec.role}.spec.json"
        spec_path.write_text(json.dumps(asdict(spec)))
        for old in self._services(spec.role).glob("*.json"):
            old.unlink()
        script = self.run_dir / "slurm" / f"{spec.role}.sbatch"
        script.write_text(self.script(spec))
        role = self.roles[spec.role] = _Role(spec, [self._submit(script)] * spec.count)
        self._write_registry()
        try:
            role.workers = self._wait_announced(role, range(spec.count))
            self._wait_healthy(role, role.workers)
        except BaseException:
            self.delete_workers(spec.role)
            raise
        self._write_registry()
        return list(role.workers)

    def get_workers(self, role: str) -> list[Worker]:
        return list(self.roles[role].workers) if role in self.roles else []

    def check_health(self, role: str) -> list[bool]:
        r = self.roles[role]
        states = {job: self._state(job) for job in set(r.jobs)}
        path = r.spec.health_path
        return [states[job] == "RUNNING" and (path is None or health_ok(w.address, path))
                for job, w in zip(r.jobs, r.workers)]

    def restart_worker(self, role: str, index: int) -> Worker:
        """Run worker `index` again as a one-task job (Slurm cannot restart one task of a job)."""
        r = self.roles[role]
        old = r.workers[index]
        if r.jobs.count(r.jobs[index]) == 1:
            self._cancel([r.jobs[index]])  # its own job (from an earlier restart): replace it
        elif r.spec.health_path and health_ok(old.address, r.spec.health_path):
            raise SchedulerError(f"{role} {index} ({old.address}) still answers; Slurm cannot "
                                 f"stop one task of job {r.jobs[index]}, so it is not restarted")
        (self._services(role) / f"{index}.json").unlink(missing_ok=True)
        script = self.run_dir / "slurm" / f"{role}-{index}.sbatch"
        script.write_text(self.script(r.spec, index=index))
        r.jobs[index] = self._submit(script)
        [r.workers[index]] = self._wait_announced(r, [index])
        self._wait_healthy(r, [r.workers[index]])
        self._write_registry()
        return r.workers[index]

    def delete_workers(self, role: str | None = None) -> None:
        """scancel the jobs of `role` (None: all); Slurm sends SIGTERM, then SIGKILL."""
        names = [n for n in self.roles if role is None or n == role]
        if not names:
            return
        self._cancel(sorted({job for n in names for job in self.roles[n].jobs}))
        for name in names:
            del self.roles[name]
            for announced in self._services(name).glob("*.json"):
                announced.unlink()
        self._write_registry()

    def close(self) -> None:
        self.delete_workers(None)

    def script(self, spec: WorkerSpec, index: int | None = None) -> str:
        """The sbatch script of `spec` (of its worker `index` alone when given)."""
        tasks = spec.count if index is None else 1
        if spec.gpus and self.n_gpus_per_node:
            nodes = math.ceil(tasks * spec.gpus / self.n_gpus_per_node)
        else:
            nodes = min(tasks, self.n_nodes)
        logs = self.run_dir / "logs"
        name = spec.role if index is None else f"{spec.role}-{index}"
        lines = ["#!/bin/bash", f"#SBATCH --job-name=asyncrl-{name}",
                 f"#SBATCH --output={logs}/{name}-sbatch-%j.log", "#SBATCH --open-mode=append",
                 f"#SBATCH --nodes={nodes}", f"#SBATCH --ntasks={tasks}",
                 f"#SBATCH --cpus-per-task={max(1, spec.cpus)}"]
        if spec.gpus:
            lines.append(f"#SBATCH --gpus-per-task={spec.gpus}")
        if spec.memory_gb:
            lines.append(f"#SBATCH --mem={math.ceil(spec.memory_gb * math.ceil(tasks / nodes))}G")
        lines += [f"#SBATCH {d}" for d in self.directives]
        lines += ["set -eu"]
        if spec.torch_distributed:
            first_host = ('export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" '
                          '| head -n 1)"')
            # The batch script runs on the job's first node: the port is free there.
            port = (f"export MASTER_PORT=$({shlex.quote(self.python)} -c 'import socket; "
                    "s = socket.socket(); s.bind((\"\", 0)); print(s.getsockname()[1])')")
            lines += [first_host, port]
        output = f"{logs}/{spec.role}-%t.log" if index is None else f"{logs}/{name}.log"
        announce = [self.python, "-m", "asyncrl.launch.announce",
                    "--spec", str(self.run_dir / "slurm" / f"{spec.role}.spec.json"),
                    "--dir", str(self._services(spec.role))]
        if index is not None:
            announce += ["--index", str(index)]
        if self.bind_host:
            announce += ["--host", self.bind_host]
        srun = ["srun", f"--ntasks={tasks}", f"--cpus-per-task={max(1, spec.cpus)}",
                f"--output={output}", "--open-mode=append", "--kill-on-bad-exit=0", *announce]
        lines.append(" ".join(shlex.quote(a) for a in srun))
        return "\n".join(lines) + "\n"

    def _services(self, role: str) -> Path:
        return self.run_dir / "services" / role

    def _submit(self, script: Path) -> str:
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            raise SchedulerError(f"sbatch {script} failed ({done.returncode}): "
                                 f"{done.stderr.strip() or done.stdout.strip()}")
        job = done.stdout.strip().split(";")[0]  # "<id>[;<cluster>]"
        logger.info("submitted %s as Slurm job %s", script, job)
        return job

    def _state(self, job: str) -> str:
        """squeue's state of `job`; "" once it has left the queue."""
        done = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                              text=True, check=False)
        return done.stdout.strip().splitlines()[0] if done.stdout.strip() else ""

    def _cancel(self, jobs: Sequence[str]) -> None:
        if jobs:
            subprocess.run(["scancel", *jobs], capture_output=True, text=True, check=False)

    def _wait_announced(self, role: _Role, indices: Sequence[int]) -> list[Worker]:
        """The workers at `indices` once each has written its announce file."""
        deadline = time.monotonic() + self.cfg.startup_timeout
        pending, found = list(indices), {}
        while pending:
            for i in list(pending):
                path = self._services(role.spec.role) / f"{i}.json"
                if path.exists():
                    found[i] = self._worker(role, i, json.loads(path.read_text()))
                    pending.remove(i)
            if not pending:
                break
            i = pending[0]
            log = self.run_dir / "logs" / f"{role.spec.role}-{i}.log"
            state = self._state(role.jobs[i])
            path = self._services(role.spec.role) / f"{i}.json"
            if state not in ALIVE and path.exists():
                continue  # it announced itself, then ended: the health check reports it
            if state not in ALIVE:
                raise SchedulerError(f"Slurm job {role.jobs[i]} of {role.spec.role} ended "
                                     f"({state or 'left the queue'}) before worker {i} started; "
                                     f"the end of {log}:\n{log_tail(log)}")
            if time.monotonic() > deadline:
                raise SchedulerError(f"{role.spec.role} {i} did not start within "
                                     f"scheduler.startup_timeout={self.cfg.startup_timeout} s "
                                     f"(job {role.jobs[i]} is {state})")
            time.sleep(self.poll_interval)
        return [found[i] for i in indices]

    def _worker(self, role: _Role, index: int, where: dict) -> Worker:
        host, port = where["host"], int(where["port"])
        return Worker(role=role.spec.role, index=index, host=host, port=port,
                      address=f"http://{host}:{port}", node_id=where["node_id"],
                      pid=int(where["pid"]), hostname=where["hostname"],
                      log_path=str(self.run_dir / "logs" / f"{role.spec.role}-{index}.log"),
                      job_id=role.jobs[index])

    def _wait_healthy(self, role: _Role, workers: list[Worker]) -> None:
        def exited(w: Worker) -> str | None:
            state = self._state(w.job_id)
            return None if state in ALIVE else f"ended (job {w.job_id}: {state or 'gone'})"

        wait_healthy(workers, health_path=role.spec.health_path,
                     timeout=self.cfg.startup_timeout, exited=exited,
                     tail=lambda w: log_tail(w.log_path), interval=self.poll_interval)

    def _write_registry(self) -> None:
        workers = [w for r in self.roles.values() for w in r.workers]
        jobs = {name: sorted(set(r.jobs)) for name, r in self.roles.items()}
        write_registry(self.run_dir, "slurm", workers, jobs=jobs)
