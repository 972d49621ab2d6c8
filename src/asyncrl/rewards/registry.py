"""Reward functions by name: the built-in ones, or any "package.module:function"."""

from __future__ import annotations

import importlib

from asyncrl.api.protocols import RewardFn

# Module paths, not imports: reasoning-gym takes seconds to import and a GSM8K run
# (or its reward worker processes) should not pay for it.
BUILTIN_REWARDS = {
    "gsm8k": "asyncrl.rewards.gsm8k:gsm8k_reward",
    "reasoning_gym": "asyncrl.rewards.rgym:reasoning_gym_reward",
}


def resolve_reward_fn(name: str) -> RewardFn:
    """The reward function called `name`: a built-in name or "package.module:function"."""
    spec = BUILTIN_REWARDS.get(name, name)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"unknown reward_fn {name!r}: use one of {sorted(BUILTIN_REWARDS)} "
                         "or 'package.module:function'")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"reward_fn {name!r}: cannot import module {module_name!r} ({e})") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward_fn {name!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward_fn {name!r} is a {type(obj).__name__}, not a function")
    return obj
