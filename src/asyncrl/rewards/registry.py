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


REWARD_MODEL = "reward_model"  # a trained reward model, at `reward_model_path`


def resolve_reward_fn(name: str, *, reward_model_path: str | None = None) -> RewardFn:
    """The reward function called `name`: a built-in name, "package.module:function", or
    "reward_model" (scoring with the reward model at `reward_model_path`)."""
    if name == REWARD_MODEL:
        if not reward_model_path:
            raise ValueError("reward_fn 'reward_model' needs workflow.reward_model_path (a "
                             "folder written by `asyncrl rm`)")
        # torch and transformers: loaded only when a reward model scores
        from asyncrl.rewards.reward_model import RewardModelScorer

        return RewardModelScorer(reward_model_path)
    spec = BUILTIN_REWARDS.get(name, name)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"unknown reward_fn {name!r}: use one of "
                         f"{sorted([*BUILTIN_REWARDS, REWARD_MODEL])} or 'package.module:function'")
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
