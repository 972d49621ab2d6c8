"""A live progress bar: step, reward, staleness, tokens/s."""

from __future__ import annotations

import sys

from tqdm import tqdm


class ProgressBar:
    """tqdm over training steps; shows the figures a user watches during a run."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True) -> None:
        self._bar = tqdm(total=total, initial=initial, desc="train", unit="step",
                         dynamic_ncols=True, disable=not enabled, file=sys.stderr)

    def update(self, stats: dict[str, float]) -> None:
        self._bar.set_postfix_str(
            f"reward={stats.get('rollout/reward', float('nan')):.3f} "
            f"stale={stats.get('rollout/staleness_mean', 0.0):.2f} "
            f"tok/s={stats.get('perf/trained_tokens_per_s', 0.0):.0f}",
            refresh=False,
        )
        self._bar.update(1)

    def write(self, message: str) -> None:
        self._bar.write(message)

    def close(self) -> None:
        self._bar.close()
