"""Rewards for reasoning-gym tasks, scored by each task's own scorer.

Answer format: the content of the last `<answer>...</answer>` in the completion, the
convention of reasoning-gym's own prompts (our prompts teach it with a one-shot example).
A completion without the tags scores 0.0: the format is part of what is learned.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import reasoning_gym
from reasoning_gym.utils import extract_answer


@functools.lru_cache(maxsize=None)
def _scorer(task: str) -> Callable[[str | None, dict[str, Any]], float]:
    # get_score_answer_fn builds a dataset object per call: build it once per task.
    return reasoning_gym.get_score_answer_fn(task)


def rg_entry(item: dict[str, Any]) -> dict[str, Any]:
    """The reasoning-gym entry (question, answer, metadata) an item was made from."""
    answer = item["raw_answer"] if "raw_answer" in item else item["answer"]
    return {"question": item["question"], "answer": answer, "metadata": item["metadata"]}


def extract_tagged_answer(completion: str) -> str | None:
    """The content of the last `<answer>...</answer>` of `completion`, or None."""
    return extract_answer(completion, tag_name="answer")


def reasoning_gym_reward(completion: str, item: dict[str, Any]) -> float:
    """Score the `<answer>` of `completion` with the item's reasoning-gym task scorer."""
    if "metadata" not in item:
        raise KeyError(f"item {item.get('id')!r} has no 'metadata': not a reasoning_gym item")
    # Composite datasets mix tasks; each entry names the task that made it.
    task = item["metadata"].get("source_dataset", item["task"])
    answer = extract_tagged_answer(completion)
    if answer is None:
        return 0.0
    return float(_scorer(task)(answer, rg_entry(item)))
