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
from typing import Any

import torch

from asyncrl.api import TrainEngine
from asyncrl.rollout import RolloutController

_DONE = "COMPLETE"


def has_checkpoint(root: Path) -> bool:
    return (Path(root) / _DONE).exists()


def save_checkpoint(root: Path, *, actor: TrainEngine, rollout: RolloutController,
                    trainer_state: dict[str, Any], critic: TrainEngine | None = None) -> None:
    """Write a complete checkpoint to `root` (replacing the previous one)."""
    root = Path(root)
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    actor.save_state(str(tmp / "actor"))
    if critic is not None:
        critic.save_state(str(tmp / "critic"))
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


def load_checkpoint(root: Path, *, actor: TrainEngine, rollout: RolloutController,
                    critic: TrainEngine | None = None) -> dict[str, Any]:
    """Restore `actor`, `critic` and `rollout` from `root`; returns the trainer's counters."""
    root = Path(root)
    if not has_checkpoint(root):
        raise FileNotFoundError(f"no complete recover checkpoint in {root}")
    if critic is not None and not (root / "critic").is_dir():
        raise FileNotFoundError(f"the recover checkpoint in {root} has no critic state (it was "
                                "written by a run without `critic`); start a fresh trial or "
                                "drop the critic section")
    actor.load_state(str(root / "actor"))
    if critic is not None:
        critic.load_state(str(root / "critic"))
    with open(root / "rollout.pkl", "rb") as f:
        rollout.load_state_dict(pickle.load(f))
    with open(root / "rng.pkl", "rb") as f:
        rng = pickle.load(f)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    return json.loads((root / "trainer.json").read_text())
