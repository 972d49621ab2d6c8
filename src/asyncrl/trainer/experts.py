"""Expert parallelism for the train engine: `actor.backend: fsdp:d<M>e<E>`.

The world's M x E ranks form a (dp, ep) mesh; every rank takes its own rows of the batch
(data parallel over all of them). Each MoE layer's experts (HF's fused experts module,
3-D `gate_up_proj` / `down_proj` stacked over experts) are split over the E ranks of an
expert group: rank j of the group holds experts j*N/E .. (j+1)*N/E - 1, a DTensor sharded on
the "ep" dimension, which FSDP2 then shards over the M ranks that hold the same experts
("dp"). Every other parameter is FSDP2-sharded over the whole world, as without experts
split.

The MoE block on a rank runs its own router on its own tokens (routing replay and the
load-balancing loss act there, unchanged). Its experts module then all-gathers the group's
tokens, their chosen experts and routing weights, computes what its own experts add to
every gathered token (HF's own experts implementation, on the local experts, other experts
as its expert-parallel sentinel), and a reduce-scatter sums the ranks' parts, each rank
receiving its own tokens' rows. A token's output is thus the sum, over its top-k experts,
of weight x expert(token), as on one rank; with top_k 2 at most two parts are non-zero and
the sum is the same floating-point sum (adding an exact zero changes nothing). All-gather
and reduce-scatter need no per-destination token counts and run the same on gloo and NCCL;
an all-to-all that sends each token only to the ranks holding its experts (gloo has one in
torch 2.13, older versions had not) would move fewer bytes, and is not what this does.

Gradients: the backward of the all-gather is a reduce-scatter of the gathered rows'
gradients (each rank's tokens get what every rank's experts sent back), the backward of the
sum is an all-gather, so an expert's gradient comes from every token of the group routed to
it, and only on the rank that holds it; FSDP2 sums it over the M ranks holding the same
experts and sums every other gradient over the world.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from asyncrl.config.allocation import check_expert_split

# The fused-experts parameters HF's Qwen3-MoE (and its kin) stack over experts, dim 0.
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def is_experts(module: nn.Module) -> bool:
    """Whether `module` is HF's fused experts module (3-D weights stacked over experts)."""
    n = getattr(module, "num_experts", None)
    return isinstance(n, int) and all(
        isinstance(getattr(module, name, None), nn.Parameter)
        and getattr(module, name).dim() == 3 and getattr(module, name).shape[0] == n
        for name in EXPERT_PARAMS)


def check_model(hf_model: nn.Module, expert: int) -> int:
    """The number of experts per MoE layer; raises, naming the sizes, unless `expert` ranks
    can split them evenly."""
    modules = [m for m in hf_model.modules() if is_experts(m)]
    kind = getattr(hf_model.config, "model_type", type(hf_model).__name__)
    n = modules[0].num_experts if modules else 0
    check_expert_split(n, expert, kind)
    return n


def apply_expert_parallel(hf_model: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Split every experts module of `hf_model` over `ep_mesh` (in place); returns how many."""
    size = ep_mesh.size()
    check_model(hf_model, size)
    group = ep_mesh.get_group()
    count = 0
    for module in hf_model.modules():
        if not is_experts(module):
            continue
        for name in EXPERT_PARAMS:
            param = getattr(module, name)
            split = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            setattr(module, name, nn.Parameter(split, requires_grad=param.requires_grad))
        module.forward = functools.partial(_expert_parallel_forward, module, group)
        count += 1
    return count


class _LocalExperts:
    """What HF's experts implementations read of the module, with this rank's experts as
    plain tensors: `num_experts` local, ids at or above it HF's expert-parallel sentinels."""

    def __init__(self, module: nn.Module, n_local: int) -> None:
        self._module = module
        self.num_experts = n_local
        self._is_expert_parallel = True
        for name in EXPERT_PARAMS:
            value = getattr(module, name)
            setattr(self, name, value.to_local() if isinstance(value, DTensor) else value)

    def __getattr__(self, name: str) -> Any:  # config, act_fn, has_gate, is_transposed...
        return getattr(self._module, name)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        return type(self._module)._apply_gate(self, gate_up)


def _expert_parallel_forward(module: nn.Module, group: Any, hidden_states: torch.Tensor,
                             top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's output on this rank's tokens, its experts split over `group`."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    n_local = module.num_experts // size
    counts = _row_counts(hidden_states.shape[0], hidden_states.device, group)
    x, weights = _GatherRows.apply(hidden_states, top_k_weights, counts, group)
    ids = _gather(top_k_index, counts, group)
    local = ids - rank * n_local
    local = torch.where((local >= 0) & (local < n_local), local, n_local)  # others: sentinel
    out = type(module).forward(_LocalExperts(module, n_local), x, local, weights)
    # Keeps the gathered rows in the graph when none of them reached a local expert, so
    # every rank runs the gather's backward (a collective) in step.
    out = out + (x[:0].sum() + weights[:0].sum()).to(out.dtype)
    return _SumOwnRows.apply(out, counts, group)


def _row_counts(n: int, device: torch.device, group: Any) -> list[int]:
    """Every rank's number of rows, in group order."""
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    counts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, mine, group=group)
    return [int(c) for c in counts]


def _gather(rows: torch.Tensor, counts: list[int], group: Any) -> torch.Tensor:
    """The group's `rows` in rank order (all-gather of rows padded to the largest count)."""
    most = max(counts)
    padded = rows.new_zeros((most, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:n] for part, n in zip(parts, counts)])


def _sum_own_rows(full: torch.Tensor, counts: list[int], group: Any) -> torch.Tensor:
    """This rank's rows of `full` (the group's rows, in rank order) summed over the ranks: a
    reduce-scatter of each rank's rows padded to the largest count."""
    most, rank = max(counts), dist.get_rank(group)
    padded = full.new_zeros((len(counts), most, *full.shape[1:]))
    start = 0
    for i, n in enumerate(counts):
        padded[i, :n] = full[start:start + n]
        start += n
    out = torch.empty_like(padded[0])
    dist.reduce_scatter(out, list(padded.unbind(0)), group=group)
    return out[:counts[rank]]


class _GatherRows(torch.autograd.Function):
    """Forward: the group's hidden rows and routing weights; backward: each rank's rows'
    gradients summed over every rank's experts."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weights: torch.Tensor, counts: list[int],
                group: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.counts, ctx.group = counts, group
        return _gather(x, counts, group), _gather(weights, counts, group)

    @staticmethod
    def backward(ctx: Any, grad_x: torch.Tensor, grad_w: torch.Tensor) -> tuple[Any, ...]:
        return (_sum_own_rows(grad_x, ctx.counts, ctx.group),
                _sum_own_rows(grad_w, ctx.counts, ctx.group), None, None)


class _SumOwnRows(torch.autograd.Function):
    """Forward: the ranks' parts summed, this rank's rows of it; backward: every rank's
    rows' gradients, gathered (each part reached every rank's tokens)."""

    @staticmethod
    def forward(ctx: Any, parts: torch.Tensor, counts: list[int], group: Any) -> torch.Tensor:
        ctx.counts, ctx.group = counts, group
        # A copy, not a view: FSDP2 warns that an in-place op on a module's view output
        # would skip its pre-backward hook.
        return _sum_own_rows(parts, counts, group).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _gather(grad.contiguous(), ctx.counts, ctx.group), None, None
