"""The `Scheduler` protocol: start N copies of one command, find them, watch and stop them.

A `WorkerSpec` says what to run (argv with "{host}"/"{port}" placeholders, resources, rank
variables); a scheduler (local subprocesses, Ray actors, Slurm jobs) decides where, picks
each worker's port on its node, waits for its /health and records it in
<run_dir>/services.json, which `asyncrl ps | logs | stop` read.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

REGISTRY = "services.json"
PLACEHOLDERS = ("host", "port", "index", "cpus", "cores")


class SchedulerError(RuntimeError):
    """A process could not be started or did not become healthy."""


class WorkerDiedError(SchedulerError):
    """A worker died again the way it died before: restarting it would not help."""


@dataclass
class WorkerSpec:
    """`count` copies of one command, each bound to the host and port its scheduler picks.

    In `command`, `env` values and `worker_args`, "{host}", "{port}", "{index}", "{cpus}" and
    "{cores}" (comma-separated core ids the worker may use) are replaced per worker.
    """

    role: str  # "inference", "trainer", "agent", ...
    count: int
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the node's environment
    # Cores per worker, also its OMP_NUM_THREADS (local: an affinity set of that size, 0: not
    # pinned; ray: num_cpus; slurm: --cpus-per-task).
    cpus: int = 1
    gpus: int = 0  # GPUs per worker; CUDA_VISIBLE_DEVICES names them
    memory_gb: float = 0  # per worker (ray: its memory resource; slurm: --mem, per node)
    # RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun sets
    # them; MASTER_ADDR is rank 0's node and MASTER_PORT free there.
    torch_distributed: bool = False
    health_path: str | None = "/health"  # polled until 200; None: the process living is enough
    worker_args: list[list[str]] | None = None  # appended to worker i's argv (e.g. its seed)
    cores: list[list[int]] | None = None  # local only: affinity per worker ([] : unpinned)
    # local only: the cores every worker may run on when it shares cores on demand
    # (api/cores.py); `cores` then still sets its own (home) thread count.
    affinity: list[int] | None = None
    gpu_ids: list[list[int]] | None = None  # local only: GPUs per worker (overrides gpus)
    # A fixed port for every worker (a service whose clients are told its address in
    # advance, e.g. agent.port); None: a free port the scheduler picks. Taken: an error.
    port: int | None = None

    def __post_init__(self) -> None:
        if self.count < 1 or not self.command:
            raise ValueError(f"WorkerSpec {self.role!r}: count must be >= 1 and command "
                             f"non-empty (got count={self.count}, command={self.command})")
        for name in ("worker_args", "cores", "gpu_ids"):
            per = getattr(self, name)
            if per is not None and len(per) != self.count:
                raise ValueError(f"WorkerSpec {self.role!r}: {name} has {len(per)} entries "
                                 f"for count={self.count} workers")

    def pick_port(self, host: str) -> int:
        """The fixed port if it is free on `host`, else a free one when none is fixed."""
        if self.port is None:
            return free_port(host)
        if not port_is_free(host, self.port):
            raise SchedulerError(f"role {self.role!r} asks for port {self.port} on {host}, "
                                 "which is taken; free it or choose another port")
        return self.port

    def argv(self, index: int, values: dict[str, str]) -> list[str]:
        """Worker `index`'s argv with its placeholders filled."""
        extra = self.worker_args[index] if self.worker_args else []
        return [fill(a, values) for a in [*self.command, *extra]]

    def environment(self, values: dict[str, str]) -> dict[str, str]:
        """The spec's env with placeholders filled (to add to the node's environment)."""
        return {k: fill(v, values) for k, v in self.env.items()}


@dataclass
class Worker:
    """Where one started worker lives."""

    role: str
    index: int
    host: str
    port: int
    address: str  # http://host:port
    node_id: str
    pid: int
    log_path: str
    hostname: str = ""  # the machine the pid belongs to (`asyncrl stop` signals only its own)
    job_id: str = ""  # slurm: the job that runs it


class Scheduler(Protocol):
    """Starts workers from specs; every method is keyed by role."""

    def create_workers(self, spec: WorkerSpec) -> list[Worker]:
        """Start `spec.count` workers; return them once all are healthy."""
        ...

    def get_workers(self, role: str) -> list[Worker]:
        """The workers of `role`, by index."""
        ...

    def check_health(self, role: str) -> list[bool]:
        """Per worker: its process lives and its health path answers 200."""
        ...

    def restart_worker(self, role: str, index: int) -> Worker:
        """Start worker `index` again with the same command and env (maybe on a new port)."""
        ...

    def delete_workers(self, role: str | None = None) -> None:
        """Stop the workers of `role` (None: all): SIGTERM, then SIGKILL."""
        ...

    def close(self) -> None:
        """Stop everything this scheduler started."""
        ...

    def __enter__(self) -> Scheduler: ...

    def __exit__(self, *exc: object) -> None: ...


