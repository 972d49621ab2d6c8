"""Reward functions by name: the built-in ones, or any "package.module:function"."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from asyncrl.api.protocols import RewardFn

# Module paths, not imports: reasoning-gym takes seconds to import and a GSM8K run
# (or its reward worker processes) should not pay for it.
BUILTIN_REWARDS = {
    "gsm8k": "asyncrl.rewards.gsm8k:gsm8k_reward",
    "reasoning_gym": "asyncrl.rewards.rgym:reasoning_gym_reward",
    # the share of an item's tests the completion's program passes, in the sandbox
    "code": "asyncrl.agents.code_reward:code_reward",
    # a word, number or yes/no, matched exactly after normalisation (the visual task's)
    "short_answer": "asyncrl.rewards.short_answer:short_answer_reward",
    # the same, read after the completion's last "Answer:" (a reasoning first, then the answer)
    "marked_short_answer": "asyncrl.rewards.short_answer:marked_short_answer_reward",
}

# The function that reads the final answer from a completion, per built-in reward, as the
# reward reads it (maj@k votes over these).
BUILTIN_ANSWER_FNS = {
    "gsm8k": "asyncrl.rewards.gsm8k:extract_final_answer",
    "reasoning_gym": "asyncrl.rewards.rgym:extract_tagged_answer",
    "short_answer": "asyncrl.rewards.short_answer:normalize_short_answer",
    "marked_short_answer": "asyncrl.rewards.short_answer:extract_marked_answer",
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
    return _import_function(BUILTIN_REWARDS.get(name, name), name, "reward_fn")


def resolve_answer_fn(name: str) -> Callable[[str], str | None]:
    """The answer extractor called `name`: a built-in reward's name (the answer it scores)
    or "package.module:function" taking a completion and returning its answer or None."""
    if name in BUILTIN_REWARDS and name not in BUILTIN_ANSWER_FNS:
        raise ValueError(f"answer_fn {name!r}: that reward exposes no answer extractor; use one "
                         f"of {sorted(BUILTIN_ANSWER_FNS)} or 'package.module:function'")
    return _import_function(BUILTIN_ANSWER_FNS.get(name, name), name, "answer_fn")


def _import_function(spec: str, name: str, what: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        known = [*BUILTIN_REWARDS, REWARD_MODEL] if what == "reward_fn" else BUILTIN_ANSWER_FNS
        raise ValueError(f"unknown {what} {name!r}: use one of {sorted(known)} or "
                         "'package.module:function'")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"{what} {name!r}: cannot import module {module_name!r} ({e})") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {name!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {name!r} is a {type(obj).__name__}, not a function")
    return obj
