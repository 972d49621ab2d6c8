"""Weight sync, first mode: versioned safetensors on disk, then tell every server.

The trainer writes `<run>/weights/v<N>/`, then each server is paused, reloads from that
folder, sets version N and resumes (the client does the per-server sequence, each step
under a timeout). A server that does not answer raises an error; nothing waits forever.
The folder is written as `v<N>.tmp` and renamed when whole, so no server is ever pointed at
a half-written version; a write that fails (a full or read-only disk) raises
`PublishError` before any server is touched, and they keep serving the previous version.

The folder of a version no server reads any more is kept as `spare/` and becomes the next
version's: its weights file is overwritten in place (models/safetensors_file.py), so each
step writes into pages the machine already holds instead of taking 270 MB (SmolLM2-135M,
bf16) of fresh ones. So a `v<N>` folder is the servers' hand-off, not a checkpoint: a
process outside the run that mapped its file (safetensors does) and still reads it
`keep_last` versions later sees the newer weights; copy a version out, or use the saver's
checkpoints, to keep one.

`publish` does both in turn. The two halves are also public: `save` (the trainer's part)
and `load` (a coroutine on the client's loop), so that the trainer can go on training
while the servers load (`actor.weight_update_overlap`, controller/rl.py).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import torch

from asyncrl.api import InferenceEngine, TrainEngine, faults

logger = logging.getLogger(__name__)


class PublishError(RuntimeError):
    """Writing a weight version failed; no server was asked to load it."""


class WeightPublisher:
    """Publishes the trainer's weights as version N and loads them on the inference servers."""

    def __init__(self, root: Path, engine: InferenceEngine, *, dtype: str = "bfloat16",
                 keep_last: int = 2,
                 run: Callable[[Coroutine], Any] = asyncio.run) -> None:
        self.root = Path(root)
        self.engine = engine
        self.dtype = dtype
        self.keep_last = keep_last
        self._run = run  # how to run the client's coroutines (e.g. on the rollout loop)

    def path(self, version: int) -> Path:
        return self.root / f"v{version}"

    @property
    def spare(self) -> Path:
        """A pruned version's folder, kept to be written over by the next save."""
        return self.root / "spare"

    def publish(self, actor: TrainEngine, version: int) -> dict[str, float]:
        """Save weights `version` and load them on every server; returns timings."""
        stats = self.save(actor, version)
        t0 = time.monotonic()
        self._run(self.load(version))
        return stats | {"perf/weights_load_s": time.monotonic() - t0}

    def save(self, actor: TrainEngine, version: int) -> dict[str, float]:
        """Write weights `version` whole under `path(version)`; PublishError if that failed."""
        t0 = time.monotonic()
        path = self.path(version)
        tmp = path.with_name(path.name + ".tmp")
        for leftover in (path, tmp):  # of a crashed run: written again
            shutil.rmtree(leftover, ignore_errors=True)
        try:
            if self.spare.is_dir():
                self.spare.rename(tmp)
            actor.save_hf(str(tmp), dtype=getattr(torch, self.dtype))
            faults.point("publish", version)
            tmp.rename(path)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise PublishError(f"writing weights v{version} to {tmp} failed ({e}); the "
                               f"servers keep serving v{version - 1}. Free space or make "
                               f"the run folder writable") from e
        # What the servers read: the full weights, or a LoRA run's adapters alone.
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        return {"perf/weights_save_s": time.monotonic() - t0, "perf/weights_mb": size / 2**20}

    async def load(self, version: int) -> None:
        """Every server loads the saved `version` (WeightUpdateError names any that failed);
        then versions older than `keep_last` are removed."""
        t0 = time.monotonic()
        await self.engine.update_weights_from_disk(str(self.path(version)), version)
        self._prune(version)
        logger.debug("servers hold weights v%d (load %.2fs)", version, time.monotonic() - t0)

    def close(self) -> None:
        """Nothing to release (the same interface as `BroadcastPublisher`)."""

    def _prune(self, current: int) -> None:
        """Versions older than `keep_last` go; one folder of them stays as the spare."""
        for old in self.root.glob("v*"):
            try:
                version = int(old.name[1:].removesuffix(".tmp"))
            except ValueError:
                continue
            if version <= current - self.keep_last:
                if old.suffix != ".tmp" and not self.spare.exists():
                    old.rename(self.spare)
                else:
                    shutil.rmtree(old, ignore_errors=True)
