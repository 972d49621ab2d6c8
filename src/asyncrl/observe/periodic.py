"""When to save, checkpoint or evaluate: every N steps, epochs or seconds."""

from __future__ import annotations

import time
from typing import Any


class Periodic:
    """Due when any of `freq_steps`, `freq_epochs` (in steps) or `freq_secs` has elapsed."""

    def __init__(self, cfg: Any, steps_per_epoch: int, *, now: float | None = None) -> None:
        self.freq_steps = cfg.freq_steps
        self.freq_epoch_steps = cfg.freq_epochs * steps_per_epoch if cfg.freq_epochs else None
        self.freq_secs = cfg.freq_secs
        self._last_time = time.monotonic() if now is None else now

    @property
    def enabled(self) -> bool:
        return any(f is not None for f in (self.freq_steps, self.freq_epoch_steps, self.freq_secs))

    def due(self, step: int, now: float) -> bool:
        hit = any(f and step % f == 0 for f in (self.freq_steps, self.freq_epoch_steps))
        if self.freq_secs is not None and now - self._last_time >= self.freq_secs:
            hit = True
        if hit:
            self._last_time = now
        return hit
