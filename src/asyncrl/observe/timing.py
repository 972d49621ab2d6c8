"""Per-step timing in one place: `with timer("train_s"): ...`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class StepTimer:
    """Seconds spent in named sections of one step, as `perf/<name>` stats."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - t0

    def stats(self) -> dict[str, float]:
        total = time.monotonic() - self.start
        return {"perf/step_s": total, **{f"perf/{k}": v for k, v in self.seconds.items()}}
