"""Fault points: `ASYNCRL_FAULT=<point>@<step>` makes a process SIGKILL itself there.

The kill -9 tests and the soak benchmark use them to stop a trainer at a chosen point of a
chosen step, which timing alone cannot hit reliably:

- `generate`: the trainer starts waiting for the step's batch (its episodes in flight);
- `train`: mid-step, after the first micro-batch's backward, before the optimiser step;
- `publish`: the step's weights written to their temporary folder, not yet renamed or loaded;
- `checkpoint`: the step's recover checkpoint half-written (engine state, no marker).

Unset, a point costs one environment lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "ASYNCRL_FAULT"
POINTS = ("generate", "train", "publish", "checkpoint")


def parse(spec: str) -> tuple[str, int]:
    """`<point>@<step>` -> (point, step); a clear error for anything else."""
    name, sep, step = spec.partition("@")
    if name not in POINTS or not sep or not step.isdigit():
        raise ValueError(f"{ENV}={spec!r}: expected <point>@<step> with point one of "
                         f"{', '.join(POINTS)}, e.g. train@3")
    return name, int(step)


def point(name: str, step: int) -> None:
    """SIGKILL this process if `ASYNCRL_FAULT` names this point and step."""
    spec = os.environ.get(ENV)
    if spec and parse(spec) == (name, step):
        os.kill(os.getpid(), signal.SIGKILL)
