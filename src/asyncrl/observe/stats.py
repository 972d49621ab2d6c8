"""Stats sinks: a JSONL file (the record of a run), TensorBoard, and the optional
experiment trackers (W&B, SwanLab; `observe/trackers.py`)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from asyncrl.api import Trajectory
from asyncrl.config.schema import StatsLoggerConfig
from asyncrl.observe.trackers import open_trackers

# An evaluation set that mixes tasks (its items' "task") logs each task's stats under
# eval/task/<task>/<name>: reward, n, and the scores (pass@k, ...).
TASK_PREFIX = "eval/task/"


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every line stays parseable."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _scalars(stats: dict[str, Any], kind: str) -> dict[str, float]:
    """The finite numbers of `stats` under TensorBoard's and the trackers' names: `<kind>/<key>`,
    or `<key>` when it already starts with the kind (`eval/reward`, not `eval/eval/reward`)."""
    return {key if key.startswith(f"{kind}/") else f"{kind}/{key}": value
            for key, value in stats.items()
            if isinstance(value, (int, float)) and math.isfinite(value)}


def by_task(stats: dict[str, float]) -> dict[str, dict[str, float]]:
    """The per-task stats of a mixed evaluation set, {task: {"reward": ..., "n": ...}};
    empty when every item had one task."""
    out: dict[str, dict[str, float]] = {}
    for key, value in stats.items():
        if key.startswith(TASK_PREFIX):
            task, _, name = key[len(TASK_PREFIX):].rpartition("/")
            out.setdefault(task, {})[name] = value
    return out


class StatsLogger:
    """Writes one JSON line per step to <run>/stats.jsonl, scalars to <run>/tensorboard/ and
    to the trackers of `cfg.wandb` and `cfg.swanlab`.

    `run_config`: the run's resolved config (a dataclass), sent to the trackers once.
    `resume`: append to stats.jsonl and continue the W&B run of the interrupted one.
    """

    def __init__(self, run_dir: Path, cfg: StatsLoggerConfig, *, resume: bool = False,
                 run_config: Any = None) -> None:
        # First: a tracker whose library is missing fails before any file is touched.
        self._trackers = open_trackers(run_dir, cfg, run_config=run_config, resume=resume)
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
        scalars = _scalars(stats, kind)
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        for tracker in self._trackers:
            tracker.log(step, scalars)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close()


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
            if "reward_info" in t.meta:  # how the reward was computed (a JSON-ready dict)
                row["reward_info"] = t.meta["reward_info"]
            f.write(json.dumps(row) + "\n")
    return path
