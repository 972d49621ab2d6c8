"""Supervised fine-tuning: the negative log-likelihood of the answer tokens."""

from __future__ import annotations

import torch

from asyncrl.api.protocols import LossFn
from asyncrl.api.types import TensorBatch


def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor, *, n_tokens: int) -> torch.Tensor:
    """-sum(log p * mask) / n_tokens: this micro-batch's share of the batch's token-mean NLL."""
    return -(logprobs * (loss_mask > 0)).sum() / max(n_tokens, 1)


def make_sft_loss_fn() -> LossFn:
    """The SFT loss over a micro-batch (prompt tokens are outside `loss_mask`)."""

    def loss_fn(logprobs: torch.Tensor, mb: TensorBatch, *, n_tokens: int,
                n_seqs: int) -> tuple[torch.Tensor, dict[str, float]]:
        loss = sft_loss(logprobs, mb.loss_mask, n_tokens=n_tokens)
        # The engine reports the summed loss; the token count tells evaluations apart.
        return loss, {"answer_tokens": float((mb.loss_mask > 0).sum())}

    return loss_fn
