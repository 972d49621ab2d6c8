"""The `local` scheduler: inference servers (local, vLLM or SGLang) as subprocesses of the trainer.

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
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.config.schema import LocalEngineConfig, SchedulerConfig
from asyncrl.inference.launch import server_command

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


def _health_ok(body: bytes) -> bool:
    """Ours answers {"status": "ok"}; vLLM an empty 200, SGLang an empty or text 200."""
    try:
        parsed = json.loads(body) if body.strip() else {}
    except ValueError:
        return True
    return not isinstance(parsed, dict) or parsed.get("status", "ok") == "ok"


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
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

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
                                 n_servers: int, seed: int, backend: str = "local",
                                 device: str = "cpu", first_gpu: int = 0,
                                 extra_args: Sequence[str] = ()) -> list[str]:
        """Start `n_servers` `backend` servers, wait until all are healthy, return their addresses.

        `device` "cpu" pins each server to its cores; "cuda" gives server i GPU first_gpu + i
        (the trainer's ranks use GPUs 0 .. first_gpu - 1); "cuda:<ids>" gives all of them <ids>.
        """
        cores = sorted(os.sched_getaffinity(0))
        server_cores, self.trainer_cores = split_cores(
            cores, self.cfg.inference_threads, self.cfg.trainer_threads, n_servers)
        if device != "cpu":
            self.trainer_cores = []  # the trainer computes on its GPUs: leave its cores alone
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for i, my_cores in enumerate(server_cores):
            my_device = f"cuda:{first_gpu + i}" if device == "cuda" else device
            argv, env = self._command(i, backend, model_path, engine_cfg, my_cores, seed,
                                      my_device, extra_args)
            self.servers.append(self._spawn(i, argv, env, my_cores if device == "cpu" else []))
        for server in self.servers:
            self._wait_healthy(server)
        return [s.address for s in self.servers]

    def restart_server(self, index: int) -> ServerProcess:
        """Start server `index` again, same command and port (after it died or was stopped)."""
        old = self.servers[index]
        if old.proc.poll() is None:
            raise SchedulerError(f"inference server {old.address} is still running (pid "
                                 f"{old.proc.pid}); stop it before restarting it")
        self.servers[index] = self._spawn(index, old.argv, old.env, old.cores)
        self._wait_healthy(self.servers[index])
        return self.servers[index]

    def _command(self, index: int, backend: str, model_path: str, engine_cfg: LocalEngineConfig,
                 cores: list[int], seed: int, device: str,
                 extra_args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
        port = free_port()
        if backend == "local":
            extra = ["--threads", str(len(cores)),
                     "--max-batch-size", str(engine_cfg.max_batch_size),
                     "--max-seq-len", str(engine_cfg.max_seq_len), "--seed", str(seed + index)]
            if not engine_cfg.recompute_kv_on_update:
                extra.append("--no-recompute-kv-on-update")
        elif backend == "vllm":
            extra = ["--max-model-len", str(engine_cfg.max_seq_len),
                     "--max-num-seqs", str(engine_cfg.max_batch_size), "--seed", str(seed + index)]
        else:
            extra = ["--context-length", str(engine_cfg.max_seq_len),
                     "--max-running-requests", str(engine_cfg.max_batch_size),
                     "--random-seed", str(seed + index)]
        argv, env = server_command(backend, model_path, "127.0.0.1", port,
                                   dtype=engine_cfg.dtype, device=device,
                                   extra=[*extra, *extra_args])
        if device == "cpu":
            env["OMP_NUM_THREADS"] = str(len(cores))
            if backend == "vllm":
                env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
        if backend == "vllm":
            env.setdefault("VLLM_CACHE_ROOT", str(self.log_dir / "vllm-cache"))
        return argv, env

    def _spawn(self, index: int, argv: list[str], env: dict[str, str],
               cores: list[int]) -> ServerProcess:
        log_path = self.log_dir / f"server-{index}.log"
        log = open(log_path, "a")

        def preexec() -> None:
            _die_with_parent()
            if cores:
                os.sched_setaffinity(0, cores)

        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=preexec, start_new_session=True)
        log.close()
        port = argv[argv.index("--port") + 1]
        logger.info("server %d: pid %d on cores %s, port %s, log %s",
                    index, proc.pid, cores, port, log_path)
        return ServerProcess(f"http://127.0.0.1:{port}", proc, log_path, cores, argv, env)

    def _wait_healthy(self, server: ServerProcess) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise SchedulerError(
                    f"inference server {server.address} exited with code {server.proc.returncode} "
                    f"during start-up; the end of {server.log_path}:\n{server.log_tail()}")
            try:
                with urllib.request.urlopen(server.address + "/health", timeout=2) as resp:
                    if _health_ok(resp.read()):
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

    def stop_server(self, index: int, timeout: float = 10.0) -> None:
        """Stop server `index` (and its children: vLLM runs its engine in a child process)."""
        _stop([self.servers[index]], timeout)

    def stop_all(self, timeout: float = 10.0) -> None:
        """SIGTERM every server, then SIGKILL what is left after `timeout` seconds."""
        _stop(self.servers, timeout)
        self.servers = []
        self._unpin_trainer()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the server's process group (each server leads its own session)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _stop(servers: list[ServerProcess], timeout: float) -> None:
    for server in servers:
        if server.proc.poll() is None:
            _signal_group(server.proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for server in servers:
        try:
            server.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(server.proc, signal.SIGKILL)
            server.proc.wait()
        _signal_group(server.proc, signal.SIGKILL)  # children the server left behind
