"""Exact resume: the whole asynchronous state, written atomically.

A recover checkpoint holds the model, optimiser and scheduler (the train engines' state:
the actor's, and the critic's when there is one),
the rollout state (staleness counters, data position, finished episodes not yet trained on
and the items of episodes in flight, which are run again), and the trainer's counters.
It is written to `<root>.tmp`, marked complete, and renamed to `<root>` (the previous one
moved aside to `<root>.old` for the moment of the swap). A process killed at any point leaves
at least one complete checkpoint among the three folders; loading takes the complete one of
the highest step, so a torn write is never read and the previous checkpoint stands in. A
write that fails (a full or read-only disk) raises `CheckpointError` naming the folder and
the checkpoint that is kept.
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

from asyncrl.api import faults
from asyncrl.controller.rollout import RolloutController

_DONE = "COMPLETE"


class StatefulTrainer(Protocol):
    def save_state(self, path: str) -> None: ...

    def load_state(self, path: str) -> None: ...


class CheckpointError(RuntimeError):
    """Writing a recover checkpoint failed; the previous complete one is untouched."""


def _folders(root: Path) -> list[Path]:
    return [root, root.with_name(root.name + ".tmp"), root.with_name(root.name + ".old")]


def _step(folder: Path) -> int:
    try:
        return int(json.loads((folder / "trainer.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint of the highest step among `root` and its in-flight siblings."""
    done = [f for f in _folders(Path(root)) if (f / _DONE).exists()]
    return max(done, key=_step) if done else None  # max: the first of a tie, `root` first


def has_checkpoint(root: Path) -> bool:
    return latest_checkpoint(root) is not None


def checkpoint_step(root: Path) -> int | None:
    """The step of the checkpoint `load_checkpoint` would restore, or None."""
    found = latest_checkpoint(root)
    return None if found is None else _step(found)


def drop_records_after(step: int, *files: Path) -> dict[str, int]:
    """Keep the rows of JSON-lines `files` up to `step`: a run killed after its last
    checkpoint logged steps that the resumed run trains again, and a kill can tear the
    last line. Returns the rows dropped per file name."""
    dropped = {}
    for path in files:
        if not path.exists():
            continue
        kept, n = [], 0
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                keep = int(row["step"]) <= step
            except (ValueError, KeyError, TypeError):
                keep = False  # torn by the kill, or not a row of ours
            if keep:
                kept.append(line + "\n")
            else:
                n += 1
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
        dropped[path.name] = n
    return dropped


def save_checkpoint(root: Path, *, trainer: StatefulTrainer, rollout: RolloutController,
                    trainer_state: dict[str, Any]) -> None:
    """Write a complete checkpoint to `root` (replacing the previous one).

    `trainer` (every rank, in process or through the training service) writes its engines'
    state under `root`; the controller adds the rollout state, its RNG and counters.
    """
    root = Path(root)
    _, tmp, old = _folders(root)
    latest = latest_checkpoint(root)
    if latest is not None and latest != root:
        # A swap was cut short: make the newest complete checkpoint `root` first, so that
        # clearing the siblings below never removes the only complete one.
        shutil.rmtree(root, ignore_errors=True)
        os.replace(latest, root)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        trainer.save_state(str(tmp))
        faults.point("checkpoint", int(trainer_state.get("step", -1)))
        with open(tmp / "rollout.pkl", "wb") as f:
            pickle.dump(rollout.state_dict(), f)
        rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
        with open(tmp / "rng.pkl", "wb") as f:
            pickle.dump(rng, f)
        (tmp / "trainer.json").write_text(json.dumps(trainer_state, indent=2))
        (tmp / _DONE).write_text("")
    except Exception as e:  # a full disk, a read-only folder, a training service's error
        shutil.rmtree(tmp, ignore_errors=True)
        kept = f"step {_step(root)} in {root}" if has_checkpoint(root) else "none"
        raise CheckpointError(f"writing the recover checkpoint to {tmp} failed ({e}); the "
                              f"previous checkpoint is kept: {kept}. Free space or make "
                              f"the run folder writable, then resume with "
                              f"recover.mode=auto") from e
    shutil.rmtree(old, ignore_errors=True)
    if root.exists():
        os.replace(root, old)
    os.replace(tmp, root)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(root: Path, *, trainer: StatefulTrainer,
                    rollout: RolloutController) -> dict[str, Any]:
    """Restore the trainer's engines and `rollout` from the latest complete checkpoint at
    `root` (see `latest_checkpoint`); returns the trainer's counters."""
    found = latest_checkpoint(root)
    if found is None:
        raise FileNotFoundError(f"no complete recover checkpoint in {root}")
    root = found
    trainer.load_state(str(root))
    with open(root / "rollout.pkl", "rb") as f:
        rollout.load_state_dict(pickle.load(f))
    with open(root / "rng.pkl", "rb") as f:
        rng = pickle.load(f)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    return json.loads((root / "trainer.json").read_text())
