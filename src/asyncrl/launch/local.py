"""The `local` scheduler: every worker a subprocess of this one, on 127.0.0.1.

It starts each worker, waits for its /health (failing early, with the log's tail, if the
process dies), keeps logs under <run>/logs/<role>-<index>.log, and stops every child on
exit, on Ctrl-C and when this process dies (PR_SET_PDEATHSIG), so none outlives its run.

On a CPU machine generation and training run at the same time; each gets its own cores
(affinity and thread count) instead of both oversubscribing the machine. With a core share
(`open_core_share`, api/cores.py) each may also run on the other's cores while the other
is idle.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.api import cores as cores_api
from asyncrl.config.schema import LocalEngineConfig, SchedulerConfig
from asyncrl.launch import process
from asyncrl.launch.base import (
    SchedulerError,
    Worker,
    WorkerSpec,
    cause_line,
    free_port,
    health_ok,
    log_tail,
    port_is_free,
    torch_env,
    wait_healthy,
    write_registry,
)
from asyncrl.launch.commands import LoraServing, inference_spec

__all__ = ["LocalScheduler", "SchedulerError", "free_port", "split_cores"]

logger = logging.getLogger(__name__)
HOST = "127.0.0.1"


def rank_cores(cores: list[int], world_size: int) -> list[list[int]]:
    """The trainer's cores in `world_size` contiguous parts (one core each when too few)."""
    if len(cores) < world_size:
        return [[cores[r % len(cores)]] for r in range(world_size)]
    per = len(cores) // world_size
    return [cores[r * per:(r + 1) * per] for r in range(world_size)]


