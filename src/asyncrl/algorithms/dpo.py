"""DPO (Rafailov et al. 2023) and IPO (Azar et al. 2023) losses over (chosen, rejected) pairs.

With sequence log-probs (summed over the answer tokens) of the policy and of the frozen
reference, h = (logp_c - ref_c) - (logp_r - ref_r) is how much more the policy prefers the
chosen answer than the reference did. Per pair:
  sigmoid  -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)   (eps: cDPO)
  ipo      (h - 1 / (2 * beta))^2
The implicit rewards are beta * (logp - ref) of each answer; their difference is the margin.

A batch holds each pair as rows 2k (chosen, label 1) and 2k + 1 (rejected, label 0) and the
micro-batch planner keeps them together (`mb_spec.granularity = 2`), so a micro-batch's
loss is its pairs' losses over the batch's pair count, and the shares add up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncrl.api.protocols import LossFn
from asyncrl.api.types import TensorBatch

LOSS_TYPES = ("sigmoid", "ipo")


def sequence_logps(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B] sums of the token log-probs [B, T] over each row's loss tokens."""
    return (logprobs * (loss_mask > 0)).sum(-1)


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, *, beta: float,
             loss_type: str = "sigmoid",
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair losses [P] and per-pair stats (rewards, margin, accuracy, log-probs)."""
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = (-(1 - label_smoothing) * F.logsigmoid(beta * h)
                  - label_smoothing * F.logsigmoid(-beta * h))
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    with torch.no_grad():
        chosen_reward, rejected_reward = beta * chosen_ratio, beta * rejected_ratio
        stats = {"chosen_reward": chosen_reward, "rejected_reward": rejected_reward,
                 "reward_margin": chosen_reward - rejected_reward,
                 "reward_accuracy": (chosen_reward > rejected_reward).float(),
                 "chosen_logp": chosen_logps.detach(), "rejected_logp": rejected_logps.detach()}
    return losses, stats


def _pairs(mb: TensorBatch) -> None:
    """Raise unless the rows are (chosen, rejected) pairs with reference log-probs."""
    labels = mb.rewards
    if len(mb) % 2 or not (torch.all(labels[0::2] == 1) and torch.all(labels[1::2] == 0)):
        raise ValueError(f"DPO rows must come as (chosen, rejected) pairs, labels 1 then 0, in "
                         f"one micro-batch; got labels {labels.tolist()}. Keep "
                         f"model.mb_spec.granularity even (DPO sets 2)")
    if mb.ref_logprobs is None:
        raise ValueError("batch.ref_logprobs is None: DPO needs the reference model's log-probs, "
                         "computed once per dataset before training")


def make_dpo_loss_fn(*, beta: float, loss_type: str = "sigmoid",
                     label_smoothing: float = 0.0) -> LossFn:
    """The DPO/IPO loss over a micro-batch of whole pairs; stats are means over the batch."""

    def loss_fn(logprobs: torch.Tensor, mb: TensorBatch, *, n_tokens: int,
                n_seqs: int) -> tuple[torch.Tensor, dict[str, float]]:
        _pairs(mb)
        policy = sequence_logps(logprobs, mb.loss_mask)
        ref = sequence_logps(mb.ref_logprobs, mb.loss_mask)
        losses, per_pair = dpo_loss(policy[0::2], policy[1::2], ref[0::2], ref[1::2], beta=beta,
                                    loss_type=loss_type, label_smoothing=label_smoothing)
        n_pairs = max(n_seqs // 2, 1)  # the whole batch's: micro-batch shares add up
        return losses.sum() / n_pairs, {k: float(v.sum()) / n_pairs for k, v in per_pair.items()}

    return loss_fn
