"""Math answer checking for GSM8K-style tasks with math-verify.

The answer format is strict on purpose: the final answer is what follows the last `####`
(GSM8K's own solution format) or what is inside the last `\\boxed{...}`. There is no
"last number in the text" fallback: it would reward a completion that merely mentions the
right number on the way, and the prompt (few-shot example) teaches the format anyway.

math-verify guards parsing and comparison with `signal.alarm`, which only works in the main
thread. We turn those timeouts off (`parsing_timeout=None`, `timeout_seconds=None`) so the
reward runs in any thread or process; `RewardRunner` puts its own timeout around the call
(and kills the worker process on a hang: sympy can spin forever on inputs like 9^{9^{9}}).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from math_verify import parse, verify

_HASHES = "####"
_BOXED = "\\boxed"
# A comma between digit groups ("1,000") is a thousands separator, not a tuple.
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# "#### 18 dollars" -> "18": a number followed by words.
_NUMBER_THEN_WORDS = re.compile(r"(-?\d+(?:\.\d+)?)\s+[A-Za-z].*", re.DOTALL)

# math-verify warns once that its timeouts are off; that is deliberate here.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def _last_boxed(text: str) -> tuple[int, str] | None:
    """(position, content) of the last `\\boxed{...}`, braces balanced; None if absent."""
    start = text.rfind(_BOXED + "{")
    if start < 0:
        return None
    depth = 0
    body_start = start + len(_BOXED) + 1
    for i in range(body_start - 1, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return start, text[body_start:i]
    return None  # unclosed: the completion was cut off before the answer ended


def _last_hashes(text: str) -> tuple[int, str] | None:
    """(position, rest of the line) after the last `####`; None if absent."""
    start = text.rfind(_HASHES)
    if start < 0:
        return None
    return start, text[start + len(_HASHES):].split("\n", 1)[0]


def normalize_answer(answer: str) -> str:
    """Strip dollar signs, thousands commas, a final period and trailing unit words."""
    s = answer.strip().replace("\\$", "").replace("$", "")
    s = _THOUSANDS_COMMA.sub("", s).strip().rstrip(".").strip()
    m = _NUMBER_THEN_WORDS.fullmatch(s)
    return m.group(1) if m else s


def extract_final_answer(text: str) -> str | None:
    """The normalized final answer (last `####` or `\\boxed{}`, whichever is later), or None."""
    found = [c for c in (_last_boxed(text), _last_hashes(text)) if c is not None]
    if not found:
        return None
    _, answer = max(found)
    answer = normalize_answer(answer)
    return answer or None


def gsm8k_ground_truth(solution: str) -> str:
    """The ground truth of a GSM8K solution: the text after `####`, commas removed."""
    if _HASHES not in solution:
        raise ValueError(f"GSM8K solution has no '####' line: {solution[-200:]!r}")
    return solution.rsplit(_HASHES, 1)[1].strip().replace(",", "")


def _parse(answer: str) -> list:
    # Wrapping in \boxed makes math-verify read the whole string as the answer.
    return parse("\\boxed{" + answer + "}", parsing_timeout=None)


def math_equal(pred: str, gold: str) -> bool:
    """Whether two answer strings are mathematically equal, per math-verify."""
    gold_parsed = _parse(normalize_answer(gold))
    if not gold_parsed:
        # A ground truth we cannot read is a data bug, not a wrong answer.
        raise ValueError(f"math-verify cannot parse the ground truth {gold!r}")
    return bool(verify(gold_parsed, _parse(pred), timeout_seconds=None))


def gsm8k_reward(completion: str, item: dict[str, Any]) -> float:
    """1.0 if the final answer (`#### N` or `\\boxed{N}`) equals item["answer"], else 0.0."""
    pred = extract_final_answer(completion)
    if pred is None:
        return 0.0
    return 1.0 if math_equal(pred, str(item["answer"])) else 0.0
