"""A reward model as HF stores it: a one-label sequence classifier over a chat conversation.

The model is an HF `...ForSequenceClassification` with `num_labels=1`, the class TRL's
RewardTrainer trains and `pipeline("text-classification")` loads, with `pad_token_id` set
in its config (HF pools the score at the last non-pad token). Here the score is read at the
last real token by the attention mask: the same token for right-padded rows, whichever id
the pad is. Training (`asyncrl rm`) and scoring in RL (`workflow.reward_fn: reward_model`)
render a conversation with the same `encode_conversation`, so they see the same tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def encode_conversation(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a whole conversation under the chat template (no generation prompt)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat "
                         "template; a reward model scores chat-rendered conversations")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True,
                                        return_dict=False)
    if ids and isinstance(ids[0], list):  # some versions wrap one conversation in a batch
        ids = ids[0]
    return [int(t) for t in ids]


def last_token_scores(hf_model: nn.Module, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] fp32: the score head on the hidden state of each row's last real token."""
    hidden = hf_model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                 use_cache=False).last_hidden_state
    last = attention_mask.long().sum(-1) - 1  # rows are right-padded
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    return hf_model.score(hidden[rows, last]).float()[:, 0]


def load_reward_model(path: str, *, from_scratch: bool = False) -> nn.Module:
    """An HF one-label sequence classifier from `path` (an LM gets a fresh, seeded head)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(path, num_labels=1)
    if config.pad_token_id is None:  # HF's own pooling needs it (TRL sets it the same way)
        config.pad_token_id = AutoTokenizer.from_pretrained(path).pad_token_id
    if from_scratch:
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(path, config=config,
                                                                   dtype=torch.float32)
    if not isinstance(getattr(model, "score", None), nn.Linear):
        raise ValueError(f"{type(model).__name__} (from {path}) has no `score` head; use a "
                         "decoder model (Llama, Qwen2, Qwen3, ...) for the reward model")
    # An LM's config names its causal-LM class; the saved reward model must name its own.
    model.config.architectures = [type(model).__name__]
    return model
