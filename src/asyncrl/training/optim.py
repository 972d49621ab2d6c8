"""AdamW and the learning-rate schedule (warmup, then constant, linear or cosine decay)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial

import torch

from asyncrl.config.schema import OptimizerConfig


def make_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW with the config's lr, betas, eps and decoupled weight decay."""
    if cfg.type != "adam":
        raise ValueError(f"optimizer.type {cfg.type!r} is not supported; use 'adam'")
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, fused=True)


def init_state(optimizer: torch.optim.AdamW) -> None:
    """Allocate AdamW's state (step 0, zero moments) now, as its first step would, for every
    parameter that takes a gradient; the first step then finds it and leaves it as is."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if state or not p.requires_grad:
                continue
            if group["capturable"] or group["fused"]:  # as torch.optim.AdamW does
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            else:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def lr_factor(step: int, *, kind: str, total_steps: int, warmup_steps: int,
              min_lr_ratio: float) -> float:
    """The multiplier of the base lr used by optimiser step `step` (0-based)."""
    if step < warmup_steps:
        # (step + 1): the first step already learns; the full lr is reached at the warmup's end.
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if kind == "linear":
        shape = 1.0 - progress
    elif kind == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"optimizer.lr_scheduler_type {kind!r} is not one of "
                         "constant|linear|cosine")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def make_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig,
                      total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `total_steps` optimiser steps (warmup is a proportion of them)."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    warmup = int(cfg.warmup_steps_proportion * total_steps)
    fn = partial(lr_factor, kind=cfg.lr_scheduler_type, total_steps=total_steps,
                 warmup_steps=warmup, min_lr_ratio=cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
