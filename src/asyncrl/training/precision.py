"""Mixed precision on one rank without FSDP: persistent compute copies of the master weights.

FSDP2 at world size 1 gathers nothing, yet on every step it still casts each layer's fp32
parameters into a fresh flat buffer and copies them out to the unsharded parameters, copies
every gradient through a flat buffer back, and allocates the root group's buffers (the tied
embedding: 57 MB in bf16, 113 MB in fp32) anew, each one page-faulted in again. On the
quickstart's two cores that was ~12% of a training step.

On one rank the model keeps its fp32 master parameters: what the optimiser steps, what state
dicts and checkpoints hold. `ComputeWeights` keeps one persistent copy of each master in the
compute dtype. Inside `active()` the modules hold the copies, refreshed from the masters on
entry (one cast per step, into the same buffers). As soon as a backward has accumulated a
copy's gradient, it is added to its master's fp32 `.grad` and freed: each micro-batch's bf16
gradient summed in fp32, the numbers of FSDP2 with `reduce_dtype=float32`. Tied parameters
(one object under two names) share one copy, so their gradients meet in it as in FSDP.
The fp32 gradients live in buffers kept from step to step: `zero_grad(set_to_none=True)`
drops the `.grad` references only, so the next step writes the same memory instead of
taking fresh pages (the tied embedding's alone is 113 MB, past glibc's heap threshold:
`training/heap.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn


class ComputeWeights:
    """Compute-dtype copies of `model`'s parameters, swapped in by `active()`."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self._slots: list[tuple[nn.Module, str, nn.Parameter]] = []
        self._pairs: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(master) -> pair
        self._grads: dict[int, torch.Tensor] = {}  # id(master) -> its fp32 gradient's buffer
        for module in model.modules():
            for name, master in module._parameters.items():
                if master is None:
                    continue
                self._slots.append((module, name, master))
                if id(master) in self._pairs:
                    continue  # a tied alias: one copy for both names
                copy = nn.Parameter(torch.empty_like(master, dtype=dtype),
                                    requires_grad=master.requires_grad)
                if master.requires_grad:
                    copy.register_post_accumulate_grad_hook(partial(self._to_master, master))
                self._pairs[id(master)] = (master, copy)

    @contextmanager
    def active(self) -> Iterator[None]:
        """The modules compute with the copies (refreshed now) until the block ends; run
        the backward inside it, so that gradient checkpointing recomputes with them too."""
        with torch.no_grad():
            for master, copy in self._pairs.values():
                copy.copy_(master)
                copy.grad = None  # left over only by a backward that failed midway
        for module, name, master in self._slots:
            module._parameters[name] = self._pairs[id(master)][1]
        try:
            yield
        finally:
            for module, name, master in self._slots:
                module._parameters[name] = master

    def _to_master(self, master: nn.Parameter, copy: nn.Parameter) -> None:
        """Move the copy's gradient of one backward into its master's fp32 gradient."""
        grad, copy.grad = copy.grad, None
        if master.grad is not None:
            master.grad.add_(grad)
            return
        buffer = self._grads.get(id(master))
        if buffer is None:
            buffer = self._grads[id(master)] = torch.empty_like(master)
        master.grad = buffer.copy_(grad)
