"""The `local` scheduler: inference servers as subprocesses of the trainer.

It starts each server, waits for its /health (failing early, with the log's tail, if the
process dies), keeps logs under <run>/logs/, and stops every child on exit, on Ctrl-C and
when the trainer itself dies (PR_SET_PDEATHSIG), so no server outlives its run.

On a CPU machine generation and training run at the same time; each gets its own cores
(affinity and thread count) instead of both oversubscribing the machine.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.config.schema import LocalEngineConfig, SchedulerConfig

logger = logging.getLogger(__name__)


class SchedulerError(RuntimeError):
    """A process could not be started or did not become healthy."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the parent dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class ServerProcess:
    address: str
    proc: subprocess.Popen
    log_path: Path
    cores: list[int] = field(default_factory=list)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class LocalScheduler:
    """Starts, watches and stops the inference servers of one run."""

    def __init__(self, cfg: SchedulerConfig, log_dir: Path) -> None:
        self.cfg = cfg
        self.log_dir = Path(log_dir)
        self.servers: list[ServerProcess] = []
        self.trainer_cores: list[int] = []
        self._unpinned: tuple[set[int], int] | None = None  # affinity and threads before pinning

    def __enter__(self) -> LocalScheduler:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def launch_inference_servers(self, model_path: str, engine_cfg: LocalEngineConfig, *,
                                 n_servers: int, seed: int) -> list[str]:
        """Start `n_servers` local servers, wait until all are healthy, return their addresses."""
        cores = sorted(os.sched_getaffinity(0))
        server_cores, self.trainer_cores = split_cores(
            cores, self.cfg.inference_threads, self.cfg.trainer_threads, n_servers)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for i, my_cores in enumerate(server_cores):
            self.servers.append(self._start_server(i, model_path, engine_cfg, my_cores, seed))
        for server in self.servers:
            self._wait_healthy(server)
        return [s.address for s in self.servers]

    def _start_server(self, index: int, model_path: str, engine_cfg: LocalEngineConfig,
                      cores: list[int], seed: int) -> ServerProcess:
        port = free_port()
        cmd = [
            sys.executable, "-m", "asyncrl.inference.server",
            "--model", model_path, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", engine_cfg.dtype, "--threads", str(len(cores)),
            "--max-batch-size", str(engine_cfg.max_batch_size),
            "--max-seq-len", str(engine_cfg.max_seq_len), "--seed", str(seed + index),
        ]
        if not engine_cfg.recompute_kv_on_update:
            cmd.append("--no-recompute-kv-on-update")
        env = dict(os.environ, OMP_NUM_THREADS=str(len(cores)), PYTHONUNBUFFERED="1")
        log_path = self.log_dir / f"server-{index}.log"
        log = open(log_path, "w")

        def preexec() -> None:
            _die_with_parent()
            os.sched_setaffinity(0, cores)

        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=preexec, start_new_session=True)
        log.close()
        logger.info("server %d: pid %d on cores %s, port %d, log %s",
                    index, proc.pid, cores, port, log_path)
        return ServerProcess(f"http://127.0.0.1:{port}", proc, log_path, cores)

    def _wait_healthy(self, server: ServerProcess) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise SchedulerError(
                    f"inference server {server.address} exited with code {server.proc.returncode} "
                    f"during start-up; the end of {server.log_path}:\n{server.log_tail()}")
            try:
                with urllib.request.urlopen(server.address + "/health", timeout=2) as resp:
                    if json.load(resp).get("status") == "ok":
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
                pass
            time.sleep(0.5)
        raise SchedulerError(
            f"inference server {server.address} was not healthy within "
            f"scheduler.startup_timeout={self.cfg.startup_timeout} s; the end of "
            f"{server.log_path}:\n{server.log_tail()}")

    def pin_trainer(self) -> int:
        """Pin this process to the trainer's cores until `stop_all`; returns its thread count."""
        import torch

        if self.trainer_cores:
            self._unpinned = (os.sched_getaffinity(0), torch.get_num_threads())
            os.sched_setaffinity(0, self.trainer_cores)
            torch.set_num_threads(len(self.trainer_cores))
        return torch.get_num_threads()

    def _unpin_trainer(self) -> None:
        """Give the process its cores back (a later run in this process splits them anew)."""
        import torch

        if self._unpinned is not None:
            cores, threads = self._unpinned
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)
            self._unpinned = None

    def check_alive(self) -> None:
        """Raise if a server has died since start-up."""
        for server in self.servers:
            if server.proc.poll() is not None:
                raise SchedulerError(
                    f"inference server {server.address} died (exit code "
                    f"{server.proc.returncode}); the end of {server.log_path}:\n{server.log_tail()}")

    def stop_all(self, timeout: float = 10.0) -> None:
        """SIGTERM every server, then SIGKILL what is left after `timeout` seconds."""
        for server in self.servers:
            if server.proc.poll() is None:
                server.proc.terminate()
        deadline = time.monotonic() + timeout
        for server in self.servers:
            try:
                server.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait()
        self.servers = []
        self._unpin_trainer()
