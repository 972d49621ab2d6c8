"""The attention of the shared-prefix (trie) forward: the decoder's linear layers run on the
real trie nodes as one row [1, N], attention on the packed rows [R, L] under the ancestor mask.

The packed rows carry padding (a row holds whole trees, up to its capacity); computing the
projections and MLPs on it was about an eighth of a quickstart step's work. Here only
attention sees the rows: queries, keys and values are scattered into them, SDPA runs with
the pack's mask, and the output is gathered back to the nodes. Without `trie_slots` (a
padded batch, or a model used elsewhere) it is HF's SDPA attention unchanged.

On the CPU in bf16, a packed row's attention is small (a few hundred keys) and mostly masked,
and SDPA's flash kernel ran its backward at ~75 GFLOP/s, a sixth of a quickstart step. There
the attention runs as two bf16 matmuls around a masked softmax in C
(`kernels/masked_softmax.c`), keeping the probabilities for backward, whose four
matmuls and softmax gradient are written out here: ~2x faster forward and backward together
(`benchmarks/train_step.py`, "attn" column). Its scores are rounded to bf16 once before the
softmax, as SDPA's math path does; flash keeps them in float32, so the two differ by bf16
roundings (tests/unit/trainer/test_trie_attention.py states the tolerance). Where one layer's
probabilities would pass `MATMUL_ATTENTION_BYTES` (long rows), flash runs as before.

On that path q, k and v go to the rows, and the output back to the nodes, in C as well
(`_ToRows`, `_RowsToNodes`): one pass per tensor each way, into rows laid out as the matmuls
read them. torch's moves (a zero fill, an index_copy and a transposing copy per tensor, the
same backward) were ~0.15 s of a quickstart-shaped step at one thread; A/B in separate
processes, alternated: step 4.13-4.45 vs 4.37-4.53 s (`cpu_paths().attention_moves_in_c`).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
from torch import nn

from asyncrl import kernels
from asyncrl.trainer.cpu.options import cpu_paths

NAME = "asyncrl_trie"
# The most bytes of bf16 probabilities [R, H, L, L] one layer may keep for backward on the
# matmul path (the quickstart's rows: ~3.5 MB); larger packs take flash, which keeps none.
MATMUL_ATTENTION_BYTES = 32 << 20


@functools.cache
def _kernels() -> ctypes.CDLL | None:
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    return kernels.bind("masked_softmax", {
        "masked_softmax_fwd_bf16": [p, p, i32, i32, i32, f32, p, i32],
        "masked_softmax_bwd_bf16": [p, p, i32, i32, f32, p, i32],
        "nodes_to_rows_16": [p, i64, i64, p, i32, i32, i32, i32, p, i32],
        "rows_to_nodes_16": [p, p, i32, i32, i32, i32, p, i32]})


def _matmul_path(q: torch.Tensor, mask: torch.Tensor, rows: int, width: int) -> bool:
    """Whether queries q [1, H, N, D] on the nodes take the matmul path on [R, L] rows."""
    heads = q.shape[1]
    return (cpu_paths().matmul_attention and q.device.type == "cpu" and q.dtype == torch.bfloat16
            and mask.dtype == torch.bool and mask.shape[1] == 1
            and 2 * rows * heads * width * width <= MATMUL_ATTENTION_BYTES
            and _kernels() is not None)


class _MatmulAttention(torch.autograd.Function):
    """softmax(scale q k^T, masked) v for q [R, H, L, D], k and v [R, KV, L, D] (query head h
    reads key head h // (H / KV)), mask [R, 1, L, L] bool; returns [R, H, L, D]."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor, scale: float) -> torch.Tensor:
        rows, heads, width, dim = q.shape
        kv = k.shape[1]
        # the query heads of one key head as one matrix: [R, KV, g * L, D]
        qg = q.reshape(rows, kv, heads // kv * width, dim)
        scores = torch.matmul(qg, k.transpose(-1, -2))  # [R, KV, g * L, L] = [R, H, L, L]
        probs = torch.empty_like(scores)
        allowed = mask.contiguous().view(torch.uint8)
        _kernels().masked_softmax_fwd_bf16(scores.data_ptr(), allowed.data_ptr(), rows, heads,
                                           width, scale, probs.data_ptr(),
                                           torch.get_num_threads())
        del scores
        ctx.save_for_backward(qg, k, v, probs)
        ctx.scale, ctx.q_shape = scale, q.shape
        return torch.matmul(probs, v).view(rows, heads, width, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        qg, k, v, probs = ctx.saved_tensors
        grad = grad.reshape(qg.shape)  # [R, KV, g * L, D]
        grad_v = torch.matmul(probs.transpose(-1, -2), grad)  # sums over the g query heads
        grad_scores = torch.matmul(grad, v.transpose(-1, -2)).contiguous()
        _kernels().masked_softmax_bwd_bf16(probs.data_ptr(), grad_scores.data_ptr(),
                                           probs.numel() // probs.shape[-1], probs.shape[-1],
                                           ctx.scale, grad_scores.data_ptr(),
                                           torch.get_num_threads())
        grad_q = torch.matmul(grad_scores, k).view(ctx.q_shape)
        grad_k = torch.matmul(grad_scores.transpose(-1, -2), qg)
        return grad_q, grad_k, grad_v, None, None


def trie_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: torch.Tensor | None,
                   trie_slots: torch.Tensor | None = None,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF's attention-function signature: query [1, H, N, D], key/value [1, KV, N, D] on the
    nodes; returns [1, N, H, D]. `trie_slots` and the [R, 1, L, L] mask come from
    `PrefixPack.model_inputs`. Dropout is not applied (the trainer refuses models with it)."""
    if trie_slots is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1 or attention_mask is None or attention_mask.dim() != 4:
        raise ValueError("trie attention takes the nodes as one row and the pack's 4D mask "
                         "(PrefixPack.model_inputs)")
    rows, width = attention_mask.shape[0], attention_mask.shape[-1]
    scale = kwargs.get("scaling")
    matmul = _matmul_path(query, attention_mask, rows, width)
    if matmul and cpu_paths().attention_moves_in_c:
        slots = trie_slots.to(torch.long).contiguous()
        node_of = torch.full((rows * width,), -1, dtype=torch.long).index_copy_(
            0, slots, torch.arange(len(slots)))
        q, k, v = (_ToRows.apply(x, slots, node_of, rows, width) for x in (query, key, value))
        out = _MatmulAttention.apply(q, k, v, attention_mask,
                                     q.shape[-1] ** -0.5 if scale is None else scale)
        return _RowsToNodes.apply(out, slots, node_of)[None], None  # [1, N, H, D]
    q, k, v = (_to_rows(x, trie_slots, rows, width) for x in (query, key, value))
    if matmul:
        out = _MatmulAttention.apply(q, k, v, attention_mask,
                                     q.shape[-1] ** -0.5 if scale is None else scale)
    else:
        # Grouped-query attention by SDPA itself: HF would repeat the keys and values per
        # query head first (copies, and a sum over the copies in backward).
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1])
    return _FromRows.apply(out, trie_slots)[None], None  # [1, N, H, D]


def _rows_to_nodes(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[R, H, L, D] contiguous on the packed rows -> [N, H, D] contiguous at the slots (C)."""
    _, heads, width, dim = x.shape
    out = x.new_empty(len(slots), heads, dim)
    _kernels().rows_to_nodes_16(x.data_ptr(), slots.data_ptr(), len(slots), heads, width, dim,
                                out.data_ptr(), torch.get_num_threads())
    return out


def _nodes_to_rows(x: torch.Tensor, node_of: torch.Tensor, rows: int,
                   width: int) -> torch.Tensor:
    """[N, H, D] on the nodes (D contiguous) -> [R, H, L, D] contiguous, 0 on padding (C)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    heads, dim = x.shape[1], x.shape[2]
    out = x.new_empty(rows, heads, width, dim)
    _kernels().nodes_to_rows_16(x.data_ptr(), x.stride(0), x.stride(1), node_of.data_ptr(),
                                rows, heads, width, dim, out.data_ptr(),
                                torch.get_num_threads())
    return out


class _ToRows(torch.autograd.Function):
    """[1, H, N, D] on the nodes -> [R, H, L, D] contiguous on the packed rows, 0 on padding;
    backward gathers the nodes' gradients back (node-major, as HF's q, k and v are laid)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, slots: torch.Tensor, node_of: torch.Tensor,
                rows: int, width: int) -> torch.Tensor:
        ctx.save_for_backward(slots)
        return _nodes_to_rows(x[0].transpose(0, 1), node_of, rows, width)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (slots,) = ctx.saved_tensors
        nodes = _rows_to_nodes(grad.contiguous(), slots)  # [N, H, D]
        return nodes.transpose(0, 1)[None], None, None, None, None


class _RowsToNodes(torch.autograd.Function):
    """[R, H, L, D] on the packed rows -> [N, H, D] at the nodes' slots (`_FromRows` in C)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, slots: torch.Tensor,
                node_of: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(node_of)
        ctx.rows, ctx.width = x.shape[0], x.shape[2]
        return _rows_to_nodes(x.contiguous(), slots)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (node_of,) = ctx.saved_tensors
        return _nodes_to_rows(grad, node_of, ctx.rows, ctx.width), None, None


def _to_rows(x: torch.Tensor, slots: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """[1, H, N, D] on the nodes -> [R, H, L, D] on the packed rows, 0 on padding."""
    heads, dim = x.shape[1], x.shape[-1]
    flat = x.new_zeros(rows * width, heads, dim).index_copy(0, slots, x[0].transpose(0, 1))
    return flat.view(rows, width, heads, dim).transpose(1, 2)


class _FromRows(torch.autograd.Function):
    """[R, H, L, D] on the packed rows -> [N, H, D] at the nodes' (distinct) flat slots.

    The gather's backward writes each node's gradient to its slot with index_copy; autograd's
    for `x[slots]` is an accumulating index_put (sort-based, for repeated indices), which took
    ~1 ms per layer here for what a copy does in a fifth of that."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        rows, heads, width, dim = x.shape
        ctx.save_for_backward(slots)
        ctx.x_shape = x.shape
        return x.transpose(1, 2).reshape(rows * width, heads, dim).index_select(0, slots)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (slots,) = ctx.saved_tensors
        rows, heads, width, dim = ctx.x_shape
        full = grad.new_zeros(rows * width, heads, dim).index_copy_(0, slots, grad)
        return full.view(rows, width, heads, dim).transpose(1, 2), None


def use_trie_attention(hf_model: nn.Module) -> None:
    """Make `hf_model` (an SDPA model) use the trie attention; registers it with HF."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, trie_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # padded batches: SDPA's mask
    if hf_model.config._attn_implementation != NAME:
        hf_model.set_attn_implementation(NAME)
