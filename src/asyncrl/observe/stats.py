"""Stats sinks: a JSONL file (the record of a run) and TensorBoard."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from asyncrl.api import Trajectory
from asyncrl.config.schema import StatsLoggerConfig


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every line stays parseable."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class StatsLogger:
    """Writes one JSON line per step to <run>/stats.jsonl and scalars to <run>/tensorboard/."""

    def __init__(self, run_dir: Path, cfg: StatsLoggerConfig, *, resume: bool = False) -> None:
        self.path = run_dir / "stats.jsonl"
        self._jsonl = None
        if cfg.jsonl:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.path, "a" if resume else "w")
        self._tb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, stats: dict[str, float], *, kind: str = "train") -> None:
        """Record `stats` of training step `step`; `kind` separates train and eval rows."""
        if self._jsonl is not None:
            row = {"step": step, "kind": kind, "time": time.time()}
            row.update({k: _finite(v) for k, v in stats.items()})
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in stats.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_stats(path: Path) -> list[dict[str, Any]]:
    """The rows of a stats.jsonl file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_samples(path: Path, trajectories: list[Trajectory]) -> Path:
    """One JSON line per trajectory: what the model wrote, the gold answer, the reward."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for t in trajectories:
            row = {"reward": t.reward, "stop_reason": t.stop_reason.value,
                   "output_tokens": t.n_output_tokens,
                   **{k: v for k, v in t.meta.items() if isinstance(v, (str, int, float, bool))}}
            f.write(json.dumps(row) + "\n")
    return path
