"""The optimiser steps of one training batch: ppo_epochs passes of ppo_n_minibatches steps.

Minibatches are consecutive rows, so a group (the samples of one prompt) stays in one
minibatch when the batch is a whole number of groups per minibatch. Every epoch takes the
same minibatches in the same order: no reshuffling, so a run is deterministic and each
minibatch keeps its loss normalisers (its own loss-token and sequence counts).
"""

from __future__ import annotations

from asyncrl.api.protocols import LossFn, TrainEngine
from asyncrl.api.types import TensorBatch

# Counts add up over the optimiser steps of a batch; every other stat is a per-step value.
SUMMED_STATS = ("n_mbs", "n_tokens", "n_seqs", "update_skipped", "rejected_tokens")


def split_minibatches(tb: TensorBatch, n: int) -> list[TensorBatch]:
    """`n` minibatches of consecutive rows (groups stay together when B is a multiple)."""
    rows = len(tb)
    bounds = [round(i * rows / n) for i in range(n + 1)]
    return [tb.select(list(range(a, b))) for a, b in zip(bounds, bounds[1:]) if b > a]


def train_epochs(engine: TrainEngine, tb: TensorBatch, loss_fn: LossFn, *, n_minibatches: int,
                 epochs: int) -> dict[str, float]:
    """Take `epochs` passes of one optimiser step per minibatch; the merged stats of all steps."""
    minibatches = split_minibatches(tb, n_minibatches)
    per_step = [engine.train_batch(mb, loss_fn) for _ in range(epochs) for mb in minibatches]
    return merge_update_stats(per_step)


def merge_update_stats(per_step: list[dict[str, float]]) -> dict[str, float]:
    """One value per stat over a batch's optimiser steps.

    `*_max` / `*_min`: max / min. Counts (SUMMED_STATS): sum. Everything else (loss,
    clip_frac, approx_kl, entropy, grad_norm, lr, ...): the mean over steps. `n_updates` is
    the number of steps.
    """
    if not per_step:
        raise ValueError("no optimiser step to report: the batch gave no minibatch")
    merged: dict[str, float] = {}
    for key in per_step[0]:
        values = [stats[key] for stats in per_step]
        if key.endswith("_max"):
            merged[key] = max(values)
        elif key.endswith("_min"):
            merged[key] = min(values)
        elif key in SUMMED_STATS:
            merged[key] = float(sum(values))
        else:
            merged[key] = sum(values) / len(values)
    merged["n_updates"] = float(len(per_step))
    return merged
