"""Does the chat template extend each turn token for token? Checked once at start-up.

Multi-turn capture merges a conversation into one trajectory only when the next turn's
prompt starts with the previous prompt + the sampled output ids. Templates that re-render
earlier turns (strip reasoning, reformat tool calls, move a system block) break that, and
so can text that does not re-tokenise to the sampled ids. This check plays a few
synthetic tool conversations through the template the way the proxy renders them (the
model's own text kept for its turns) and reports each turn that would not merge.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from asyncrl.openai.protocol import render_chat
from asyncrl.openai.tool_calls import CLOSE, OPEN

logger = logging.getLogger(__name__)

_CALC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}


def _call(expression: str) -> str:
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"{OPEN}\n{body}\n{CLOSE}"


# Each conversation: the messages, where assistant turns hold what the model wrote.
CONVERSATIONS: list[tuple[list[dict[str, Any]], list[dict] | None]] = [
    ([{"role": "user", "content": "What is 17 * 23?"},
      {"role": "assistant", "content": _call("17 * 23")},
      {"role": "tool", "content": "391", "tool_call_id": "call_0"},
      {"role": "assistant", "content": "17 * 23 = 391."},
      {"role": "user", "content": "And 391 + 9?"}], [_CALC]),
    ([{"role": "system", "content": "Answer briefly."},
      {"role": "user", "content": "Name a prime number."},
      {"role": "assistant", "content": "7"},
      {"role": "user", "content": "Incorrect, try again: a prime above 10."},
      {"role": "assistant", "content": "11"},
      {"role": "user", "content": "Thanks."}], None),
    ([{"role": "user", "content": "Add 2.5 and 4, then square it."},
      {"role": "assistant", "content": "First the sum. " + _call("2.5 + 4")},
      {"role": "tool", "content": "6.5", "tool_call_id": "call_1"},
      {"role": "assistant", "content": _call("6.5 ** 2")},
      {"role": "tool", "content": "42.25", "tool_call_id": "call_2"}], [_CALC]),
]


@dataclass
class DriftReport:
    turns: int = 0  # assistant turns followed by another turn
    drifted: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.drifted == 0

    def describe(self) -> str:
        if self.ok:
            return f"chat template: all {self.turns} synthetic turns extend token for token"
        return (f"chat template: {self.drifted} of {self.turns} synthetic turns do not extend "
                "the previous turn token for token; their sessions export one trajectory per "
                "completion. First: " + self.examples[0])


def check_template_drift(tokenizer: Any, native_tools: bool) -> DriftReport:
    """Play `CONVERSATIONS` through the template; count turns whose next prompt drifts."""
    report = DriftReport()
    eos = tokenizer.eos_token_id
    for messages, tools in CONVERSATIONS:
        for k, m in enumerate(messages):
            if m["role"] != "assistant" or k + 1 >= len(messages):
                continue
            prompt = render_chat(tokenizer, messages[:k], tools, "auto", native_tools)
            sampled = tokenizer.encode(m["content"], add_special_tokens=False) + [eos]
            upto = next((j for j in range(k + 1, len(messages))
                         if messages[j]["role"] == "assistant"), len(messages))
            nxt = render_chat(tokenizer, messages[:upto], tools, "auto", native_tools)
            report.turns += 1
            want = prompt + sampled
            if nxt[: len(want)] != want:
                report.drifted += 1
                at = next((i for i, (a, b) in enumerate(zip(nxt, want)) if a != b),
                          min(len(nxt), len(want)))
                report.examples.append(
                    f"turn {k} of {messages[0]['content']!r}: next prompt differs at token "
                    f"{at}: {tokenizer.decode(nxt[max(0, at - 8):at + 8])!r} vs sampled "
                    f"{tokenizer.decode(want[max(0, at - 8):at + 8])!r}")
    return report
