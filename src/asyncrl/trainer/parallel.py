"""Tensor parallelism for the train engine: the (dp, tp) device mesh of `actor.backend:
fsdp:d<M>t<S>`, the tensor-parallel plan of HF llama / qwen2 / qwen3 decoder layers, and the
gradient norm over parameters of both meshes.

Within a tensor group of S ranks every rank sees the same rows; each holds 1/S of every
attention and MLP projection (`torch.distributed.tensor.parallel`): q, k, v, gate and up
split by output features (ColwiseParallel), o and down by input features (RowwiseParallel),
so each rank computes its own heads and its slice of the MLP, and one all-reduce after o
and after down gives every rank the layer's whole output. Qwen3's q_norm / k_norm act on
each head alone: they run on the rank's heads with a replicated weight, whose gradient is
summed over the group (SequenceParallel over the heads dimension). Embeddings, the layer
norms and the output head stay whole on every rank of the group, so the log-prob head
reads plain tensors. FSDP2 then shards every parameter over the M data-parallel groups
(the mesh's `dp` dimension), as it does without tensor parallelism.

Under tensor parallelism the CPU speed paths that replace the modules' own forwards
(`trainer/cpu/`: fused norms, MLPs, rotary embedding, contiguous linears) are off: they
read the weights as plain tensors, which split weights are not. The log-prob head's
kernels stay on (their inputs are whole), and so do the C gradient norm and the clip in
AdamW where their plain-tensor checks pass (they never do for sharded gradients).
The trie attention (`shared_prefix`) is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from asyncrl.config.allocation import check_tensor_split, parse_train_backend


@dataclass(frozen=True)
class Layout:
    """How the world's ranks are arranged: `data` groups of `tensor` ranks, rank r in data
    group r // tensor (the (dp, tp) mesh's row-major order); or `data` groups of `expert`
    ranks (the (dp, ep) mesh, `trainer/experts.py`), every rank with rows of its own."""

    data: int
    tensor: int = 1
    expert: int = 1

    @classmethod
    def of(cls, backend: str | None, world_size: int) -> Layout:
        """The layout of `backend` ("fsdp:d<M>t<S>" or "fsdp:d<M>e<E>"; None: data parallel
        over the world)."""
        if backend is None:
            return cls(world_size)
        layout = parse_train_backend(backend)
        if layout.world_size != world_size:
            sizes = " x ".join(str(n) for n in (layout.data, *(n for n in layout[1:] if n > 1)))
            raise ValueError(f"actor.backend={backend!r} asks for {sizes} = "
                             f"{layout.world_size} trainer ranks but this world has "
                             f"{world_size} (WORLD_SIZE); start that many ranks or change "
                             "actor.backend")
        return cls(*layout)

    @property
    def tensor_parallel(self) -> bool:
        return self.tensor > 1

    @property
    def expert_parallel(self) -> bool:
        return self.expert > 1

    @property
    def batch_groups(self) -> int:
        """How many groups of ranks take rows of their own (a tensor group shares its rows)."""
        return self.data * self.expert

    def data_rank(self, rank: int) -> int:
        """The group of global rank `rank` among the `batch_groups`."""
        return rank // self.tensor


def make_mesh(device_type: str, layout: Layout) -> DeviceMesh:
    """The ("dp", "tp") or ("dp", "ep") mesh of `layout`, else a 1-D ("dp",) one."""
    if layout.tensor_parallel:
        return init_device_mesh(device_type, (layout.data, layout.tensor),
                                mesh_dim_names=("dp", "tp"))
    if layout.expert_parallel:
        return init_device_mesh(device_type, (layout.data, layout.expert),
                                mesh_dim_names=("dp", "ep"))
    return init_device_mesh(device_type, (layout.data,), mesh_dim_names=("dp",))


def data_group(mesh: DeviceMesh | None, layout: Layout) -> Any:
    """The process group of the ranks whose rows together make the batch (None: the
    default group, which it is unless tensor groups share rows)."""
    if mesh is None or not layout.tensor_parallel:
        return None
    return mesh["dp"].get_group()


def check_model(config: Any, tensor: int) -> None:
    """Raise, naming the sizes, unless `tensor` ranks can split this model's layers evenly."""
    check_tensor_split(getattr(config, "model_type", None),
                       {"num_attention_heads": config.num_attention_heads,
                        "num_key_value_heads": config.num_key_value_heads,
                        "intermediate_size": config.intermediate_size}, tensor)


def layer_plan(layer: nn.Module) -> dict[str, Any]:
    """The tensor-parallel plan of one HF decoder layer (names relative to it)."""
    plan: dict[str, Any] = {
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for norm in ("q_norm", "k_norm"):  # qwen3: per head, on [B, T, heads, head_dim]
        if hasattr(layer.self_attn, norm):
            plan[f"self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def apply_tensor_parallel(hf_model: nn.Module, mesh: DeviceMesh) -> None:
    """Split every decoder layer of `hf_model` over the mesh's "tp" ranks (in place)."""
    tp_mesh = mesh["tp"]
    check_model(hf_model.config, tp_mesh.size())
    for layer in hf_model.get_decoder().layers:
        parallelize_module(layer, tp_mesh, layer_plan(layer))


def _by_mesh(tensors: list[torch.Tensor], key: Any = None) -> dict[Any, list[torch.Tensor]]:
    """`tensors` grouped by the mesh of `key(t)` (None for plain tensors), in order."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        of = t if key is None else key(t)
        groups.setdefault(of.device_mesh if isinstance(of, DTensor) else None, []).append(t)
    return groups


def clip_grads_with_norm_(params: list[torch.Tensor], max_norm: float,
                          norm: torch.Tensor) -> None:
    """torch's clip_grads_with_norm_ (grads scaled by max_norm / (norm + 1e-6) if below 1),
    one mesh at a time: its foreach multiply takes DTensors of one mesh only."""
    for group in _by_mesh(params, key=lambda p: p.grad).values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all `grads` together, fp32 and whole on every rank, also when they are
    DTensors of different meshes (tensor-split weights on (dp, tp), the others on dp), which
    torch's get_total_norm cannot stack into one tensor."""
    by_mesh = _by_mesh(grads)
    if len(by_mesh) <= 1:
        norm = torch.nn.utils.get_total_norm(grads)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    squares = 0.0
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares += float(norm.double()) ** 2
    return torch.tensor(math.sqrt(squares), dtype=torch.float32, device=grads[0].device)
