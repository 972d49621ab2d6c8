"""Reward shaping, normalisation, GRPO advantages and GAE.

Rows of a batch are contiguous groups of `group_size` samples of one prompt. Standard
deviations are population ones (divide by n, not n - 1), as in AReaL: a group of two
rewards {1, 0} has std 0.5. Normalisation divides by (std + eps), so a group of equal
rewards normalises to zeros rather than to a division by zero.
"""

from __future__ import annotations

import torch

from asyncrl.algorithms.distill import on_policy_advantages
from asyncrl.algorithms.kl import token_kl
from asyncrl.api.types import TensorBatch
from asyncrl.config.schema import ActorConfig, NormConfig

LEVELS = ("batch", "group", "none")


def shape_rewards(rewards: torch.Tensor, *, scaling: float = 1.0, bias: float = 0.0,
                  clip: float | None = None) -> torch.Tensor:
    """(r + bias) * scaling, then clipped to [-clip, clip] when `clip` is set."""
    shaped = (rewards + bias) * scaling
    return shaped if clip is None else shaped.clamp(-clip, clip)


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, overlong_tokens: int,
                     factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to max_len - overlong_tokens, then linear to -factor.

    A completion of L tokens gets -(L - (max_len - overlong_tokens)) / overlong_tokens * factor
    once it enters the last `overlong_tokens` of the budget, and 0 before.
    """
    if not 1 <= overlong_tokens <= max_len:
        raise ValueError(f"actor.overlong_tokens must be in [1, {max_len}] (the generation "
                         f"budget), got {overlong_tokens}")
    excess = lengths.float() - (max_len - overlong_tokens)
    return (-excess / overlong_tokens * factor).clamp(max=0.0)


def _grouped(x: torch.Tensor, level: str, group_size: int | None) -> torch.Tensor:
    """`x` [B, ...] viewed as [n_groups, rows_per_group, ...] for `level`."""
    rows = x.shape[0]
    if level == "batch":
        size = rows
    elif level == "group":
        if group_size is None or group_size < 1:
            raise ValueError(f"group-level normalisation needs a group_size >= 1, got {group_size}")
        if rows % group_size:
            raise ValueError(f"a batch of {rows} rows is not a whole number of groups of "
                             f"{group_size}")
        size = group_size
    else:
        raise ValueError(f"normalisation level {level!r} is not one of {LEVELS}")
    return x.reshape(rows // size, size, *x.shape[1:])


def _group_sums(x: torch.Tensor, mask: torch.Tensor, level: str, group_size: int | None,
                groups: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked sum and count of `x` over each group, both broadcast back to `x`'s shape.

    `groups` [B] (row -> group number) allows groups of different sizes (an agent session
    may give several trajectories); without it rows form groups of `group_size`.
    """
    if level == "group" and groups is not None:
        return _indexed_sums(x * mask, groups), _indexed_sums(mask, groups)
    xs, ms = _grouped(x * mask, level, group_size), _grouped(mask, level, group_size)
    dims = tuple(range(1, xs.dim()))
    total = xs.sum(dims, keepdim=True).expand_as(xs).reshape(x.shape)
    count = ms.sum(dims, keepdim=True).expand_as(ms).reshape(x.shape)
    return total, count


