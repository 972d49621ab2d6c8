"""KL regularisation to a frozen reference model, per token (Schulman's k1 / k2 / k3).

With d = logp - ref_logp on a token sampled from the policy, each estimator's expectation
under the policy relates to KL(policy || ref): k1 = d and k3 = exp(-d) - 1 + d are unbiased
(k3 is non-negative with lower variance), k2 = d^2 / 2 is biased but low-variance.
"""

from __future__ import annotations

import torch

from asyncrl.api.types import TensorBatch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate from d = logprobs - ref_logprobs (gradient flows through both)."""
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        return torch.exp(-d) - 1.0 + d
    raise ValueError(f"actor.kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def _require_ref(batch: TensorBatch) -> torch.Tensor:
    if batch.ref_logprobs is None:
        raise ValueError("batch.ref_logprobs is None but actor.kl_ctl > 0: set it from the "
                         "reference engine's compute_logprobs(batch) before training")
    return batch.ref_logprobs


def token_kl(batch: TensorBatch, logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """[B, T]: the KL estimate of each loss token, 0 elsewhere."""
    mask = (batch.loss_mask > 0).to(logprobs.dtype)
    return kl_estimate(logprobs, _require_ref(batch), estimator) * mask


def mean_token_kl(batch: TensorBatch, logprobs: torch.Tensor, estimator: str) -> float:
    """The KL estimate averaged over the batch's loss tokens (0 without loss tokens)."""
    n_tokens = int((batch.loss_mask > 0).sum())
    return float(token_kl(batch, logprobs, estimator).sum()) / max(n_tokens, 1)
