"""How many KV-cache slots the local engine gets from its share of a GPU's memory.

The cache is static: `slots` x `max_seq_len` positions of keys and values for every layer,
allocated at start (model.py `KVCache`). Without a budget it has `local_engine.max_batch_size`
slots. With `rollout.gpu_memory_fraction` f (a GPU shared with the trainer), the engine may
take f of the GPU's memory for everything it holds:
- its weights twice: the served ones and the spare that a weight update writes into
  (engine.py: the update is prepared off the decode loop and swapped in);
- the transient tensors of one step (`activation_reserve`: a prefill of
  PREFILL_TOKEN_BUDGET tokens, attention scores computed in full, the sampling of a batch);
- the cache, which gets the rest, in whole slots (at most max_batch_size).
The CUDA context (a few hundred MiB per process) is outside torch's allocator and comes on top.
The engine also caps its allocator at f (torch.cuda.set_per_process_memory_fraction), so a
step that needs more than estimated fails in the server instead of taking the trainer's memory.
"""

from __future__ import annotations

import torch

from asyncrl.inference.server.model import ModelConfig

PREFILL_TOKEN_BUDGET = 8192  # padded tokens per prefill forward (engine.py)


def kv_slot_bytes(cfg: ModelConfig, dtype: torch.dtype, max_seq_len: int) -> int:
    """Bytes of one cache slot: keys and values of every layer over `max_seq_len` positions."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * max_seq_len * cfg.head_dim * dtype.itemsize


def activation_reserve(cfg: ModelConfig, dtype: torch.dtype, max_batch_size: int,
                       max_seq_len: int) -> int:
    """Bytes of the largest step's transient tensors (an upper estimate).

    A prefill forward of N = max(PREFILL_TOKEN_BUDGET, max_seq_len) token rows holds, per
    layer at once: the residual and normed stream (2 x hidden), q|k|v and its rotated copy
    (2 x (heads + 2 kv_heads) x head_dim), the attention output and o's product (2 x hidden),
    gate|up and the activation (3 x intermediate), and the attention scores if attention runs
    unfused (heads x N x min(N, max_seq_len)). Sampling a batch holds ~4 float32 copies of its
    logits.
    """
    n = max(PREFILL_TOKEN_BUDGET, max_seq_len)
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_row = 4 * cfg.hidden_size + 2 * qkv + 3 * cfg.intermediate_size
    scores = cfg.num_heads * n * min(n, max_seq_len)
    sampling = 4 * max_batch_size * cfg.vocab_size * 4
    return (n * per_row + scores) * dtype.itemsize + sampling


def kv_budget(fraction: float, total_bytes: int, weights_bytes: int, reserve_bytes: int) -> int:
    """Bytes left for the cache out of `fraction` of `total_bytes`: weights twice, then the
    reserve, come first (may be negative: nothing is left)."""
    return int(fraction * total_bytes) - 2 * weights_bytes - reserve_bytes


def kv_slots(budget_bytes: int, slot_bytes: int, max_batch_size: int, *,
             what: str = "the KV-cache budget") -> int:
    """Whole slots of `slot_bytes` within `budget_bytes`, at most `max_batch_size`.

    ValueError when not even one fits, naming the keys that make room.
    """
    slots = min(max_batch_size, max(budget_bytes, 0) // slot_bytes)
    if slots < 1:
        raise ValueError(
            f"{what} leaves {_size(max(budget_bytes, 0))} for the KV cache, but one slot of "
            f"local_engine.max_seq_len positions needs {_size(slot_bytes)}; raise "
            "rollout.gpu_memory_fraction or lower local_engine.max_seq_len")
    return int(slots)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
