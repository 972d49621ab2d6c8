"""Algorithms as pure tensor maths: advantages, reward shaping, policy losses."""

from asyncrl.algorithms.advantages import (
    compute_advantages,
    normalize,
    overlong_penalty,
    shape_rewards,
)
from asyncrl.algorithms.distill import distill_loss, on_policy_advantages, with_distillation
from asyncrl.algorithms.kl import kl_estimate, mean_token_kl, sequence_kl
from asyncrl.algorithms.ppo import kl_loss, make_ppo_loss_fn, ppo_loss

__all__ = ["compute_advantages", "distill_loss", "kl_estimate", "kl_loss", "make_ppo_loss_fn",
           "mean_token_kl", "normalize", "on_policy_advantages", "overlong_penalty", "ppo_loss",
           "sequence_kl", "shape_rewards", "with_distillation"]
