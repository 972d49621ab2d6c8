"""Held-out evaluation: run a (greedy) workflow over items, report the mean reward."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asyncrl.api import InferenceEngine, Trajectory, Workflow

logger = logging.getLogger(__name__)


async def evaluate(engine: InferenceEngine, workflow: Workflow, items: list[dict[str, Any]], *,
                   concurrency: int) -> tuple[dict[str, float], list[Trajectory]]:
    """Mean reward of `workflow` over `items`, and the trajectories.

    Failed items are counted, logged with their cause and excluded from the mean.
    """
    sem = asyncio.Semaphore(concurrency)

    async def one(item: dict[str, Any]):
        async with sem:
            return await workflow.run(engine, item)

    results = await asyncio.gather(*(one(item) for item in items), return_exceptions=True)
    trajectories, failures = [], 0
    for item, result in zip(items, results):
        if isinstance(result, BaseException):
            failures += 1
            logger.error("evaluation of item %s failed: %r", item.get("id", "?"), result)
        elif result:
            trajectories.extend(result)
    if not trajectories:
        raise RuntimeError(f"evaluation failed on all {len(items)} items; see the log for causes")
    scored = one_per_session(trajectories)
    # the weight versions the answers were generated with (one, when the weights held still)
    versions = [v for t in trajectories for v in t.output_versions] or [-1]
    stats = {
        "eval/reward": sum(t.reward for t in scored) / len(scored),
        "eval/n": float(len(scored)),
        "eval/failed": float(failures),
        "eval/output_tokens_mean": sum(t.n_output_tokens for t in trajectories) / len(scored),
        "eval/version_min": float(min(versions)),
        "eval/version_max": float(max(versions)),
    }
    return stats, trajectories


def one_per_session(trajectories: list[Trajectory]) -> list[Trajectory]:
    """Each agent session once: its first trajectory, whose reward is the return from its
    first turn (a session whose turns did not merge exports several). Others stay as they are."""
    seen: set[str] = set()
    out = []
    for t in trajectories:
        session = t.meta.get("session_id")
        if session is None or session not in seen:
            out.append(t)
            if session is not None:
                seen.add(session)
    return out
