"""The reward model's Bradley-Terry loss over (chosen, rejected) pairs.

Under the Bradley-Terry model P(chosen > rejected) = sigmoid(r_chosen - r_rejected); the
loss is its negative log-likelihood, averaged over pairs (Ouyang et al. 2022, InstructGPT;
TRL's RewardTrainer).
"""

from __future__ import annotations

import torch

from asyncrl.api.protocols import LossFn
from asyncrl.api.types import TensorBatch


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, *,
                       n_pairs: int) -> tuple[torch.Tensor, dict[str, float]]:
    """sum(-log sigmoid(r_c - r_r)) / n_pairs, with accuracy and margin as shares of the mean.

    `n_pairs` is the whole batch's, so micro-batch losses and stats add up to batch means.
    Accuracy counts pairs with r_c > r_r strictly (a tie is not a correct ranking).
    """
    margin = chosen - rejected
    denom = max(n_pairs, 1)
    loss = -torch.nn.functional.logsigmoid(margin).sum() / denom
    with torch.no_grad():
        stats = {"accuracy": float((margin > 0).sum()) / denom,
                 "margin": float(margin.sum()) / denom,
                 "chosen_reward": float(chosen.sum()) / denom,
                 "rejected_reward": float(rejected.sum()) / denom}
    return loss, stats


def pair_rewards(per_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) rewards from the reward model's [B, T] output, rows 2i and 2i + 1."""
    if per_token.shape[0] % 2:
        raise ValueError(f"reward-model rows come in (chosen, rejected) pairs; got "
                         f"{per_token.shape[0]} rows")
    rewards = per_token.sum(-1)  # one non-zero entry per row: its last real token
    return rewards[0::2], rewards[1::2]


def make_bradley_terry_loss_fn() -> LossFn:
    """The reward model's loss over a micro-batch of whole pairs (n_seqs / 2 pairs in all)."""

    def loss_fn(per_token: torch.Tensor, mb: TensorBatch, *, n_tokens: int,
                n_seqs: int) -> tuple[torch.Tensor, dict[str, float]]:
        chosen, rejected = pair_rewards(per_token)
        return bradley_terry_loss(chosen, rejected, n_pairs=n_seqs // 2)

    return loss_fn