def fill(text: str, values: dict[str, str]) -> str:
    """Replace "{name}" for each name in `values` (other braces are left alone)."""
    for name, value in values.items():
        text = text.replace("{" + name + "}", value)
    return text


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the worker binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    """Nothing listens on `port` (connections in TIME_WAIT do not count, as for servers)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def torch_env(rank: int, node_ids: Sequence[str], master_addr: str,
              master_port: int) -> dict[str, str]:
    """torchrun's variables for `rank` of a world whose ranks run on `node_ids`."""
    mine = [r for r, node in enumerate(node_ids) if node == node_ids[rank]]
    return {"RANK": str(rank), "WORLD_SIZE": str(len(node_ids)),
            "LOCAL_RANK": str(mine.index(rank)), "LOCAL_WORLD_SIZE": str(len(mine)),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


def health_ok(address: str, path: str, timeout: float = 2.0) -> bool:
    """GET address+path answers 200 (ours says {"status": "ok"}; vLLM/SGLang an empty 200)."""
    try:
        with urllib.request.urlopen(address + path, timeout=timeout) as resp:
            body = resp.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError, OSError):
        return False
    try:
        parsed = json.loads(body) if body.strip() else {}
    except ValueError:
        return True
    return not isinstance(parsed, dict) or parsed.get("status", "ok") == "ok"


def wait_healthy(workers: Sequence[Worker], *, health_path: str | None, timeout: float,
                 exited: Callable[[Worker], str | None], tail: Callable[[Worker], str],
                 interval: float = 0.5) -> None:
    """Wait until every worker answers its health path; raise, with the log's tail, if one
    exits first or `timeout` seconds pass. `exited` says why a worker is gone, else None."""
    pending = list(workers)
    deadline = time.monotonic() + timeout
    while pending:
        for w in list(pending):
            why = exited(w)
            if why is not None:
                raise SchedulerError(f"{w.role} {w.index} ({w.address}) {why} during start-up; "
                                     f"the end of {w.log_path}:\n{tail(w)}")
            if health_path is None or health_ok(w.address, health_path):
                pending.remove(w)
        if not pending:
            return
        if time.monotonic() > deadline:
            w = pending[0]
            raise SchedulerError(f"{w.role} {w.index} ({w.address}) was not healthy within "
                                 f"scheduler.startup_timeout={timeout} s; the end of "
                                 f"{w.log_path}:\n{tail(w)}")
        time.sleep(interval)


# "RuntimeError: CPU Generator does not use offset", also behind a logger's prefix
_EXCEPTION_LINE = re.compile(r"\b(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception): \S.*")


def cause_line(path: str | Path, start: int = 0) -> str | None:
    """The first exception line ("SomeError: message") a process wrote to its log from byte
    `start` on: where its failure began. Later ones are mostly consequences (vLLM's
    EngineDeadError after its worker's error); warnings are skipped. None if there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        match = _EXCEPTION_LINE.search(line)
        if match is not None and "WARNING" not in line[:match.start()]:
            return match.group(0).strip()
    return None


def log_size(path: str | Path) -> int:
    """Bytes in a log so far (0 if it does not exist): where a restarted process's part begins."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def log_tail(path: str | Path, n: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def write_registry(run_dir: Path, scheduler: str, workers: Sequence[Worker],
                   **extra: Any) -> Path:
    """Write <run_dir>/services.json atomically (readers never see half a file)."""
    path = Path(run_dir) / REGISTRY
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"scheduler": scheduler, "updated": time.time(),
            "workers": [asdict(w) for w in sorted(workers, key=lambda w: (w.role, w.index))],
            **extra}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path


def read_registry(run_dir: Path) -> dict[str, Any]:
    """The registry of the run in `run_dir` (workers as `Worker`s)."""
    path = Path(run_dir) / REGISTRY
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SchedulerError(f"no {REGISTRY} in {run_dir}: is it a run directory whose "
                             f"services were started by a scheduler?") from None
    data["workers"] = [Worker(**w) for w in data.get("workers", [])]
    return data
