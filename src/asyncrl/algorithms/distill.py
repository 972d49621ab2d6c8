"""Distillation from a frozen teacher on the student's own samples (reverse KL).

On a token the student sampled, d = logp_student - logp_teacher; its expectation under the
student is the per-token reverse KL, KL(student || teacher) (mode-seeking: the student is
pushed off what the teacher finds unlikely). Two ways to use it:

- `kl_loss`: + distill_coef * agg(k(d)) in the loss beside the RL objective, with gradient
  through the student's log-probs (Gu et al. 2023 MiniLLM, Agarwal et al. 2023 GKD with
  beta = 1, on sampled tokens only).
- `on_policy`: pure on-policy distillation (Thinking Machines, "On-Policy Distillation",
  2025): -distill_coef * d on the behaviour log-probs is each token's advantage (a per-token
  reward with discount 0), trained with the usual importance-sampled PPO loss.
"""

from __future__ import annotations

import torch

from asyncrl.algorithms.kl import kl_estimate
from asyncrl.algorithms.ppo import aggregate
from asyncrl.api.protocols import LossFn
from asyncrl.api.types import TensorBatch
from asyncrl.config.schema import ActorConfig


def _require_teacher(batch: TensorBatch) -> torch.Tensor:
    if batch.teacher_logprobs is None:
        raise ValueError("batch.teacher_logprobs is None but actor.distill_coef > 0: set it from "
                         "the teacher engine's compute_logprobs(batch) before training")
    return batch.teacher_logprobs


def distill_kl(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, loss_mask: torch.Tensor, *,
               n_tokens: int) -> float:
    """This micro-batch's share of the batch's token-mean k1 = logp - teacher_logp (no grad)."""
    d = (logprobs - teacher_logprobs).detach() * (loss_mask > 0)
    return float(d.sum()) / max(n_tokens, 1)


def distill_loss(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                 *, coef: float, estimator: str, loss_agg_mode: str, n_tokens: int,
                 n_seqs: int | None,
                 norm_len: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """coef * agg(k(logp - teacher_logp)) over the loss tokens, and `distill_kl` (k1 mean)."""
    kl = kl_estimate(logprobs, teacher_logprobs, estimator)
    loss = coef * aggregate(kl, loss_mask > 0, loss_agg_mode, n_tokens=n_tokens, n_seqs=n_seqs,
                            norm_len=norm_len)
    return loss, {"distill_kl": distill_kl(logprobs, teacher_logprobs, loss_mask,
                                           n_tokens=n_tokens)}


def on_policy_advantages(batch: TensorBatch, coef: float) -> torch.Tensor:
    """[B, T]: -coef * (behaviour logp - teacher logp) on loss tokens, 0 elsewhere.

    The behaviour log-probs are those of the policy that sampled the tokens, so d is a
    sample of the reverse KL at that token; with discount 0 it is the token's whole return.
    """
    mask = (batch.loss_mask > 0).float()
    return -coef * (batch.behavior_logprobs - _require_teacher(batch)) * mask


def with_distillation(loss_fn: LossFn, cfg: ActorConfig) -> LossFn:
    """`loss_fn` plus the distillation term (kl_loss mode) and the `distill_kl` stat.

    With distill_coef 0 it is `loss_fn` itself. In on_policy mode the teacher is already in
    the advantages; the wrapper only reports `distill_kl`, from the behaviour log-probs.
    """
    if cfg.distill_coef == 0:
        return loss_fn

    def distill_loss_fn(logprobs: torch.Tensor, mb: TensorBatch, *, n_tokens: int,
                        n_seqs: int) -> tuple[torch.Tensor, dict[str, float]]:
        loss, stats = loss_fn(logprobs, mb, n_tokens=n_tokens, n_seqs=n_seqs)
        teacher = _require_teacher(mb)
        if cfg.distill_mode == "on_policy":
            # The KL the advantages used: of the policy that sampled, on its own samples (an
            # unbiased estimate; the current policy on older samples is not one).
            kl = distill_kl(mb.behavior_logprobs, teacher, mb.loss_mask, n_tokens=n_tokens)
            return loss, stats | {"distill_kl": kl}
        term, term_stats = distill_loss(logprobs, teacher, mb.loss_mask, coef=cfg.distill_coef,
                                        estimator=cfg.distill_kl_estimator,
                                        loss_agg_mode=cfg.loss_agg_mode, n_tokens=n_tokens,
                                        n_seqs=n_seqs, norm_len=cfg.max_new_tokens)
        return loss + term, stats | term_stats

    return distill_loss_fn
