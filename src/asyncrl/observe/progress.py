"""A live progress bar: step, reward, staleness, tokens/s (or a trainer's own figures)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tqdm import tqdm


class ProgressBar:
    """tqdm over training steps (or `unit`s); shows the figures a user watches during a run.

    `fields`: the stat keys to show (offline trainers, evaluation); None shows RL's reward,
    staleness and throughput.
    """

    def __init__(self, total: int, initial: int = 0, enabled: bool = True,
                 fields: Sequence[str] | None = None, desc: str = "train",
                 unit: str = "step") -> None:
        self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit,
                         dynamic_ncols=True, disable=not enabled, file=sys.stderr)
        self._fields = fields

    def update(self, stats: dict[str, float]) -> None:
        if self._fields is not None:
            text = " ".join(f"{key.rsplit('/', 1)[-1]}={stats.get(key, float('nan')):.4g}"
                            for key in self._fields)
        else:
            text = (f"reward={stats.get('rollout/reward', float('nan')):.3f} "
                    f"stale={stats.get('rollout/staleness_mean', 0.0):.2f} "
                    f"tok/s={stats.get('perf/trained_tokens_per_s', 0.0):.0f}")
        self._bar.set_postfix_str(text, refresh=False)
        self._bar.update(1)

    def write(self, message: str) -> None:
        self._bar.write(message)

    def close(self) -> None:
        self._bar.close()
