"""Algorithms as pure tensor maths: advantages, reward shaping, policy and value losses."""

from asyncrl.algorithms.advantages import (
    compute_advantages,
    compute_advantages_and_returns,
    gae,
    normalize,
    overlong_penalty,
    shape_rewards,
)
from asyncrl.algorithms.distill import distill_loss, on_policy_advantages, with_distillation
from asyncrl.algorithms.dpo import dpo_loss, make_dpo_loss_fn, sequence_logps
from asyncrl.algorithms.kl import kl_estimate, mean_token_kl, token_kl
from asyncrl.algorithms.ppo import kl_loss, make_ppo_loss_fn, ppo_loss
from asyncrl.algorithms.rm import bradley_terry_loss, make_bradley_terry_loss_fn
from asyncrl.algorithms.sft import make_sft_loss_fn, sft_loss
from asyncrl.algorithms.value import make_value_loss_fn, value_loss, value_stats

__all__ = ["bradley_terry_loss", "compute_advantages", "compute_advantages_and_returns",
           "distill_loss", "dpo_loss", "gae", "kl_estimate", "kl_loss",
           "make_bradley_terry_loss_fn", "make_dpo_loss_fn", "make_ppo_loss_fn",
           "make_sft_loss_fn", "make_value_loss_fn", "mean_token_kl", "normalize",
           "on_policy_advantages", "overlong_penalty", "ppo_loss",
           "sequence_logps", "sft_loss", "shape_rewards", "token_kl", "value_loss", "value_stats",
           "with_distillation"]
