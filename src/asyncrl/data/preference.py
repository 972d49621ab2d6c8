"""Preference pairs for reward-model training: JSONL rows rendered by the chat template.

A row is {"prompt", "chosen", "rejected"}. The prompt is a string (one user turn) or a
list of chat messages; chosen and rejected are strings (one assistant turn) or message
lists that continue the prompt. Without a prompt, chosen and rejected are whole
conversations (TRL's implicit-prompt form). Each side is rendered with the tokenizer's chat
template, so an RL completion scored as [user: question, assistant: completion] is seen
exactly as in training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from asyncrl.api.types import TensorBatch
from asyncrl.config.rm import PreferenceDatasetConfig
from asyncrl.data.loading import DatasetError
from asyncrl.models.reward import encode_conversation

ROLES = ("system", "user", "assistant", "tool")
Messages = list[dict[str, str]]
Pair = tuple[list[int], list[int]]  # token ids of (chosen, rejected)


def _messages(value: Any, role: str, what: str) -> Messages:
    """A string as one `role` turn, or a checked list of {"role", "content"} messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{what} must be a string or a non-empty list of messages, "
                         f"got {type(value).__name__}")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and m.get("role") in ROLES
                and isinstance(m.get("content"), str)):
            raise ValueError(f"{what}[{i}] must be {{'role': one of {ROLES}, 'content': str}}, "
                             f"got {m!r}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def row_conversations(row: dict[str, Any]) -> tuple[Messages, Messages]:
    """The (chosen, rejected) conversations of one preference row."""
    missing = {"chosen", "rejected"} - set(row)
    if missing:
        raise ValueError(f"missing {sorted(missing)}: a row is {{'prompt', 'chosen', "
                         f"'rejected'}}, got keys {sorted(row)}")
    if "prompt" in row:
        prompt = _messages(row["prompt"], "user", "prompt")
    elif isinstance(row["chosen"], list) and isinstance(row["rejected"], list):
        prompt = []  # whole conversations
    else:
        raise ValueError("no 'prompt': chosen and rejected must then be whole conversations "
                         "(message lists)")
    return (prompt + _messages(row["chosen"], "assistant", "chosen"),
            prompt + _messages(row["rejected"], "assistant", "rejected"))


def load_preference_pairs(cfg: PreferenceDatasetConfig, tokenizer: Any) -> list[Pair]:
    """Tokenised (chosen, rejected) pairs of `cfg.path`; a bad row is an error naming file:line."""
    path = Path(cfg.path).expanduser()
    if not path.is_file():
        raise DatasetError(f"preference dataset {cfg.path!r} is not a file (JSONL of "
                           "prompt/chosen/rejected rows)")
    pairs: list[Pair] = []
    n_rows = 0
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            n_rows += 1
            if cfg.size is not None and n_rows > cfg.size:
                break
            try:
                chosen, rejected = row_conversations(json.loads(line))
            except (ValueError, AttributeError, TypeError) as e:
                raise DatasetError(f"{path}:{lineno}: {e}") from None
            pair = (encode_conversation(tokenizer, chosen),
                    encode_conversation(tokenizer, rejected))
            if cfg.max_length is None or max(map(len, pair)) <= cfg.max_length:
                pairs.append(pair)
    if not pairs:
        raise DatasetError(f"{path}: no pairs (empty, or every pair is longer than "
                           f"max_length={cfg.max_length})")
    return pairs


def collate_pairs(pairs: list[Pair], pad_token_id: int) -> TensorBatch:
    """Right-padded rows chosen_0, rejected_0, chosen_1, ...; loss_mask marks the last token.

    The last real token is where the reward model reads its score, so that is the one token
    of each row any loss reads.
    """
    rows = [ids for pair in pairs for ids in pair]
    n, width = len(rows), max(map(len, rows))
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.bool)
    loss_mask = torch.zeros((n, width))
    for i, ids in enumerate(rows):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention_mask[i, :len(ids)] = True
        loss_mask[i, len(ids) - 1] = 1.0
    return TensorBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                       behavior_logprobs=torch.zeros((n, width)),
                       versions=torch.full((n, width), -1, dtype=torch.long),
                       rewards=torch.zeros(n))
