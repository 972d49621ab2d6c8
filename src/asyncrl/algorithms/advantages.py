"""Reward shaping, normalisation and GRPO advantages.

Rows of a batch are contiguous groups of `group_size` samples of one prompt. Standard
deviations are population ones (divide by n, not n - 1), as in AReaL: a group of two
rewards {1, 0} has std 0.5. Normalisation divides by (std + eps), so a group of equal
rewards normalises to zeros rather than to a division by zero.
"""

from __future__ import annotations

import torch

from asyncrl.api.types import TensorBatch
from asyncrl.config.schema import ActorConfig, NormConfig

LEVELS = ("batch", "group", "none")


def shape_rewards(rewards: torch.Tensor, *, scaling: float = 1.0,
                  bias: float = 0.0) -> torch.Tensor:
    """(r + bias) * scaling."""
    return (rewards + bias) * scaling


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


def _masked_mean(x: torch.Tensor, mask: torch.Tensor, level: str,
                 group_size: int | None) -> torch.Tensor:
    """The mean of `x` over the masked entries of each group, broadcast back to `x`'s shape."""
    xs, ms = _grouped(x * mask, level, group_size), _grouped(mask, level, group_size)
    dims = tuple(range(1, xs.dim()))
    mean = xs.sum(dims, keepdim=True) / ms.sum(dims, keepdim=True).clamp(min=1)
    return mean.expand_as(xs).reshape(x.shape)


def normalize(values: torch.Tensor, *, mean_level: str = "group", std_level: str = "group",
              group_size: int | None = None, eps: float = 1e-5,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """(values - mean) / (std + eps), each statistic over the batch, each group, or skipped.

    `values` is [B] or [B, T]; with `mask` only its non-zero entries count, and the result
    is 0 off the mask. A level of "none" skips that step (no subtraction / no division).
    """
    for name, level in (("mean_level", mean_level), ("std_level", std_level)):
        if level not in LEVELS:
            raise ValueError(f"{name} {level!r} is not one of {LEVELS}")
    mask = torch.ones_like(values) if mask is None else mask.to(values.dtype)
    out = values
    if mean_level != "none":
        out = values - _masked_mean(values, mask, mean_level, group_size)
    if std_level != "none":
        # The spread is measured around the std level's own mean, whatever mean_level is.
        centred = values - _masked_mean(values, mask, std_level, group_size)
        std = _masked_mean(centred.square(), mask, std_level, group_size).sqrt()
        out = out / (std + eps)
    return out * mask


def _normalize_with(values: torch.Tensor, norm: NormConfig, name: str,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    if norm.group_size is None and "group" in (norm.mean_level, norm.std_level):
        raise ValueError(f"actor.{name}.group_size is unset; set it to gconfig.n_samples "
                         "(ExperimentConfig fills it in when loaded)")
    return normalize(values, mean_level=norm.mean_level, std_level=norm.std_level,
                     group_size=norm.group_size, eps=norm.eps, mask=mask)


def compute_advantages(batch: TensorBatch, cfg: ActorConfig) -> torch.Tensor:
    """GRPO advantages [B, T]: shaped, normalised rewards on every loss token, 0 elsewhere.

    Steps: (r + reward_bias) * reward_scaling -> `reward_norm` over rows -> broadcast to the
    loss tokens -> optional `adv_norm` over the loss tokens.
    """
    rewards = shape_rewards(batch.rewards.float(), scaling=cfg.reward_scaling, bias=cfg.reward_bias)
    if cfg.reward_norm is not None:
        rewards = _normalize_with(rewards, cfg.reward_norm, "reward_norm")
    mask = (batch.loss_mask > 0).float()
    advantages = rewards[:, None] * mask
    if cfg.adv_norm is not None:
        advantages = _normalize_with(advantages, cfg.adv_norm, "adv_norm", mask=mask)
    return advantages
