"""Recover checkpoints and weight versions under a kill at any point and under a full disk.

A kill is simulated by raising a BaseException (which no `except Exception` catches, as a
SIGKILL runs no handler) at each file-system step of a save in turn. A full disk is real:
the soft RLIMIT_FSIZE makes the kernel fail writes past a size (EFBIG), as ENOSPC would.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch

from asyncrl.controller import recover
from asyncrl.weights import PublishError, WeightPublisher


class Killed(BaseException):
    pass


class FakeTrainer:
    """Engine state: one tensor whose value is the step (large enough to tear mid-write)."""

    def __init__(self, numel: int = 1000) -> None:
        self.weights = torch.zeros(numel)

    def save_state(self, path: str) -> None:
        torch.save(self.weights, os.path.join(path, "engine.pt"))

    def load_state(self, path: str) -> None:
        self.weights = torch.load(os.path.join(path, "engine.pt"))


class FakeRollout:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def save(root: Path, step: int, trainer: FakeTrainer | None = None) -> None:
    trainer = trainer or FakeTrainer()
    trainer.weights.fill_(step)
    rollout = FakeRollout()
    rollout.position = 10 * step
    recover.save_checkpoint(root, trainer=trainer, rollout=rollout,
                            trainer_state={"step": step})


def load(root: Path) -> tuple[int, float, int]:
    """(step, the engine's value, the data position): all three agree in a whole checkpoint."""
    trainer, rollout = FakeTrainer(), FakeRollout()
    state = recover.load_checkpoint(root, trainer=trainer, rollout=rollout)
    return state["step"], float(trainer.weights[0]), rollout.position


STEPS = [(recover.os, "replace"), (recover.shutil, "rmtree"), (recover.pickle, "dump"),
         (pathlib.Path, "write_text"), (pathlib.Path, "mkdir"), (FakeTrainer, "save_state")]


@contextlib.contextmanager
def killed_at(n: int, monkeypatch: pytest.MonkeyPatch):
    """Raise Killed at the n-th file-system step (counting from 0); yields the count."""
    count = [0]
    for owner, name in STEPS:
        real = getattr(owner, name)

        def step(*args, _real=real, **kwargs):
            count[0] += 1
            if count[0] - 1 == n:
                raise Killed
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, step)
    yield count
    monkeypatch.undo()


def test_a_kill_at_any_point_of_a_save_leaves_a_whole_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "recover"
    outcomes = []
    n = 0
    while True:
        shutil.rmtree(tmp_path)
        tmp_path.mkdir()
        save(root, 1)
        with killed_at(n, monkeypatch) as count:
            try:
                save(root, 2)
                finished = True
            except Killed:
                finished = False
        assert recover.has_checkpoint(root)
        step, value, position = load(root)
        assert (value, position) == (step, 10 * step)  # never a mix of two checkpoints
        outcomes.append((step, root.exists()))
        # The run goes on: the next save lands and leaves no sibling folders behind.
        save(root, 3)
        assert load(root) == (3, 3.0, 30)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["recover"]
        if finished:
            break
        n += 1
    assert count[0] == n  # the last run passed every step without a kill
    steps = [step for step, _ in outcomes]
    assert steps[0] == 1 and steps[-1] == 2 and set(steps) == {1, 2}
    # Some kills fell between moving the old checkpoint aside and moving the new one in:
    # `recover` itself was missing, and a sibling was loaded.
    assert any(not exists for _, exists in outcomes)


def test_a_torn_newer_write_is_ignored_and_the_previous_checkpoint_used(tmp_path):
    root = tmp_path / "recover"
    save(root, 4)
    torn = root.with_name("recover.tmp")  # a kill mid-write: no COMPLETE marker
    torn.mkdir()
    (torn / "trainer.json").write_text('{"step": 5}')
    (torn / "engine.pt").write_bytes(b"\x80\x02half")
    assert load(root) == (4, 4.0, 40)


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Writes past `nbytes` per file fail with EFBIG (SIGXFSZ ignored) in this process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_full_disk_fails_the_save_clearly_and_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "recover"
    trainer = FakeTrainer(numel=1 << 20)  # 4 MiB of state
    save(root, 1, trainer)
    with file_size_limit(1 << 20), pytest.raises(recover.CheckpointError) as err:
        save(root, 2, trainer)
    message = str(err.value)
    assert "recover.tmp" in message and "step 1" in message and "recover.mode=auto" in message
    # torch.save reports the failed write as a RuntimeError, not an OSError: any is caught.
    assert err.value.__cause__ is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recover"]  # nothing half-written
    assert load(root) == (1, 1.0, 10)
    save(root, 2, trainer)  # space again: the next save lands
    assert load(root) == (2, 2.0, 20)


class RecordingEngine:
    def __init__(self) -> None:
        self.loaded: list[tuple[str, int]] = []

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        assert (Path(path) / "model.safetensors").stat().st_size == 4 << 20  # whole
        self.loaded.append((Path(path).name, version))


class BigSaver:
    def save_hf(self, path: str, dtype=None) -> None:
        from safetensors.torch import save_file

        os.makedirs(path)
        save_file({"w": torch.zeros(1 << 20)}, os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "model.safetensors"), "ab") as f:
            f.truncate(4 << 20)  # exactly 4 MiB, whatever the header's size


def test_a_full_disk_fails_a_publish_before_any_server_is_told(tmp_path):
    engine = RecordingEngine()
    publisher = WeightPublisher(tmp_path, engine)
    publisher.publish(BigSaver(), 1)
    with file_size_limit(1 << 20), pytest.raises(PublishError) as err:
        publisher.publish(BigSaver(), 2)
    assert "v2.tmp" in str(err.value) and "keep serving v1" in str(err.value)
    assert "File too large" in str(err.value)  # safetensors' own error, carried over
    assert engine.loaded == [("v1", 1)]  # v2 was never announced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]  # nothing half-written
    publisher.publish(BigSaver(), 2)
    assert engine.loaded == [("v1", 1), ("v2", 2)]
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
