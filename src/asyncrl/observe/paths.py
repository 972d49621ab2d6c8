"""Where a run writes: <fileroot>/<experiment_name>/<trial_name>/."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from asyncrl.config import ExperimentConfig
from asyncrl.models.hub import cache_dir


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @classmethod
    def from_config(cls, cfg: ExperimentConfig) -> RunPaths:
        root = fileroot(cfg) / cfg.experiment_name / cfg.trial_name
        root.mkdir(parents=True, exist_ok=True)
        return cls(root)

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def recover(self) -> Path:
        return self.root / "recover"


def fileroot(cfg: ExperimentConfig) -> Path:
    """The folder of all runs' folders (cluster.fileroot, else the user cache's), resolved."""
    root = Path(cfg.cluster.fileroot) if cfg.cluster.fileroot else cache_dir() / "experiments"
    return root.expanduser().resolve()


def setup_logging(root: Path) -> None:
    """Everything to <run>/logs/trainer.log and the terminal."""
    (root / "logs").mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    file_handler = logging.FileHandler(root / "logs" / "trainer.log")
    file_handler.setFormatter(fmt)
    file_handler.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    console.setLevel(logging.INFO)
    pkg = logging.getLogger("asyncrl")
    pkg.setLevel(logging.INFO)
    for handler in list(pkg.handlers):
        pkg.removeHandler(handler)
    pkg.addHandler(file_handler)
    pkg.addHandler(console)
    pkg.propagate = False
