"""`asyncrl ps | logs | stop`: a run's services, read from its <run_dir>/services.json."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

from asyncrl.launch.base import (
    SchedulerError,
    Worker,
    health_ok,
    log_tail,
    read_registry,
)


def status(worker: Worker) -> str:
    """healthy (its /health answers), running, exited, or unknown (on another machine)."""
    if health_ok(worker.address, "/health", timeout=1.0):
        return "healthy"
    if worker.hostname != socket.gethostname():
        return "unknown"
    return "running" if _alive(worker.pid) else "exited"


def ps(run_dir: Path) -> list[str]:
    """One line per registered worker."""
    registry = read_registry(run_dir)
    rows = [("ROLE", "INDEX", "ADDRESS", "PID", "NODE", "STATE", "LOG")]
    rows += [(w.role, str(w.index), w.address, str(w.pid), w.hostname or w.node_id[:12],
              status(w), w.log_path) for w in registry["workers"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = [f"scheduler: {registry['scheduler']}"]
    lines += ["  ".join(c.ljust(n) for c, n in zip(r, widths)) + "  " + r[-1] for r in rows]
    return lines


def log_paths(run_dir: Path, role: str, index: int | None = None) -> list[Path]:
    """The logs of `role` (of worker `index` alone when given), registered or left on disk."""
    run_dir = Path(run_dir)
    try:
        registered = [Path(w.log_path) for w in read_registry(run_dir)["workers"]
                      if w.role == role and index in (None, w.index)]
    except SchedulerError:  # no registry: the logs a finished run left
        registered = []
    on_disk = {_index(p.stem, role): p for p in (run_dir / "logs").glob(f"{role}-*.log")}
    on_disk = {i: p for i, p in on_disk.items() if i >= 0 and index in (None, i)}
    return list(dict.fromkeys([*registered, *(on_disk[i] for i in sorted(on_disk))]))


def logs(run_dir: Path, role: str, index: int | None = None, n: int = 50) -> list[str]:
    """The last `n` lines of each log, each under a header naming it."""
    out: list[str] = []
    for path in log_paths(run_dir, role, index):
        out += [f"==> {path} <==", log_tail(path, n)]
    return out


def stop(run_dir: Path) -> list[str]:
    """Stop the run's workers as far as this machine can; say what was and was not stopped."""
    registry = read_registry(run_dir)
    if registry["scheduler"] == "slurm":
        jobs = sorted({j for js in registry.get("jobs", {}).values() for j in js}
                      | {w.job_id for w in registry["workers"] if w.job_id})
        if not jobs:
            return ["no Slurm jobs recorded"]
        done = subprocess.run(["scancel", *jobs], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            return [f"scancel {' '.join(jobs)} failed: {done.stderr.strip()}"]
        return [f"cancelled Slurm job {job}" for job in jobs]
    here = socket.gethostname()
    lines = []
    for w in registry["workers"]:
        name = f"{w.role} {w.index} (pid {w.pid})"
        if w.hostname != here:
            lines.append(f"not stopped: {name} runs on {w.hostname or w.node_id}; stop the "
                         f"process that started it (its Ray driver), or `ray stop` there")
        elif not _alive(w.pid):
            lines.append(f"already gone: {name}")
        elif os.getpgid(w.pid) != w.pid:
            # Workers lead their own process group; a pid that does not was reused.
            lines.append(f"not stopped: pid {w.pid} is no longer {w.role} {w.index}")
        else:
            os.killpg(w.pid, signal.SIGTERM)
            lines.append(f"stopped: {name}")
    return lines or ["no workers recorded"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _index(stem: str, role: str) -> int:
    """The worker index of a log named <role>-<index> (-1 for another file, e.g. sbatch's)."""
    tail = stem[len(role) + 1:]
    return int(tail) if tail.isdigit() else -1
