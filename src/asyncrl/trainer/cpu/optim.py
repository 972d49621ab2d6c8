"""AdamW and the learning-rate schedule (warmup, then constant, linear or cosine decay).

On one CPU rank with bf16 compute copies of the fp32 masters (`trainer/cpu/precision.py`), the
step is `CopyingAdamW`: torch's fused AdamW update in C (`kernels/adamw.c`), which
writes each updated weight's bf16 copy in the same pass. The copies were otherwise cast
from the masters again at the next forward, a pass reading every master (~90 ms a step at
one thread for the quickstart's 134M, as long as half the update itself).
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Iterable, Mapping
from functools import partial

import torch

from asyncrl import kernels
from asyncrl.api import cores
from asyncrl.config.schema import OptimizerConfig
from asyncrl.trainer.cpu.options import cpu_paths


@functools.cache
def _kernels() -> ctypes.CDLL | None:
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    return kernels.bind("adamw", {"adamw_f32": [p, p, p, p, p, i64, *[f32] * 8, i32]})


def make_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig,
                   copies: Mapping[int, torch.Tensor] | None = None) -> torch.optim.AdamW:
    """AdamW with the config's lr, betas, eps and decoupled weight decay. With `copies`
    (id of a master -> its bf16 compute copy) a `CopyingAdamW` where it applies; check
    with isinstance: a plain AdamW leaves the copies to be cast again."""
    if cfg.type != "adam":
        raise ValueError(f"optimizer.type {cfg.type!r} is not supported; use 'adam'")
    kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps,
              "weight_decay": cfg.weight_decay, "fused": True}
    params = list(params)
    if (copies is not None and cpu_paths().write_copies_in_step and _kernels() is not None
            and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params)
            and all(c.dtype == torch.bfloat16 for c in copies.values())):
        return CopyingAdamW(params, copies, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


class CopyingAdamW(torch.optim.AdamW):
    """torch's AdamW (its `fused=True` state and update) over fp32 CPU masters, stepped in
    C, each master's bf16 copy in `copies` (by id of the master) written in the same pass.

    The update is torch's fused kernel's, coefficients in double rounded to float once; its
    float32 steps may round differently by an FMA (tests: within a few fp32 roundings of
    torch's). A clip coefficient comes as `grad_scale`, as the fused AdamW takes it
    (trainer/engine.py); `found_inf`, closures, amsgrad and maximize are not taken.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter],
                 copies: Mapping[int, torch.Tensor], **kwargs) -> None:
        super().__init__(params, **kwargs)
        if any(g["amsgrad"] or g["maximize"] for g in self.param_groups):
            raise ValueError("CopyingAdamW takes neither amsgrad nor maximize")
        self._copies = dict(copies)
        for group in self.param_groups:
            for p in group["params"]:
                copy = self._copies.get(id(p))
                if copy is not None and (copy.shape != p.shape or not copy.is_contiguous()):
                    raise ValueError(f"the copy of a {tuple(p.shape)} parameter is "
                                     f"{tuple(copy.shape)}, contiguous {copy.is_contiguous()}")

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None or getattr(self, "found_inf", None) is not None:
            raise ValueError("CopyingAdamW.step takes no closure and no found_inf")
        scale = getattr(self, "grad_scale", None)
        scale = 1.0 if scale is None else float(scale)
        for group in self.param_groups:
            lr, (beta1, beta2) = float(group["lr"]), group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if not (grad.dtype == torch.float32 and grad.is_contiguous()
                        and p.is_contiguous()):
                    raise ValueError("CopyingAdamW takes contiguous fp32 parameters and "
                                     "gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = float(state["step"])
                copy = self._copies.get(id(p))
                cores.adjust()  # a server that starts generating mid-step gets its core back
                _kernels().adamw_f32(
                    p.data_ptr(), grad.data_ptr(), state["exp_avg"].data_ptr(),
                    state["exp_avg_sq"].data_ptr(), None if copy is None else copy.data_ptr(),
                    p.numel(), scale, 1.0 - lr * group["weight_decay"], 1.0 - beta1, beta2,
                    1.0 - beta2, lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step),
                    group["eps"], torch.get_num_threads())


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