def split_cores(cores: list[int], inference_threads: int | None, trainer_threads: int | None,
                n_servers: int) -> tuple[list[list[int]], list[int]]:
    """Cores for each server and for the trainer; None splits the machine evenly."""
    n = len(cores)
    if trainer_threads is None:
        trainer_threads = max(1, n - inference_threads) if inference_threads else max(1, n // 2)
    if inference_threads is None:
        inference_threads = max(n_servers, n - trainer_threads)
    if inference_threads < n_servers:
        raise SchedulerError(f"scheduler.inference_threads={inference_threads} is fewer than "
                             f"rollout.n_servers={n_servers}; give each server a core at least")
    if inference_threads + trainer_threads > n:
        logger.warning("inference (%d) + trainer (%d) threads exceed the %d cores available; "
                       "they will share cores", inference_threads, trainer_threads, n)
    trainer = cores[:trainer_threads]
    # The servers take the cores after the trainer's, wrapping round when there are too few.
    inference = [cores[(trainer_threads + i) % n] for i in range(inference_threads)]
    per = inference_threads // n_servers
    return [inference[i * per:(i + 1) * per] for i in range(n_servers)], trainer


def visible_devices(gpus: Sequence[int]) -> str:
    """CUDA_VISIBLE_DEVICES for a worker given GPUs `gpus` of this process's GPUs: the same
    physical GPUs this process sees as cuda:<i> (through its own CUDA_VISIBLE_DEVICES, if set),
    so a worker on GPU 0 shares the inline trainer's cuda:0."""
    mine = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not mine:
        return ",".join(map(str, gpus))
    ids = [d.strip() for d in mine.split(",")]
    missing = [g for g in gpus if g >= len(ids)]
    if missing:
        raise SchedulerError(f"GPUs {missing} are not among this process's "
                             f"CUDA_VISIBLE_DEVICES={mine}; show it more GPUs or lower "
                             "cluster.n_gpus_per_node")
    return ",".join(ids[g] for g in gpus)


@dataclass
class _Proc:
    """A started worker and what it takes to start it again."""

    worker: Worker
    proc: subprocess.Popen
    cores: list[int]
    env: dict[str, str] = field(default_factory=dict)  # scheduler-chosen: GPUs, rank variables


class LocalScheduler:
    """Starts, watches and stops the subprocesses of one run."""

    def __init__(self, cfg: SchedulerConfig, run_dir: Path, *, log_dir: Path | None = None,
                 ) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.log_dir = Path(log_dir) if log_dir is not None else self.run_dir / "logs"
        self.specs: dict[str, WorkerSpec] = {}
        self.procs: dict[str, list[_Proc]] = {}
        self.trainer_cores: list[int] = []
        self._unpinned: tuple[set[int], int] | None = None  # affinity and threads before pinning
        self._core_share: str | None = None  # the share file of `open_core_share`
        self._next_core = 0
        self._next_gpu = 0

    def __enter__(self) -> LocalScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the Scheduler protocol ------------------------------------------------------------

    def create_workers(self, spec: WorkerSpec, *, wait: bool = True) -> list[Worker]:
        """Start `spec.count` subprocesses; return them once all are healthy.

        `wait=False`: return them at once; `wait_workers(role)` waits for them later (so
        the caller loads its own part meanwhile).
        """
        if spec.role in self.procs:
            raise SchedulerError(f"role {spec.role!r} already has workers; delete them first")
        cores = spec.cores or [self._take_cores(spec.cpus) for _ in range(spec.count)]
        gpus = spec.gpu_ids or [self._take_gpus(spec.gpus) for _ in range(spec.count)]
        rank_env: list[dict[str, str]] = [{} for _ in range(spec.count)]
        if spec.torch_distributed:
            master_port = free_port()
            rank_env = [torch_env(r, ["local"] * spec.count, HOST, master_port)
                        for r in range(spec.count)]
        self.specs[spec.role], self.procs[spec.role] = spec, []
        try:
            for i in range(spec.count):
                env = dict(rank_env[i])
                if gpus[i]:
                    env["CUDA_VISIBLE_DEVICES"] = visible_devices(gpus[i])
                self.procs[spec.role].append(self._spawn(spec, i, cores[i], env,
                                                           spec.pick_port(HOST)))
        except BaseException:
            self.delete_workers(spec.role)
            raise
        if wait:
            self.wait_workers(spec.role)
        return self.get_workers(spec.role)

    def wait_workers(self, role: str) -> None:
        """Return once every worker of `role` is healthy; a failed start stops them all."""
        try:
            self._wait_healthy(self.procs[role])
        except BaseException:
            self.delete_workers(role)
            raise
        self._write_registry()

    def get_workers(self, role: str) -> list[Worker]:
        return [p.worker for p in self.procs.get(role, [])]

    def check_health(self, role: str) -> list[bool]:
        path = self.specs[role].health_path
        return [p.proc.poll() is None and (path is None or health_ok(p.worker.address, path))
                for p in self.procs[role]]

    def restart_worker(self, role: str, index: int) -> Worker:
        """Stop worker `index` if it runs and start it again, on the same port when free."""
        old = self.procs[role][index]
        process.stop([old.proc])
        port = old.worker.port if port_is_free(HOST, old.worker.port) \
            else self.specs[role].pick_port(HOST)
        self.procs[role][index] = new = self._spawn(self.specs[role], index, old.cores, old.env,
                                                    port)
        self._wait_healthy([new])
        self._write_registry()
        return new.worker

    def delete_workers(self, role: str | None = None, timeout: float = 10.0) -> None:
        roles = [r for r in self.procs if role is None or r == role]
        if not roles:
            return
        process.stop([p.proc for r in roles for p in self.procs.get(r, [])], timeout)
        for r in roles:
            self.procs.pop(r, None)
            self.specs.pop(r, None)
        self._write_registry()

    def close(self) -> None:
        self.stop_all()

    # -- what controller/rl.py, `asyncrl serve` and the tests call ---------------------------

    def launch_inference_servers(self, model_path: str, engine_cfg: LocalEngineConfig, *,
                                 n_servers: int, seed: int, backend: str = "local",
                                 device: str = "cpu", first_gpu: int = 0,
                                 extra_args: Sequence[str] = (),
                                 lora: LoraServing | None = None) -> list[str]:
        """Start `n_servers` `backend` servers, wait until all are healthy, return their addresses.

        `device` "cpu" pins each server to its cores; "cuda" gives server i GPU first_gpu + i
        (the trainer's ranks use GPUs 0 .. first_gpu - 1); "cuda:<ids>" gives all of them <ids>.
        `lora`: the servers load LoRA adapters of that shape.
        """
        cores = sorted(os.sched_getaffinity(0))
        server_cores, self.trainer_cores = split_cores(
            cores, self.cfg.inference_threads, self.cfg.trainer_threads, n_servers)
        spec = inference_spec(backend, model_path, engine_cfg, n_servers=n_servers, seed=seed,
                              device=device, cpus=len(server_cores[0]), extra_args=extra_args,
                              cache_dir=str(self.log_dir / "vllm-cache"), lora=lora)
        spec.cores = server_cores
        if device != "cpu":
            self.trainer_cores = []  # the trainer computes on its GPUs: leave its cores alone
            spec.cores = [[] for _ in server_cores]
        if device == "cuda":
            spec.gpu_ids = [[first_gpu + i] for i in range(n_servers)]
        return [w.address for w in self.create_workers(spec)]

    def restart_server(self, index: int) -> Worker:
        """Start server `index` again, same command and port (after it died or was stopped)."""
        old = self.procs["inference"][index]
        if old.proc.poll() is None:
            raise SchedulerError(f"inference server {old.worker.address} is still running (pid "
                                 f"{old.proc.pid}); stop it before restarting it")
        return self.restart_worker("inference", index)

    def stop_server(self, index: int, timeout: float = 10.0) -> None:
        """Stop server `index` (and its children: vLLM runs its engine in a child process)."""
        process.stop([self.procs["inference"][index].proc], timeout)

    def open_core_share(self) -> str:
        """A new core share (api/cores.py) for this run's processes, removed by `stop_all`.

        Servers join it through ASYNCRL_CORE_SHARE in their spec's env; the trainer through
        `pin_trainer(..., shared=...)`. Returns its path (in /dev/shm where there is one).
        """
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self._core_share = cores_api.CoreShare.create(
            os.path.join(folder, f"asyncrl-cores-{os.getpid()}-{secrets.token_hex(4)}"))
        return self._core_share

    def pin_trainer(self, cores: list[int] | None = None, *,
                    shared: list[int] | None = None) -> int:
        """Pin this process to the trainer's cores until `stop_all`; returns its thread count.

        `cores`: those cores (default: what `launch_inference_servers` left the trainer).
        `shared`: with a core share open, the cores this process may run on; it joins the
        share with `cores` as its home and borrows what idle servers lend.
        """
        import torch

        if cores is not None:
            self.trainer_cores = list(cores)
        if self.trainer_cores:
            sharing = bool(shared and self._core_share)
            self._unpinned = (os.sched_getaffinity(0), torch.get_num_threads())
            os.sched_setaffinity(0, shared if sharing else self.trainer_cores)
            torch.set_num_threads(len(self.trainer_cores))
            if sharing:
                cores_api.join(cores_api.CoreShare(self._core_share, cores_api.TRAINER_SLOT,
                                                   len(self.trainer_cores)))
        return torch.get_num_threads()

    def check_alive(self) -> None:
        """Raise if a worker has died since start-up."""
        for p in (p for procs in self.procs.values() for p in procs):
            if p.proc.poll() is not None:
                w = p.worker
                cause = cause_line(w.log_path)
                raise SchedulerError(
                    f"{w.role} {w.index} ({w.address}) died (exit code {p.proc.returncode})"
                    + (f": {cause}" if cause else "")
                    + f"; the end of {w.log_path}:\n{log_tail(w.log_path)}")

    def stop_all(self, timeout: float = 10.0) -> None:
        """SIGTERM every worker, then SIGKILL what is left after `timeout` seconds."""
        self.delete_workers(None, timeout)
        self._unpin_trainer()

    # -- internals ------------------------------------------------------------------------

    def _spawn(self, spec: WorkerSpec, index: int, cores: list[int], env: dict[str, str],
               port: int) -> _Proc:
        values = {"host": HOST, "port": str(port), "index": str(index),
                  "cpus": str(len(cores) or spec.cpus), "cores": ",".join(map(str, cores))}
        full_env = dict(os.environ)
        if cores:
            full_env["OMP_NUM_THREADS"] = str(len(cores))
        full_env.update(env)
        full_env.update(spec.environment(values))
        log_path = self.log_dir / f"{spec.role}-{index}.log"
        proc = process.spawn(spec.argv(index, values), full_env, log_path,
                             spec.affinity or cores)
        logger.info("%s %d: pid %d on cores %s, port %d, log %s",
                    spec.role, index, proc.pid, cores, port, log_path)
        host = socket.gethostname()
        worker = Worker(role=spec.role, index=index, host=HOST, port=port,
                        address=f"http://{HOST}:{port}", node_id=host, pid=proc.pid,
                        log_path=str(log_path), hostname=host)
        return _Proc(worker, proc, cores, env)

    def _wait_healthy(self, procs: list[_Proc]) -> None:
        by_worker = {id(p.worker): p.proc for p in procs}

        def exited(w: Worker) -> str | None:
            code = by_worker[id(w)].poll()
            return None if code is None else f"exited with code {code}"

        spec = self.specs[procs[0].worker.role]
        wait_healthy([p.worker for p in procs], health_path=spec.health_path,
                     timeout=self.cfg.startup_timeout, exited=exited,
                     tail=lambda w: log_tail(w.log_path))

    def _take_cores(self, n: int) -> list[int]:
        """The next `n` of this process's cores, wrapping round (0: not pinned)."""
        cores = sorted(os.sched_getaffinity(0))
        taken = [cores[(self._next_core + i) % len(cores)] for i in range(n)]
        self._next_core += n
        return taken

    def _take_gpus(self, n: int) -> list[int]:
        taken = list(range(self._next_gpu, self._next_gpu + n))
        self._next_gpu += n
        return taken

    def _unpin_trainer(self) -> None:
        """Give the process its cores back (a later run in this process splits them anew)."""
        import torch

        share = cores_api.join(None)
        if share is not None:
            share.close()
        if self._core_share is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._core_share)
            self._core_share = None
        if self._unpinned is not None:
            cores, threads = self._unpinned
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)
            self._unpinned = None

    def _write_registry(self) -> None:
        write_registry(self.run_dir, "local",
                       [p.worker for procs in self.procs.values() for p in procs])
