"""Reward functions (math answer checking, reasoning-gym scorers) and their runner.

`reasoning_gym_reward` lives in `asyncrl.rewards.rgym`, imported on demand (reasoning-gym
is slow to import); `resolve_reward_fn("reasoning_gym")` finds it. A trained reward model
(`asyncrl.rewards.reward_model`) is `resolve_reward_fn("reward_model", reward_model_path=...)`.
"""

from asyncrl.rewards.gsm8k import extract_final_answer, gsm8k_ground_truth, gsm8k_reward, math_equal
from asyncrl.rewards.registry import BUILTIN_REWARDS, resolve_reward_fn
from asyncrl.rewards.runner import RewardError, RewardRunner, RewardTimeout

__all__ = [
    "BUILTIN_REWARDS", "RewardError", "RewardRunner", "RewardTimeout", "extract_final_answer",
    "gsm8k_ground_truth", "gsm8k_reward", "math_equal", "resolve_reward_fn",
]
