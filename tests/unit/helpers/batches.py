"""TensorBatches for unit tests: hand-written per-token values, or random padded rows; and
trajectories of chat prompts with images."""

from typing import Any

import torch

from asyncrl.api import TensorBatch, Trajectory


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


def image_trajectory(prompts: Any, messages: list[dict], images: list, output: list[int], *,
                     reward: float = 0.0, group_id: str = "g0") -> Trajectory:
    """The chat prompt of `messages` with `images` (PIL; none: a text prompt) through a
    model's `load_image_prompts(...)`, then the fixed `output`; behaviour log-probs 0."""
    tok = prompts.processor.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if images:
        prompt, inputs = prompts.encode(text, images)
    else:
        prompt, inputs = tok.encode(text, add_special_tokens=False), None
    n = len(prompt) + len(output)
    return Trajectory(input_ids=prompt + output, loss_mask=[0] * len(prompt) + [1] * len(output),
                      behavior_logprobs=[0.0] * n, versions=[-1] * len(prompt) + [0] * len(output),
                      reward=reward, group_id=group_id, images=inputs)
