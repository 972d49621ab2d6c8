"""TensorBatches for unit tests: hand-written per-token values, or random padded rows."""

import torch

from asyncrl.api import TensorBatch


def hand_batch(rewards, loss_mask, **per_token) -> TensorBatch:
    """A batch of the given rewards and loss mask; `per_token` sets [B, T] float fields."""
    loss_mask = torch.tensor(loss_mask, dtype=torch.float32)
    shape = loss_mask.shape
    fields = dict(input_ids=torch.zeros(shape, dtype=torch.long),
                  attention_mask=torch.ones(shape, dtype=torch.bool), loss_mask=loss_mask,
                  behavior_logprobs=torch.zeros(shape),
                  versions=torch.zeros(shape, dtype=torch.long),
                  rewards=torch.tensor(rewards, dtype=torch.float32))
    fields.update({k: torch.tensor(v, dtype=torch.float32) for k, v in per_token.items()})
    return TensorBatch(**fields)


def random_batch(seed: int = 0, lengths=(12, 7, 10, 5), prompt_len: int = 3) -> TensorBatch:
    """Right-padded random rows; the tokens after `prompt_len` are loss tokens."""
    g = torch.Generator().manual_seed(seed)
    n, width = len(lengths), max(lengths)
    input_ids = torch.randint(3, 250, (n, width), generator=g)
    attention_mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    input_ids[~attention_mask] = 0
    loss_mask = (attention_mask & (torch.arange(width)[None, :] >= prompt_len)).float()
    return TensorBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                       behavior_logprobs=torch.zeros(n, width),
                       versions=torch.zeros(n, width, dtype=torch.long), rewards=torch.zeros(n))
