"""Exact match of a short answer (a word, a number, yes/no) after normalisation.

Normalising lower-cases the text, drops surrounding whitespace, quotes and final
punctuation, and writes the number words zero to ten as digits: "Three." and "3" match,
"red" and "Red" match, "a red one" does not match "red" (the answer must be the answer
alone, as the prompt asks).
"""

from __future__ import annotations

from typing import Any

_NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"))}
_STRIP = " \t\n\"'`.,!?;:"


def normalize_short_answer(text: str) -> str:
    """`text` as the comparison sees it: lower case, trimmed, number words as digits."""
    words = text.lower().strip(_STRIP).split()
    return " ".join(_NUMBER_WORDS.get(w, w) for w in words)


def short_answer_reward(completion: str, item: dict[str, Any]) -> float:
    """1.0 if the completion, normalised, equals item["answer"] normalised, else 0.0."""
    if "answer" not in item:
        raise KeyError(f"item {item.get('id')!r} has no 'answer' for the short_answer reward")
    return float(normalize_short_answer(completion) == normalize_short_answer(str(item["answer"])))
