"""Where a run writes: <fileroot>/<experiment_name>/<trial_name>/."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from asyncrl.models.hub import cache_dir


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @classmethod
    def from_names(cls, root: str, experiment_name: str, trial_name: str) -> RunPaths:
        """<root>/<experiment_name>/<trial_name>/ (made if missing); `root` as `fileroot`."""
        run = fileroot(root) / experiment_name / trial_name
        run.mkdir(parents=True, exist_ok=True)
        return cls(run)

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

    def spec(self, role: str) -> Path:
        """The spec file the controller writes for the processes of `role` (specs/<role>.json)."""
        return self.root / "specs" / f"{role}.json"


def fileroot(root: str) -> Path:
    """The folder of all runs' folders: `root` (cluster.fileroot), else the user cache's,
    resolved."""
    path = Path(root) if root else cache_dir() / "experiments"
    return path.expanduser().resolve()


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
