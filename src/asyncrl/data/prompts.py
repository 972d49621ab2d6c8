"""Chat prompts: messages from a question (system prompt, few-shot turns) and their tokens.

A few-shot example is a dict {"question": str, "answer": str}: the question becomes a user
turn and the answer an assistant turn, verbatim, so "answer" is the whole reply as the
model should write it, answer format included (e.g. "12 + 30 = 42. <answer>42</answer>").
This is the shape of `WorkflowConfig.few_shot`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)


def build_messages(question: str, *, system_prompt: str | None = None,
                   few_shot: Sequence[dict[str, str]] = ()) -> list[dict[str, str]]:
    """Chat messages: the system prompt, each example as a user/assistant pair, the question."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for i, example in enumerate(few_shot):
        missing = {"question", "answer"} - set(example)
        if missing:
            raise ValueError(f"few_shot[{i}] lacks {sorted(missing)}: each example is "
                             f"{{'question': ..., 'answer': ...}}, got keys {sorted(example)}")
        messages.append({"role": "user", "content": example["question"]})
        messages.append({"role": "assistant", "content": example["answer"]})
    messages.append({"role": "user", "content": question})
    return messages


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], *,
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` under the tokenizer's chat template (generation prompt added)."""
    # transformers 5 returns a dict unless told otherwise.
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, return_dict=False)
    if ids and isinstance(ids[0], list):  # some versions wrap one conversation in a batch
        ids = ids[0]
    return [int(t) for t in ids]


def filter_by_length(items: list[dict[str, Any]], prompt_ids: Callable[[dict[str, Any]], list[int]],
                     max_length: int | None) -> list[dict[str, Any]]:
    """The items whose prompt (as `prompt_ids(item)` encodes it) has at most `max_length` tokens."""
    if max_length is None:
        return items
    kept = [item for item in items if len(prompt_ids(item)) <= max_length]
    if not kept:
        raise ValueError(f"all {len(items)} prompts are longer than max_length={max_length} tokens")
    if len(kept) < len(items):
        logger.info("dropped %d of %d prompts longer than %d tokens",
                    len(items) - len(kept), len(items), max_length)
    return kept
