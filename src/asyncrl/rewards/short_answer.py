"""Exact match of a short answer (a word, a number, yes/no) after normalisation.

Normalising lower-cases the text, drops surrounding whitespace, quotes and final
punctuation, and writes the number words zero to ten as digits: "Three." and "3" match,
"red" and "Red" match, "a red one" does not match "red" (the answer must be the answer
alone, as the prompt asks).

`marked_short_answer_reward` scores a completion that reasons first and gives its answer
after a marker ("red square, blue circle. Answer: 2"): the text after the last "Answer:"
(any case) is matched as above, and a completion without the marker scores 0.
"""

from __future__ import annotations

import re
from typing import Any

_NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"))}
_STRIP = " \t\n\"'`.,!?;:"
# Matched in the text as written: str.lower() may change its length (for "İ"), which would
# shift an index found in the lower-cased copy.
_ANSWER_MARKER = re.compile("answer:", re.IGNORECASE)


def normalize_short_answer(text: str) -> str:
    """`text` as the comparison sees it: lower case, trimmed, number words as digits."""
    words = text.lower().strip(_STRIP).split()
    return " ".join(_NUMBER_WORDS.get(w, w) for w in words)


def short_answer_reward(completion: str, item: dict[str, Any]) -> float:
    """1.0 if the completion, normalised, equals item["answer"] normalised, else 0.0."""
    return float(normalize_short_answer(completion) == _gold(item, "short_answer"))


def extract_marked_answer(completion: str) -> str | None:
    """The normalised text after the last "Answer:" (any case) in `completion`, or None when
    there is no marker."""
    last = None
    for last in _ANSWER_MARKER.finditer(completion):
        pass
    return None if last is None else normalize_short_answer(completion[last.end():])


def marked_short_answer_reward(completion: str, item: dict[str, Any]) -> float:
    """1.0 if the answer after the completion's last "Answer:" equals item["answer"] after
    normalisation, else 0.0 (also when the completion gives no "Answer:")."""
    return float(extract_marked_answer(completion) == _gold(item, "marked_short_answer"))


def _gold(item: dict[str, Any], reward: str) -> str:
    """item["answer"], normalised; a clear error naming the item and `reward` without one."""
    if "answer" not in item:
        raise KeyError(f"item {item.get('id')!r} has no 'answer' for the {reward} reward")
    return normalize_short_answer(str(item["answer"]))
