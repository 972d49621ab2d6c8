"""Splitting a padded batch: rows to data-parallel ranks, then rows to micro-batches.

Every rank receives the same full batch and computes the same splits, so the ranks agree
on the number of micro-batches without talking to each other (FSDP's collectives need
every rank to run the same number of forward/backward passes).
"""

from __future__ import annotations

import dataclasses

import torch

from asyncrl.api.types import TensorBatch


def split_by_token_budget(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row groups whose padded size (rows * longest row) fits `max_tokens`.

    Rows are sorted longest first, so rows of similar length share a micro-batch and
    little padding is wasted; a row longer than the budget gets a micro-batch of its own.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        # Sorted longest first: the first row of the open group sets its padded width.
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def split_across_ranks(lengths: list[int], world_size: int) -> list[list[int]]:
    """Rows per rank, balancing tokens: each row (longest first) goes to the lightest rank."""
    if len(lengths) < world_size:
        raise ValueError(f"a batch of {len(lengths)} rows cannot be split over {world_size} ranks")
    loads = [0] * world_size
    parts: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], len(parts[r]), r))
        parts[rank].append(i)
        loads[rank] += lengths[i]
    return [sorted(p) for p in parts]


def plan_micro_batches(lengths: list[int], max_tokens: int,
                       world_size: int) -> list[list[list[int]]]:
    """For each rank, its micro-batches as lists of row indices into the full batch.

    Ranks with fewer micro-batches than the busiest one are not padded here; the engine
    repeats one of their micro-batches with zero weight (see `FSDPTrainEngine`).
    """
    plans = []
    for rows in split_across_ranks(lengths, world_size):
        groups = split_by_token_budget([lengths[i] for i in rows], max_tokens)
        plans.append([[rows[j] for j in g] for g in groups])
    return plans


def to_device(batch: TensorBatch, device: torch.device) -> TensorBatch:
    """The same batch with every tensor on `device`."""
    moved = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return TensorBatch(**{k: v.to(device) if v is not None else None for k, v in moved.items()})


def split_minibatches(batch: TensorBatch, n: int) -> list[TensorBatch]:
    """`n` minibatches of consecutive rows (groups stay together when B is a multiple)."""
    rows = len(batch)
    bounds = [round(i * rows / n) for i in range(n + 1)]
    return [batch.select(list(range(a, b))) for a, b in zip(bounds, bounds[1:]) if b > a]
