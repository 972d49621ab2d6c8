"""Mixed precision on one rank without FSDP: persistent compute copies of the master weights.

FSDP2 at world size 1 gathers nothing, yet on every step it still casts each layer's fp32
parameters into a fresh flat buffer and copies them out to the unsharded parameters, copies
every gradient through a flat buffer back, and allocates the root group's buffers (the tied
embedding: 57 MB in bf16, 113 MB in fp32) anew, each one page-faulted in again. On the
quickstart's two cores that was ~12% of a training step.

On one rank the model keeps its fp32 master parameters: what the optimiser steps, what state
dicts and checkpoints hold. `ComputeWeights` keeps one persistent copy of each master in the
compute dtype. Inside `active()` the modules hold the copies, refreshed from the masters on
entry where they changed (one cast per step, into the same buffers), unless the optimiser
wrote them as it stepped (`trainer/cpu/optim.py`'s CopyingAdamW, the default on the CPU); such
fresh copies are also what a bf16 publish writes (`fresh`). As soon as a backward has accumulated a
copy's gradient, it is added to its master's fp32 `.grad` and freed: each micro-batch's bf16
gradient summed in fp32, the numbers of FSDP2 with `reduce_dtype=float32`. Tied parameters
(one object under two names) share one copy, so their gradients meet in it as in FSDP.
The fp32 gradients live in buffers kept from step to step: `zero_grad(set_to_none=True)`
drops the `.grad` references only, so the next step writes the same memory instead of
taking fresh pages (the tied embedding's alone is 113 MB, past glibc's heap threshold:
`trainer/cpu/heap.py`).

The tied embedding takes a shorter way (`GradSink`, when `grads_to_master`): the log-prob
head adds its weight gradient into the master's fp32 gradient itself, through one kept
bf16 scratch, and the input embedding's backward adds its rows there with `index_add_`
(`embedding`). Through autograd each micro-batch had built the head's gradient in fp32,
rounded it to bf16, built the lookup's dense [V, H] gradient, summed the two in bf16 and
added that to the master: five fresh embedding-sized tensors per micro-batch, several
hundred ms of a ~4.3 s quickstart-shaped step at one thread in a profile, mostly page
faults. The two uses now meet in fp32 (Megatron's `main_grad`, for the same reason), so
the embedding's gradient differs from FSDP2's by its bf16 roundings and every other
gradient is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from asyncrl.api import cores
from asyncrl.trainer.cpu.grad_ops import add_widened, t_matmul
from asyncrl.trainer.cpu.options import cpu_paths


class GradSink:
    """Adds gradients of one compute copy straight into its master's fp32 `.grad`."""

    def __init__(self, master: nn.Parameter, weights: ComputeWeights, dtype: torch.dtype) -> None:
        self._master, self._weights, self._dtype = master, weights, dtype
        self._scratch: torch.Tensor | None = None

    def add_matmul(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """master.grad += a^T @ b, the product rounded to the compute dtype first (as autograd
        would return it), into a scratch kept from step to step."""
        if self._scratch is None:
            self._scratch = torch.empty(self._master.shape, dtype=self._dtype,
                                        device=self._master.device)
        self._weights._add_to_master(self._master, t_matmul(a, b, out=self._scratch))

    def index_add(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        """master.grad[index] += rows, summed in fp32 (an embedding lookup's gradient)."""
        self._weights._master_grad(self._master).index_add_(0, index, rows.float())


def grad_sink(param: torch.Tensor) -> GradSink | None:
    """The sink of a compute copy whose gradient may skip autograd, else None."""
    return getattr(param, "_asyncrl_grad_sink", None) if cpu_paths().grads_to_master else None


class _EmbeddingToSink(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None,
                sink: GradSink) -> torch.Tensor:
        ctx.ids, ctx.padding_idx, ctx.sink = ids, padding_idx, sink
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, ...]:
        ids, rows = ctx.ids.flatten(), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:  # nn.Embedding gives that row no gradient
            keep = ids != ctx.padding_idx
            ids, rows = ids[keep], rows[keep]
        ctx.sink.index_add(ids, rows)
        return None, None, None, None


def embedding(module: nn.Module, ids: torch.Tensor) -> torch.Tensor | None:
    """`module(ids)` with the weight's gradient going to its sink; None where that does not
    apply (no sink, no gradient wanted, or not a plain `nn.Embedding`): call the module."""
    sink = grad_sink(module.weight) if torch.is_grad_enabled() else None
    if (sink is None or type(module) is not nn.Embedding or module.max_norm is not None
            or module.scale_grad_by_freq or module.sparse):
        return None
    return _EmbeddingToSink.apply(ids, module.weight, module.padding_idx, sink)


class ComputeWeights:
    """Compute-dtype copies of `model`'s parameters, swapped in by `active()`."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self._slots: list[tuple[nn.Module, str, nn.Parameter]] = []
        self._pairs: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(master) -> pair
        self._grads: dict[int, torch.Tensor] = {}  # id(master) -> its fp32 gradient's buffer
        self._seen: dict[int, tuple[int, int]] = {}  # id(master) -> (version, address) cast
        self._stale = True
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
                    copy._asyncrl_grad_sink = GradSink(master, self, dtype)
                self._pairs[id(master)] = (master, copy)

    def invalidate(self) -> None:
        """The masters changed: cast them all on the next `active()`."""
        self._stale = True

    def copies(self) -> dict[int, nn.Parameter]:
        """id of each master that takes a gradient -> its copy, for an optimiser that
        writes the copies as it steps (`trainer/cpu/optim.py`'s CopyingAdamW): those need no
        cast after its steps, so it is not `watch`ed."""
        return {key: copy for key, (master, copy) in self._pairs.items()
                if master.requires_grad}

    def fresh(self) -> dict[int, nn.Parameter] | None:
        """The copies by their masters' data pointers (as a state dict's tensors point), if
        every copy holds its master's current value (cast, or written by the optimiser's
        step, since the master last changed); else None."""
        if self._stale or len(self._seen) != len(self._pairs):
            return None
        out = {}
        for key, (master, copy) in self._pairs.items():
            if self._seen[key] != (master._version, master.data_ptr()):
                return None
            out[master.data_ptr()] = copy
        return out

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Cast again after each step of `optimizer`, which updates the masters."""
        optimizer.register_step_post_hook(lambda *_: self.invalidate())

    @contextmanager
    def active(self) -> Iterator[None]:
        """The modules compute with the copies (refreshed now) until the block ends; run
        the backward inside it, so that gradient checkpointing recomputes with them too."""
        with torch.no_grad():
            for key, (master, copy) in self._pairs.items():
                # Cast again only what may have changed since the last cast: after an
                # optimiser step (`watch`; the fused AdamW leaves version counters alone)
                # or an in-place write such as a state load (it moves the counter). A
                # step's recompute and training forwards then share one cast.
                seen = (master._version, master.data_ptr())
                if self._stale or self._seen.get(key) != seen:
                    # A server that starts generating mid-cast gets its core back at the
                    # next tensor (api/cores.py): the cast is ~80 ms at one thread, but
                    # its threads outnumbering the cores made it ~1 s in the quickstart.
                    cores.adjust()
                    copy.copy_(master)
                    self._seen[key] = seen
                copy.grad = None  # left over only by a backward that failed midway
            self._stale = False
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
        if grad is not None:  # None: the backward sent it to the sink instead
            self._add_to_master(master, grad)

    def _add_to_master(self, master: nn.Parameter, grad: torch.Tensor) -> None:
        if master.grad is not None:
            add_widened(master.grad, grad)
            return
        master.grad = self._buffer(master).copy_(grad)

    def _master_grad(self, master: nn.Parameter) -> torch.Tensor:
        """The master's fp32 gradient, zeros if this step has none yet."""
        if master.grad is None:
            master.grad = self._buffer(master).zero_()
        return master.grad

    def _buffer(self, master: nn.Parameter) -> torch.Tensor:
        buffer = self._grads.get(id(master))
        if buffer is None:
            buffer = self._grads[id(master)] = torch.empty_like(master)
        return buffer
