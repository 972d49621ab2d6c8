"""Experiment trackers beside the JSONL file and TensorBoard: Weights & Biases and SwanLab.

Each library is optional and imported only when its `mode` is not `disabled`. Each tracker
gets the run's resolved config once (secrets masked), every scalar the StatsLogger logs
(under TensorBoard's names, `train/...` or `eval/...`, at the training step) and is
finished on close.

`offline` needs neither network nor account:

- wandb: `wandb.init(mode="offline", dir=<run>)` writes <run>/wandb/offline-run-*/;
  WANDB_MODE=offline and WANDB_ERROR_REPORTING=false are set before wandb is imported, so
  neither wandb nor its wandb-core process reports anything. `wandb sync` uploads it later.
  The run id is kept in <run>/wandb/run_id: a resumed run logs to the same id.
- swanlab: `swanlab.init(mode="offline", logdir=<run>/swanlab)` (SwanLab >= 0.6) writes
  backup files under <run>/swanlab/run-*/; `swanlab sync <that folder>` uploads them later.
  SwanLab 0.6 cannot resume a run: a resumed run starts a new experiment.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from asyncrl.config.loader import ConfigError
from asyncrl.config.schema import StatsLoggerConfig, SwanlabConfig, WandBConfig


class Tracker(Protocol):
    """What the StatsLogger asks of a tracker: a step's scalars, then one close."""

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What every tracker is told about the run."""

    run_dir: Path
    experiment_name: str
    trial_name: str
    config: dict[str, Any]
    resume: bool


def run_info(run_dir: Path, run_config: Any, *, resume: bool) -> RunInfo:
    """The run's names (the config's, else the folders of <fileroot>/<experiment>/<trial>/)
    and its config as plain JSON values, secrets masked."""
    if run_config is None:
        config: dict[str, Any] = {}
    elif dataclasses.is_dataclass(run_config):
        config = dataclasses.asdict(run_config)
    else:
        config = dict(run_config)
    config = _mask_secrets(json.loads(json.dumps(config, default=str)))
    return RunInfo(run_dir, config.get("experiment_name") or run_dir.parent.name,
                   config.get("trial_name") or run_dir.name, config, resume)


def _mask_secrets(node: Any) -> Any:
    """Keys such as api_key and admin_key are never sent to a tracker's server."""
    if isinstance(node, dict):
        return {k: "***" if str(k).endswith("_key") and v else _mask_secrets(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_mask_secrets(v) for v in node]
    return node


def _import(key: str, mode: str) -> ModuleType:
    """The library of stats_logger.<key>, or an error saying how to install it."""
    try:
        return importlib.import_module(key)
    except ImportError as err:
        raise ConfigError(f"stats_logger.{key}.mode={mode} needs the {key} package: "
                          "pip install 'asyncrl[track]'") from err


class WandbTracker:
    """One W&B run under <run>/wandb/."""

    def __init__(self, wandb: ModuleType, cfg: WandBConfig, run: RunInfo) -> None:
        id_file = run.run_dir / "wandb" / "run_id"
        run_id = id_file.read_text().strip() if run.resume and id_file.is_file() else None
        resumed = run_id is not None
        if run_id is None:
            run_id = uuid.uuid4().hex[:8] + (f"-{cfg.id_suffix}" if cfg.id_suffix else "")
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
        self._wandb = wandb
        self._run = wandb.init(
            mode=cfg.mode, entity=cfg.entity, project=cfg.project or run.experiment_name,
            name=cfg.name or run.trial_name, job_type=cfg.job_type, group=cfg.group,
            notes=cfg.notes, tags=list(cfg.tags) or None, config=run.config,
            dir=str(run.run_dir), id=run_id, resume="allow" if resumed else None)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        # Rows of one step (train, then eval) merge; wandb drops steps below its last one.
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()
        # finish() can return before wandb-core has written the run's file; teardown waits.
        self._wandb.teardown()


class SwanlabTracker:
    """One SwanLab experiment; offline under <run>/swanlab/ (or `logdir`)."""

    def __init__(self, swanlab: ModuleType, cfg: SwanlabConfig, run: RunInfo) -> None:
        if cfg.api_key and cfg.mode == "cloud":
            swanlab.login(api_key=cfg.api_key, save=False)
        self._swanlab = swanlab
        swanlab.init(project=cfg.project or run.experiment_name,
                     experiment_name=cfg.name or run.trial_name, config=run.config,
                     logdir=cfg.logdir or str(run.run_dir / "swanlab"), mode=cfg.mode)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._swanlab.log(scalars, step=step)

    def close(self) -> None:
        self._swanlab.finish()


def open_trackers(run_dir: Path, cfg: StatsLoggerConfig, *, run_config: Any = None,
                  resume: bool = False) -> list[Tracker]:
    """Start the trackers whose mode is not `disabled`; every library is imported before
    any run starts, so a missing one fails first and leaves nothing behind."""
    wanted = [(key, sub, factory) for key, sub, factory in (
        ("wandb", cfg.wandb, WandbTracker), ("swanlab", cfg.swanlab, SwanlabTracker))
        if sub.mode != "disabled"]
    if not wanted:
        return []
    if cfg.wandb.mode == "offline":  # read by wandb at import and by its wandb-core process
        os.environ["WANDB_MODE"] = "offline"
        os.environ["WANDB_ERROR_REPORTING"] = "false"
    modules = [_import(key, sub.mode) for key, sub, _ in wanted]
    run = run_info(run_dir, run_config, resume=resume)
    trackers: list[Tracker] = []
    try:
        for module, (_, sub, factory) in zip(modules, wanted, strict=True):
            trackers.append(factory(module, sub, run))
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    return trackers
