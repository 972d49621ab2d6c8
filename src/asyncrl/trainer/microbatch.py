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


def plan_micro_batches(lengths: list[int], max_tokens: int, world_size: int,
                       granularity: int = 1) -> list[list[list[int]]]:
    """For each rank, its micro-batches as lists of row indices into the full batch.

    Rows `granularity * k ... granularity * (k + 1) - 1` form a unit that is never split
    across ranks or micro-batches, and keeps its order (DPO's chosen, rejected pairs).
    Ranks with fewer micro-batches than the busiest one are not padded here; the engine
    repeats one of their micro-batches with zero weight (see `FSDPTrainEngine`).
    """
    if granularity > 1:
        return _plan_units(lengths, max_tokens, world_size, granularity)
    plans = []
    for rows in split_across_ranks(lengths, world_size):
        groups = split_by_token_budget([lengths[i] for i in rows], max_tokens)
        plans.append([[rows[j] for j in g] for g in groups])
    return plans


def _plan_units(lengths: list[int], max_tokens: int, world_size: int,
                granularity: int) -> list[list[list[int]]]:
    """`plan_micro_batches` over units of `granularity` consecutive rows."""
    if len(lengths) % granularity:
        raise ValueError(f"a batch of {len(lengths)} rows is not a whole number of units of "
                         f"mb_spec.granularity={granularity} rows")
    units = [list(range(u, u + granularity)) for u in range(0, len(lengths), granularity)]
    widths = [max(lengths[i] for i in unit) for unit in units]
    plans = []
    for mine in split_across_ranks([sum(lengths[i] for i in u) for u in units], world_size):
        # k units of width w pad to k * granularity * w tokens: k * w <= max_tokens // g.
        groups = split_by_token_budget([widths[u] for u in mine],
                                       max(1, max_tokens // granularity))
        plans.append([[row for j in g for row in units[mine[j]]] for g in groups])
    return plans


def to_device(batch: TensorBatch, device: torch.device) -> TensorBatch:
    """The same batch with every tensor on `device`."""
    moved = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return TensorBatch(**{k: v.to(device) if v is not None else None for k, v in moved.items()})