def _indexed_sums(x: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Each row's group total of `x` (summed over rows and columns), in `x`'s shape."""
    rows = x.reshape(x.shape[0], -1).sum(-1)
    totals = torch.zeros(int(groups.max()) + 1, dtype=x.dtype).index_add_(0, groups, rows)
    return totals[groups].reshape(-1, *[1] * (x.dim() - 1)).expand_as(x)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor, level: str,
                 group_size: int | None, *, leave1out: bool = False,
                 unbiased: bool = False, groups: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of `x` over the masked entries of each group, broadcast back to `x`'s shape.

    `leave1out`: each entry's mean excludes itself, (sum - x_i) / (n - 1) (RLOO's baseline).
    `unbiased`: divide by n - 1 instead of n (for a variance of centred values).
    """
    total, count = _group_sums(x, mask, level, group_size, groups)
    if leave1out:
        if bool(((count < 2) & (mask > 0)).any()):
            raise ValueError("mean_leave1out needs at least 2 samples per group (a sample's "
                             "baseline is the mean of the others); raise gconfig.n_samples "
                             "or set mean_leave1out=false")
        return (total - x * mask) / (count - 1).clamp(min=1)
    if unbiased:
        return total / (count - 1).clamp(min=1)
    return total / count.clamp(min=1)


def normalize(values: torch.Tensor, *, mean_level: str = "group", std_level: str = "group",
              group_size: int | None = None, eps: float = 1e-5,
              mask: torch.Tensor | None = None, mean_leave1out: bool = False,
              std_unbiased: bool = False, groups: torch.Tensor | None = None) -> torch.Tensor:
    """(values - mean) / (std + eps), each statistic over the batch, each group, or skipped.

    `values` is [B] or [B, T]; with `mask` only its non-zero entries count, and the result
    is 0 off the mask. A level of "none" skips that step (no subtraction / no division).
    `mean_leave1out`: each entry's mean leaves that entry out (RLOO). `std_unbiased`: the
    variance divides by n - 1 rather than n. `groups` [B]: each row's group number, for
    groups of different sizes (then `group_size` is not used).
    """
    for name, level in (("mean_level", mean_level), ("std_level", std_level)):
        if level not in LEVELS:
            raise ValueError(f"{name} {level!r} is not one of {LEVELS}")
    mask = torch.ones_like(values) if mask is None else mask.to(values.dtype)
    out = values
    if mean_level != "none":
        out = values - _masked_mean(values, mask, mean_level, group_size,
                                    leave1out=mean_leave1out, groups=groups)
    if std_level != "none":
        # The spread is measured around the std level's own (full) mean, whatever mean_level
        # is and whether or not the mean leaves one out, as in AReaL.
        centred = values - _masked_mean(values, mask, std_level, group_size, groups=groups)
        var = _masked_mean(centred.square(), mask, std_level, group_size, unbiased=std_unbiased,
                           groups=groups)
        out = out / (var.sqrt() + eps)
    return out * mask


def _normalize_with(values: torch.Tensor, norm: NormConfig, name: str,
                    mask: torch.Tensor | None = None,
                    groups: torch.Tensor | None = None) -> torch.Tensor:
    if norm.group_size is None and "group" in (norm.mean_level, norm.std_level):
        raise ValueError(f"actor.{name}.group_size is unset; set it to gconfig.n_samples "
                         "(ExperimentConfig fills it in when loaded)")
    return normalize(values, mean_level=norm.mean_level, std_level=norm.std_level,
                     group_size=norm.group_size, eps=norm.eps, mask=mask,
                     mean_leave1out=norm.mean_leave1out, std_unbiased=norm.std_unbiased,
                     groups=groups)


def _overlong_penalty_of(lengths: torch.Tensor, cfg: ActorConfig) -> torch.Tensor:
    if cfg.max_new_tokens is None:
        raise ValueError("actor.overlong_reward_penalty=true but actor.max_new_tokens is unset; set "
                         "it to gconfig.max_new_tokens (ExperimentConfig fills it in when loaded)")
    return overlong_penalty(lengths, max_len=cfg.max_new_tokens,
                            overlong_tokens=cfg.overlong_tokens, factor=cfg.overlong_penalty_factor)


def in_reward_kl_logprobs(batch: TensorBatch) -> torch.Tensor:
    """The policy side of the in-reward KL: proximal log-probs if recomputed, else behaviour.

    The sampled tokens came from the behaviour policy; the trainer's recomputation, when
    there is one before the advantages, is the same policy without inference-engine noise.
    """
    return batch.prox_logprobs if batch.prox_logprobs is not None else batch.behavior_logprobs


def sequence_rewards(batch: TensorBatch, cfg: ActorConfig) -> torch.Tensor:
    """[B] rewards after the overlong penalty, shaping and `reward_norm`.

    Steps: optional overlong penalty on the raw reward -> (r + reward_bias) * reward_scaling
    -> optional clip to [-reward_clip, reward_clip] -> `reward_norm` over rows.
    """
    mask = (batch.loss_mask > 0).float()
    rewards = batch.rewards.float()
    if cfg.overlong_reward_penalty:
        rewards = rewards + _overlong_penalty_of(mask.sum(-1), cfg)
    rewards = shape_rewards(rewards, scaling=cfg.reward_scaling, bias=cfg.reward_bias,
                            clip=cfg.reward_clip)
    if cfg.reward_norm is not None:
        rewards = _normalize_with(rewards, cfg.reward_norm, "reward_norm",
                                  groups=batch.group_index)
    return rewards


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: each row's reward on its last loss token, 0 elsewhere (and on rows without any)."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask > 0, positions, -1).max(-1).values  # -1: no loss token
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards[rows]
    return out


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *,
        discount: float, gae_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's loss tokens; (advantages, returns).

    The loss tokens of a row are its time steps, in order; positions off the mask (prompt,
    padding, tool output between turns) are skipped, so the step after loss token t is the
    next loss token. After the last one the episode ends (V = 0). Backward over steps:
    delta_t = r_t + discount * V_next - V_t, A_t = delta_t + discount * gae_lambda * A_next,
    and the return (the critic's target) is R_t = A_t + V_t. Both are 0 off the mask.
    """
    on = mask > 0
    cols = torch.nonzero(on.any(0)).squeeze(-1)
    advantages = torch.zeros_like(token_rewards)
    next_value = token_rewards.new_zeros(token_rewards.shape[0])
    next_adv = token_rewards.new_zeros(token_rewards.shape[0])
    for t in reversed(cols.tolist()):  # columns without any loss token cannot change anything
        delta = token_rewards[:, t] + discount * next_value - values[:, t]
        adv = delta + discount * gae_lambda * next_adv
        advantages[:, t] = torch.where(on[:, t], adv, 0.0)
        next_value = torch.where(on[:, t], values[:, t], next_value)
        next_adv = torch.where(on[:, t], adv, next_adv)
    return advantages, (advantages + values) * on


def compute_advantages_and_returns(batch: TensorBatch,
                                   cfg: ActorConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Advantages [B, T] (0 off the loss tokens) and, with a critic, its GAE returns [B, T].

    The sequence reward (`sequence_rewards`) is the reward of the last loss token; the
    in-reward KL, if on, is a per-token reward on every loss token (`token_rewards`, as in
    AReaL). With the critic's `batch.values`, discount / gae_lambda below 1 or the in-reward
    KL, advantages are GAE over the values (0 without a critic): with V = 0 and
    discount = gae_lambda = 1 each token's reward-to-go. Otherwise every loss token gets the
    sequence reward (what GAE gives then, without its loop). `adv_norm` then
    normalises the advantages over the loss tokens; the returns are taken before it.
    Pure on-policy distillation replaces everything before `adv_norm` with the teacher's
    per-token signal (rewards unused).
    """
    mask = (batch.loss_mask > 0).float()
    if cfg.distill_coef > 0 and cfg.distill_mode == "on_policy":
        advantages, returns = on_policy_advantages(batch, cfg.distill_coef), None
    else:
        advantages, returns = _reward_advantages(batch, cfg, mask)
    if cfg.adv_norm is not None:
        advantages = _normalize_with(advantages, cfg.adv_norm, "adv_norm", mask=mask,
                                     groups=batch.group_index)
    return advantages, returns


def token_rewards(batch: TensorBatch, cfg: ActorConfig, rewards: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: each row's sequence reward on its last loss token, and with the in-reward KL
    (kl_ctl > 0, not use_kl_loss) a penalty of -kl_ctl * kl_t on every loss token t."""
    out = last_token_rewards(rewards, mask)
    if cfg.kl_ctl > 0 and not cfg.use_kl_loss:
        out = out - cfg.kl_ctl * token_kl(batch, in_reward_kl_logprobs(batch), cfg.kl_estimator)
    return out


def _reward_advantages(batch: TensorBatch, cfg: ActorConfig,
                       mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Advantages from the token rewards (GAE, or its broadcast shortcut), critic returns."""
    rewards = sequence_rewards(batch, cfg)
    in_reward_kl = cfg.kl_ctl > 0 and not cfg.use_kl_loss
    if batch.values is None and cfg.discount == 1 and cfg.gae_lambda == 1 and not in_reward_kl:
        return rewards[:, None] * mask, None
    values = torch.zeros_like(mask) if batch.values is None else batch.values.float() * mask
    advantages, returns = gae(token_rewards(batch, cfg, rewards, mask), values, mask,
                              discount=cfg.discount, gae_lambda=cfg.gae_lambda)
    return advantages, (None if batch.values is None else returns)


def compute_advantages(batch: TensorBatch, cfg: ActorConfig) -> torch.Tensor:
    """The advantages of `compute_advantages_and_returns` (GRPO: the broadcast reward)."""
    return compute_advantages_and_returns(batch, cfg)[0]
