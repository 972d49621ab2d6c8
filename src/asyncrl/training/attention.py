"""The attention of the shared-prefix (trie) forward: the decoder's linear layers run on the
real trie nodes as one row [1, N], attention on the packed rows [R, L] under the ancestor mask.

The packed rows carry padding (a row holds whole trees, up to its capacity); computing the
projections and MLPs on it was about an eighth of a quickstart step's work. Here only
attention sees the rows: queries, keys and values are scattered into them, SDPA runs with
the pack's mask, and the output is gathered back to the nodes. Without `trie_slots` (a
padded batch, or a model used elsewhere) it is HF's SDPA attention unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NAME = "asyncrl_trie"


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
    q, k, v = (_to_rows(x, trie_slots, rows, width) for x in (query, key, value))
    # Grouped-query attention by SDPA itself: HF would repeat the keys and values per query
    # head first (copies, and a sum over the copies in backward).
    out = nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=attention_mask, scale=kwargs.get("scaling"),
        enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).flatten(0, 1)[trie_slots][None], None  # [1, N, H, D]


def _to_rows(x: torch.Tensor, slots: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """[1, H, N, D] on the nodes -> [R, H, L, D] on the packed rows, 0 on padding."""
    heads, dim = x.shape[1], x.shape[-1]
    flat = x.new_zeros(rows * width, heads, dim).index_copy(0, slots, x[0].transpose(0, 1))
    return flat.view(rows, width, heads, dim).transpose(1, 2)


def use_trie_attention(hf_model: nn.Module) -> None:
    """Make `hf_model` (an SDPA model) use the trie attention; registers it with HF."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, trie_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # padded batches: SDPA's mask
    if hf_model.config._attn_implementation != NAME:
        hf_model.set_attn_implementation(NAME)
