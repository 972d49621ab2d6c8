"""The critic's loss: clipped squared error of values against GAE returns (PPO's value loss).

Values are token-aligned like log-probs: entry t is V of the state before token t. The loss
is token-level over the loss tokens (summed over a micro-batch, divided by the whole
batch's loss-token count), and its stats are contributions that sum to batch means.
"""

from __future__ import annotations

import torch

from asyncrl.api.protocols import LossFn
from asyncrl.api.types import TensorBatch
from asyncrl.config.schema import CriticConfig


def value_loss(values: torch.Tensor, *, old_values: torch.Tensor, returns: torch.Tensor,
               loss_mask: torch.Tensor, eps_clip: float | None,
               n_tokens: int) -> tuple[torch.Tensor, dict[str, float]]:
    """sum(0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2) * mask) / n_tokens.

    Without `eps_clip` it is the plain 0.5 * (V - R)^2. `clip_frac` is the share of loss
    tokens where the clipped error is the larger one (the value update is held back).
    """
    mask = loss_mask > 0
    denom = max(n_tokens, 1)  # a batch without loss tokens has loss 0, not NaN
    error = (values - returns).square()
    if eps_clip is None:
        token_loss, is_clipped = 0.5 * error, torch.zeros_like(mask)
    else:
        clipped = old_values + (values - old_values).clamp(-eps_clip, eps_clip)
        clipped_error = (clipped - returns).square()
        token_loss = 0.5 * torch.maximum(error, clipped_error)
        is_clipped = clipped_error > error
    loss = (token_loss * mask).sum() / denom
    with torch.no_grad():
        clip_frac = float((is_clipped & mask).sum()) / denom
    return loss, {"clip_frac": clip_frac}


def make_value_loss_fn(cfg: CriticConfig) -> LossFn:
    """The critic's loss over a micro-batch: reads `mb.values` (V_old) and `mb.returns`."""

    def loss_fn(values: torch.Tensor, mb: TensorBatch, *, n_tokens: int,
                n_seqs: int) -> tuple[torch.Tensor, dict[str, float]]:
        if mb.values is None or mb.returns is None:
            raise ValueError("batch.values / batch.returns is None: set the critic's values "
                             "(compute_values) and the GAE returns before training the critic")
        return value_loss(values, old_values=mb.values, returns=mb.returns,
                          loss_mask=mb.loss_mask, eps_clip=cfg.eps_clip, n_tokens=n_tokens)

    return loss_fn


def value_stats(batch: TensorBatch) -> dict[str, float]:
    """Means of the values and returns over the loss tokens, and the values' explained variance.

    explained_var = 1 - Var(R - V) / Var(R): 1 is a perfect critic, 0 no better than a
    constant, below 0 worse. Left out when the returns do not vary (it is undefined).
    """
    if batch.values is None or batch.returns is None:
        raise ValueError("batch.values / batch.returns is None: compute them before their stats")
    mask = batch.loss_mask > 0
    v, r = batch.values[mask].double(), batch.returns[mask].double()
    if v.numel() == 0:
        return {}
    stats = {"values_mean": float(v.mean()), "returns_mean": float(r.mean())}
    var_r = float(r.var(unbiased=False))
    if var_r > 0:
        stats["explained_var"] = 1.0 - float((r - v).var(unbiased=False)) / var_r
    return stats
