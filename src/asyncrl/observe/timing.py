"""Per-step timing in one place: `with timer("train_s"): ...`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any


class StepTimer:
    """Seconds spent in named sections of one step, as `perf/<name>` stats.

    With a `timeline` (observe/timeline.py), each section is also a span of `lane`, of the
    kind `kinds` maps its name to (sections not in `kinds` are not drawn).
    """

    def __init__(self, timeline: Any = None, lane: str = "trainer",
                 kinds: dict[str, str] | None = None) -> None:
        self.start = time.monotonic()
        self.seconds: dict[str, float] = {}
        self.timeline, self.lane, self.kinds = timeline, lane, kinds or {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0, wall = time.monotonic(), time.time()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - t0
            if self.timeline is not None and name in self.kinds:
                self.timeline.add(self.lane, self.kinds[name], wall, time.time())

    def stats(self) -> dict[str, float]:
        total = time.monotonic() - self.start
        return {"perf/step_s": total, **{f"perf/{k}": v for k, v in self.seconds.items()}}
