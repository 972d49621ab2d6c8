"""The PPO clipped loss, decoupled (AReaL) or plain.

Decoupled: the clip is on policy/proximal, where the proximal log-probs are the trainer's
recomputation before the update, and each token is weighted by proximal/behaviour (the
engine that sampled it, possibly several versions old). Tokens whose weight exceeds the
cap are masked out, not clipped. Plain PPO is the special case proximal := behaviour.

The loss is token-level: summed over the loss tokens of a micro-batch and divided by the
loss-token count of the whole batch, so micro-batch losses add up to the batch loss.
Stats follow the same rule (contributions that sum to batch means), except `*_max`.
"""

from __future__ import annotations

import torch

from asyncrl.api.protocols import LossFn
from asyncrl.api.types import TensorBatch
from asyncrl.config.schema import ActorConfig


def ppo_loss(logprobs: torch.Tensor, *, prox_logprobs: torch.Tensor,
             behavior_logprobs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
             eps_clip: float, eps_clip_higher: float | None = None,
             imp_weight_cap: float | None = None,
             n_tokens: int) -> tuple[torch.Tensor, dict[str, float]]:
    """sum(max(-A r, -A clip(r)) * w * mask) / n_tokens, r = p/prox, w = prox/behav <= cap."""
    mask = loss_mask > 0
    denom = max(n_tokens, 1)  # a batch without loss tokens has loss 0, not NaN
    ratio = torch.exp(logprobs - prox_logprobs)
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    clipped_ratio = ratio.clamp(1.0 - eps_clip, 1.0 + high)
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * clipped_ratio
    pg = torch.maximum(pg_unclipped, pg_clipped)

    log_w = (prox_logprobs - behavior_logprobs).detach()
    weight = torch.exp(log_w)
    capped = torch.zeros_like(mask) if imp_weight_cap is None else mask & (weight > imp_weight_cap)
    kept = mask & ~capped
    loss = (pg * weight * kept).sum() / denom

    with torch.no_grad():
        is_clipped = kept & (pg_clipped > pg_unclipped)
        # k3 estimator of KL(behaviour || proximal): non-negative, low variance.
        kl = weight - 1.0 - log_w
        stats = {
            "clip_frac": float(is_clipped.sum()) / denom,
            "ratio_mean": float((ratio * mask).sum()) / denom,
            "imp_weight_mean": float((weight * mask).sum()) / denom,
            "imp_weight_max": float(weight[mask].max()) if mask.any() else 0.0,
            "capped_frac": float(capped.sum()) / denom,
            "capped_tokens": float(capped.sum()),
            "behav_kl": float((kl * mask).sum()) / denom,
        }
    return loss, stats


def make_ppo_loss_fn(cfg: ActorConfig, *, prox_is_current: bool = False) -> LossFn:
    """The actor's PPO loss over a micro-batch (reads advantages, prox log-probs if decoupled).

    `prox_is_current`: the batch gets exactly one optimiser step, so the proximal log-probs
    (the weights before the update) are the current forward's, detached. This saves the
    trainer a separate forward pass and gives the same numbers.
    """

    def loss_fn(logprobs: torch.Tensor, mb: TensorBatch, *, n_tokens: int,
                n_seqs: int) -> tuple[torch.Tensor, dict[str, float]]:
        if mb.advantages is None:
            raise ValueError("batch.advantages is None: compute the advantages before training")
        if cfg.use_decoupled_loss and prox_is_current:
            prox, cap = logprobs.detach(), cfg.behav_imp_weight_cap
        elif cfg.use_decoupled_loss:
            if mb.prox_logprobs is None:
                raise ValueError("batch.prox_logprobs is None but actor.use_decoupled_loss=true: "
                                 "set it from engine.compute_logprobs(batch) before training")
            prox, cap = mb.prox_logprobs, cfg.behav_imp_weight_cap
        else:
            prox, cap = mb.behavior_logprobs, None
        return ppo_loss(logprobs, prox_logprobs=prox, behavior_logprobs=mb.behavior_logprobs,
                        advantages=mb.advantages, loss_mask=mb.loss_mask, eps_clip=cfg.eps_clip,
                        eps_clip_higher=cfg.eps_clip_higher, imp_weight_cap=cap, n_tokens=n_tokens)

    return loss_fn
