"""Weight sync, first mode: versioned safetensors on disk, then tell every server.

The trainer writes `<run>/weights/v<N>/`, then each server is paused, reloads from that
folder, sets version N and resumes (the client does the per-server sequence, each step
under a timeout). A server that does not answer raises an error; nothing waits forever.
The folder is written as `v<N>.tmp` and renamed when whole, so no server is ever pointed at
a half-written version; a write that fails (a full or read-only disk) raises
`PublishError` before any server is touched, and they keep serving the previous version.

`publish` does both in turn. The two halves are also public: `save` (the trainer's part)
and `load` (a coroutine on the client's loop), so that the trainer can go on training
while the servers load (`actor.weight_update_overlap`, trainers/rl.py). There the write
moves off the trainer's path too: `snapshot` takes the weights in the publish dtype (a
copy: the next optimiser step may start at once) and returns the writer, which the load's
coroutine runs in a thread before the load. On the quickstart the write was ~0.7 s of a
2.8 s step, mostly the kernel throttling 270 MB of dirty pages per step; the copy takes
~0.1 s. The config and tokenizer files do not change between versions: the first version
is written whole by the trainer's `save_hf`, later ones reuse its small files.
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
from safetensors.torch import save_file

from asyncrl.api import InferenceEngine, TrainEngine, faults
from asyncrl.training.checkpoint import WEIGHTS_FILE

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
        self._small_files: dict[str, bytes] | None = None  # a whole version's other files

    def path(self, version: int) -> Path:
        return self.root / f"v{version}"

    def publish(self, actor: TrainEngine, version: int) -> dict[str, float]:
        """Save weights `version` and load them on every server; returns timings."""
        stats = self.save(actor, version)
        t0 = time.monotonic()
        self._run(self.load(version))
        return stats | {"perf/weights_load_s": time.monotonic() - t0}

    def save(self, actor: TrainEngine, version: int) -> dict[str, float]:
        """Write weights `version` whole under `path(version)`; PublishError if that failed."""
        t0 = time.monotonic()
        self._write(version, lambda tmp: actor.save_hf(str(tmp), dtype=getattr(torch, self.dtype)))
        return {"perf/weights_save_s": time.monotonic() - t0}

    def _write(self, version: int, fill: Callable[[Path], Any]) -> None:
        """`fill` writes the folder `v<N>.tmp`, renamed `v<N>` when whole; PublishError if
        that failed (the servers are not told, and keep the previous version)."""
        path = self.path(version)
        tmp = path.with_name(path.name + ".tmp")
        for leftover in (path, tmp):  # of a crashed run: written again
            shutil.rmtree(leftover, ignore_errors=True)
        try:
            fill(tmp)
            faults.point("publish", version)
            tmp.rename(path)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise PublishError(f"writing weights v{version} to {tmp} failed ({e}); the "
                               f"servers keep serving v{version - 1}. Free space or make "
                               f"the run folder writable") from e

    def snapshot(self, actor: TrainEngine, version: int) -> Callable[[], dict[str, float]]:
        """Take weights `version` from `actor` now; returns the writer that puts them under
        `path(version)` (PublishError if that fails) and its timing, to run in another
        thread while the trainer goes on. Without a version written whole before, or for a
        trainer that cannot hand out its weights (`hf_state_dict`), this saves in full here
        and the writer has nothing left to do."""
        if self._small_files is None or not hasattr(actor, "hf_state_dict"):
            self.save(actor, version)
            self._small_files = {f.name: f.read_bytes() for f in self.path(version).iterdir()
                                 if f.is_file() and f.name != WEIGHTS_FILE}
            return dict
        weights = actor.hf_state_dict(getattr(torch, self.dtype))
        small = self._small_files

        def fill(tmp: Path) -> None:
            tmp.mkdir(parents=True)
            for name, data in small.items():
                (tmp / name).write_bytes(data)
            save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})

        def write() -> dict[str, float]:
            start = time.monotonic()
            self._write(version, fill)
            return {"perf/weights_write_s": time.monotonic() - start}

        return write

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
        for old in self.root.glob("v*"):
            try:
                version = int(old.name[1:].removesuffix(".tmp"))
            except ValueError:
                continue
            if version <= current - self.keep_last:
                shutil.rmtree(old, ignore_errors=True)
