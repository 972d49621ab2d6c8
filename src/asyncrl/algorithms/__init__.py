"""Algorithms as pure tensor maths: advantages, reward shaping, policy losses."""

from asyncrl.algorithms.advantages import (
    compute_advantages,
    normalize,
    overlong_penalty,
    shape_rewards,
)
from asyncrl.algorithms.ppo import make_ppo_loss_fn, ppo_loss

__all__ = ["compute_advantages", "make_ppo_loss_fn", "normalize", "overlong_penalty", "ppo_loss",
           "shape_rewards"]
