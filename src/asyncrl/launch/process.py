"""Start and stop one worker process on this node (used by `local` and by each Ray actor).

Each worker leads its own session, so stopping it signals its whole process group (vLLM
runs its engine in a child), and it gets SIGTERM when whoever started it dies
(PR_SET_PDEATHSIG): no worker outlives its scheduler.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the parent dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def spawn(argv: list[str], env: dict[str, str], log_path: str | Path,
          cores: Sequence[int] = ()) -> subprocess.Popen:
    """Start `argv` with `env` (the whole environment), output appended to `log_path`."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)

    def preexec() -> None:
        _die_with_parent()
        if cores:
            os.sched_setaffinity(0, cores)

    with open(log_path, "a") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=preexec, start_new_session=True)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def stop(procs: Sequence[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGTERM each process group, then SIGKILL what is left after `timeout` seconds."""
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        _signal_group(proc, signal.SIGKILL)  # children the worker left behind
