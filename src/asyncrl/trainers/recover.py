"""Exact resume: the whole asynchronous state, written atomically.

A recover checkpoint holds the model, optimiser and scheduler (the train engines' state:
the actor's, and the critic's when there is one),
the rollout state (staleness counters, data position, finished episodes not yet trained on
and the items of episodes in flight, which are run again), and the trainer's counters.
It is written to a temporary folder and renamed, so a crash mid-write leaves the last
complete checkpoint in place.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch

from asyncrl.rollout import RolloutController

_DONE = "COMPLETE"


class StatefulTrainer(Protocol):
    def save_state(self, path: str) -> None: ...

    def load_state(self, path: str) -> None: ...


def has_checkpoint(root: Path) -> bool:
    return (Path(root) / _DONE).exists()


def save_checkpoint(root: Path, *, trainer: StatefulTrainer, rollout: RolloutController,
                    trainer_state: dict[str, Any]) -> None:
    """Write a complete checkpoint to `root` (replacing the previous one).

    `trainer` (every rank, in process or through the training service) writes its engines'
    state under `root`; the controller adds the rollout state, its RNG and counters.
    """
    root = Path(root)
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    trainer.save_state(str(tmp))
    with open(tmp / "rollout.pkl", "wb") as f:
        pickle.dump(rollout.state_dict(), f)
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    with open(tmp / "rng.pkl", "wb") as f:
        pickle.dump(rng, f)
    (tmp / "trainer.json").write_text(json.dumps(trainer_state, indent=2))
    (tmp / _DONE).write_text("")
    old = root.with_name(root.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if root.exists():
        os.replace(root, old)
    os.replace(tmp, root)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(root: Path, *, trainer: StatefulTrainer,
                    rollout: RolloutController) -> dict[str, Any]:
    """Restore the trainer's engines and `rollout` from `root`; returns the trainer's counters."""
    root = Path(root)
    if not has_checkpoint(root):
        raise FileNotFoundError(f"no complete recover checkpoint in {root}")
    trainer.load_state(str(root))
    with open(root / "rollout.pkl", "rb") as f:
        rollout.load_state_dict(pickle.load(f))
    with open(root / "rng.pkl", "rb") as f:
        rng = pickle.load(f)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    return json.loads((root / "trainer.json").read_text())
