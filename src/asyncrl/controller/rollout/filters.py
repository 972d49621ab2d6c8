"""Which finished episodes (groups) to keep: DAPO's dynamic sampling (arXiv 2503.14476 §3.2).

A group whose trajectories all got the same reward has zero advantage under group
normalisation: it costs a training slot and teaches nothing. The controller drops such
groups when they finish and samples more prompts until the batch is full.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from asyncrl.api import Trajectory

EpisodeFilter = Callable[[list[Trajectory]], bool]


def has_reward_signal(trajectories: list[Trajectory]) -> bool:
    """Keep a group unless every trajectory got exactly the same reward (DAPO's filter)."""
    return len({t.reward for t in trajectories}) > 1


def load_episode_filter(spec: str) -> EpisodeFilter:
    """The function named by "package.module:function" (rollout.dynamic_filter_fn)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"rollout.dynamic_filter_fn={spec!r} is not 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"rollout.dynamic_filter_fn={spec!r}: cannot import {module_name!r} "
                         f"({e})") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"rollout.dynamic_filter_fn={spec!r}: {module_name!r} has no "
                         f"function {attr!r}")
    return fn


def make_episode_filter(dynamic_sampling: bool, filter_fn: str | None) -> EpisodeFilter | None:
    """The controller's `should_accept`: None (keep all), DAPO's filter, or the named one."""
    if not dynamic_sampling:
        return None
    return has_reward_signal if filter_fn is None else load_episode_filter(filter_fn)
