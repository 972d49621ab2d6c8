"""Algorithms as pure tensor maths: advantages, reward shaping, policy and value losses."""

from asyncrl.algorithms.advantages import (
    compute_advantages,
    compute_advantages_and_returns,
    gae,
    normalize,
    overlong_penalty,
    shape_rewards,
)
from asyncrl.algorithms.kl import kl_estimate, mean_token_kl, sequence_kl
from asyncrl.algorithms.ppo import kl_loss, make_ppo_loss_fn, ppo_loss
from asyncrl.algorithms.rm import bradley_terry_loss, make_bradley_terry_loss_fn
from asyncrl.algorithms.value import make_value_loss_fn, value_loss, value_stats

__all__ = ["bradley_terry_loss", "compute_advantages", "compute_advantages_and_returns", "gae",
           "kl_estimate", "kl_loss", "make_bradley_terry_loss_fn", "make_ppo_loss_fn",
           "make_value_loss_fn", "mean_token_kl", "normalize", "overlong_penalty", "ppo_loss",
           "sequence_kl", "shape_rewards", "value_loss", "value_stats"]
