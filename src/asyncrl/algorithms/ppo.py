"""The PPO clipped loss, decoupled (AReaL) or plain.

Decoupled: the clip is on policy/proximal, where the proximal log-probs are the trainer's
recomputation before the update, and each token is weighted by proximal/behaviour (the
engine that sampled it, possibly several versions old). Rejection sampling filters that
weight: per token or per sequence, masking out what lies outside its bounds or clamping it
into them (`behav_imp_weight_cap` is the token/mask shorthand). Plain PPO is the special
case proximal := behaviour.

By default the loss is token-level: summed over the loss tokens of a micro-batch and divided
by the loss-token count of the whole batch, so micro-batch losses add up to the batch loss.
`loss_agg_mode` can average per sequence instead (divided by the batch's sequence count).
Stats are always token-level (contributions that sum to batch means), except `*_max`.
"""

from __future__ import annotations

import torch

from asyncrl.algorithms.kl import kl_estimate
from asyncrl.api.protocols import LossFn
from asyncrl.api.types import TensorBatch
from asyncrl.config.schema import ActorConfig, RejectionSamplingConfig

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
IS_LEVELS = ("token", "sequence")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as [B, T]: a 1-D tensor is one sequence."""
    return x[None] if x.dim() == 1 else x


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO: each sequence's mean log-ratio over its loss tokens, on every one of its tokens."""
    lr, m = _rows(log_ratio), _rows(mask).to(log_ratio.dtype)
    mean = (lr * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    return mean.expand_as(lr).reshape(log_ratio.shape)


def aggregate(token_loss: torch.Tensor, mask: torch.Tensor, mode: str, *, n_tokens: int,
              n_seqs: int | None, norm_len: int | None = None) -> torch.Tensor:
    """Reduce masked token losses to a scalar, as a micro-batch's share of the batch loss.

    token-mean: sum / n_tokens. seq-mean-token-mean: sum over sequences of (sum over its loss
    tokens / its loss-token count), / n_seqs. seq-mean-token-sum: sum / n_seqs.
    seq-mean-token-sum-norm (Dr.GRPO): sum / (n_seqs * norm_len), a constant length (the
    generation budget) in place of each sequence's own. `n_tokens` and `n_seqs` are the whole
    batch's, so micro-batch shares add up to the batch loss.
    """
    masked = token_loss * mask
    if mode == "token-mean":
        return masked.sum() / max(n_tokens, 1)  # no loss tokens: 0, not NaN
    if mode not in AGG_MODES:
        raise ValueError(f"actor.loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")
    if n_seqs is None:
        raise ValueError(f"loss_agg_mode={mode!r} needs n_seqs (the batch's sequence count)")
    per_seq = _rows(masked).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / _rows(mask).sum(-1).clamp(min=1)
    if mode == "seq-mean-token-sum-norm":
        if not norm_len:
            raise ValueError(f"loss_agg_mode={mode!r} needs norm_len (actor.max_new_tokens)")
        per_seq = per_seq / norm_len
    return per_seq.sum() / max(n_seqs, 1)


def _policy_term(ratio: torch.Tensor, advantages: torch.Tensor, *, eps_clip: float,
                 eps_clip_higher: float | None,
                 c_clip: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The clipped (and optionally dual-clipped) token loss, with where each clip is active."""
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    is_clipped = pg_clipped > pg_unclipped
    if c_clip is None:
        return pg, is_clipped, torch.zeros_like(is_clipped)
    # Dual clip (Ye et al. 2019): with A < 0 a huge ratio would make the loss unbounded;
    # cap it at -A * c_clip.
    pg_dual = -advantages * c_clip
    is_dual = (advantages < 0) & (pg_dual < pg)
    return torch.where(advantages < 0, torch.minimum(pg, pg_dual), pg), is_clipped, is_dual


def behaviour_weight(log_w: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """w = exp(prox - behav) per token, or each sequence's geometric mean exp(mean log w)."""
    if level == "sequence":
        return torch.exp(sequence_log_ratio(log_w, mask))
    if level != "token":
        raise ValueError(f"actor.rejection_sampling.level must be one of {IS_LEVELS}, "
                         f"got {level!r}")
    return torch.exp(log_w)


def reject_or_clamp(weight: torch.Tensor, mask: torch.Tensor, rs: RejectionSamplingConfig | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight used, tokens kept, tokens rejected, tokens clamped) under rejection sampling.

    `mask` drops the loss tokens whose weight lies outside [lower, upper] (at sequence level
    the weight is the sequence's, so whole sequences go); `clamp` clips it into the bounds.
    """
    none = torch.zeros_like(mask)
    if rs is None:
        return weight, mask, none, none
    lower = 0.0 if rs.lower is None else rs.lower
    outside = mask & ((weight > rs.upper) | (weight < lower))
    if rs.action == "mask":
        return weight, mask & ~outside, outside, none
    if rs.action == "clamp":
        return weight.clamp(lower, rs.upper), mask, none, outside
    raise ValueError(f"actor.rejection_sampling.action must be 'mask' or 'clamp', "
                     f"got {rs.action!r}")


def _weight_stats(weight: torch.Tensor, mask: torch.Tensor, rejected: torch.Tensor,
                  clamped: torch.Tensor, denom: int) -> dict[str, float]:
    """Token means of the behaviour weight (before the filter) and of what the filter did."""
    any_token = bool(mask.any())
    return {
        "imp_weight_mean": float((weight * mask).sum()) / denom,
        "imp_weight_max": float(weight[mask].max()) if any_token else 0.0,
        # inf, not 0, when there is no loss token: the min over micro-batches must ignore it
        "imp_weight_min": float(weight[mask].min()) if any_token else float("inf"),
        "rejected_frac": float(rejected.sum()) / denom,
        "rejected_tokens": float(rejected.sum()),
        "clamped_frac": float(clamped.sum()) / denom,
    }


def ppo_loss(logprobs: torch.Tensor, *, prox_logprobs: torch.Tensor,
             behavior_logprobs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
             eps_clip: float, eps_clip_higher: float | None = None,
             imp_weight_cap: float | None = None,
             rejection_sampling: RejectionSamplingConfig | None = None,
             c_clip: float | None = None, loss_agg_mode: str = "token-mean",
             importance_sampling_level: str = "token", n_tokens: int,
             n_seqs: int | None = None,
             norm_len: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """agg(max(-A r, -A clip(r)) * w * kept), r = p/prox (per token or sequence), w = prox/behav.

    `imp_weight_cap` is shorthand for `rejection_sampling` at level token, action mask.
    """
    if imp_weight_cap is not None:
        if rejection_sampling is not None:
            raise ValueError("give imp_weight_cap or rejection_sampling, not both")
        rejection_sampling = RejectionSamplingConfig(upper=imp_weight_cap)
    mask = loss_mask > 0
    denom = max(n_tokens, 1)  # a batch without loss tokens has loss 0, not NaN
    log_ratio = logprobs - prox_logprobs
    if importance_sampling_level == "sequence":
        log_ratio = sequence_log_ratio(log_ratio, mask)
    elif importance_sampling_level != "token":
        raise ValueError(f"actor.importance_sampling_level must be one of {IS_LEVELS}, "
                         f"got {importance_sampling_level!r}")
    ratio = torch.exp(log_ratio)
    pg, is_clipped, is_dual = _policy_term(ratio, advantages, eps_clip=eps_clip,
                                           eps_clip_higher=eps_clip_higher, c_clip=c_clip)

    log_w = (prox_logprobs - behavior_logprobs).detach()
    raw_weight = behaviour_weight(log_w, mask, "token" if rejection_sampling is None
                                  else rejection_sampling.level)
    weight, kept, rejected, clamped = reject_or_clamp(raw_weight, mask, rejection_sampling)
    loss = aggregate(pg * weight, kept, loss_agg_mode, n_tokens=n_tokens, n_seqs=n_seqs,
                     norm_len=norm_len)

    with torch.no_grad():
        # k3 estimators (Schulman): exp(d) - 1 - d is non-negative with low variance.
        behav_kl = torch.exp(log_w) - 1.0 - log_w  # per token, whatever the filter's level
        d = (prox_logprobs - logprobs).detach()  # approx KL(policy || proximal), sampled
        approx_kl = torch.exp(d) - 1.0 - d
        stats = {
            "clip_frac": float((kept & is_clipped).sum()) / denom,
            "dual_clip_frac": float((kept & is_dual).sum()) / denom,
            "ratio_mean": float((ratio * mask).sum()) / denom,
            "behav_kl": float((behav_kl * mask).sum()) / denom,
            "approx_kl": float((approx_kl * mask).sum()) / denom,
        }
        stats |= _weight_stats(raw_weight, mask, rejected, clamped, denom)
    return loss, stats


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, loss_mask: torch.Tensor, *,
            kl_ctl: float, estimator: str, loss_agg_mode: str, n_tokens: int,
            n_seqs: int | None, norm_len: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """kl_ctl * agg(kl_t) over the loss tokens, and `kl_ref` (the token-mean KL estimate)."""
    mask = loss_mask > 0
    kl = kl_estimate(logprobs, ref_logprobs, estimator)
    loss = kl_ctl * aggregate(kl, mask, loss_agg_mode, n_tokens=n_tokens, n_seqs=n_seqs,
                              norm_len=norm_len)
    return loss, {"kl_ref": float((kl.detach() * mask).sum()) / max(n_tokens, 1)}


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
            prox, rs = logprobs.detach(), cfg.behav_rejection
        elif cfg.use_decoupled_loss:
            if mb.prox_logprobs is None:
                raise ValueError("batch.prox_logprobs is None but actor.use_decoupled_loss=true: "
                                 "set it from engine.compute_logprobs(batch) before training")
            prox, rs = mb.prox_logprobs, cfg.behav_rejection
        else:
            prox, rs = mb.behavior_logprobs, None
        loss, stats = ppo_loss(logprobs, prox_logprobs=prox, behavior_logprobs=mb.behavior_logprobs,
                        advantages=mb.advantages, loss_mask=mb.loss_mask, eps_clip=cfg.eps_clip,
                        eps_clip_higher=cfg.eps_clip_higher, rejection_sampling=rs,
                        c_clip=cfg.c_clip, loss_agg_mode=cfg.loss_agg_mode,
                        importance_sampling_level=cfg.importance_sampling_level,
                        n_tokens=n_tokens, n_seqs=n_seqs, norm_len=cfg.max_new_tokens)
        if cfg.kl_ctl > 0 and cfg.use_kl_loss:
            if mb.ref_logprobs is None:
                raise ValueError("batch.ref_logprobs is None but actor.use_kl_loss=true: set it "
                                 "from the reference engine's compute_logprobs(batch)")
            kl, kl_stats = kl_loss(logprobs, mb.ref_logprobs, mb.loss_mask, kl_ctl=cfg.kl_ctl,
                                   estimator=cfg.kl_estimator, loss_agg_mode=cfg.loss_agg_mode,
                                   n_tokens=n_tokens, n_seqs=n_seqs, norm_len=cfg.max_new_tokens)
            loss, stats = loss + kl, stats | kl_stats
        return loss, stats

    return loss_fn
