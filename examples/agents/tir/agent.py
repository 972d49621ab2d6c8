"""Tool-integrated reasoning: a tiny model learns to call a multiply tool and copy its result.

Items are reasoning-gym `basic_arithmetic` products of two 3-4 digit numbers: the model
alone gets none of them; with the tool each is a copy job (the two numbers into a call,
the result into <answer></answer>). The reward is reasoning-gym's score of the last turn.

Why a `multiply(a, b)` tool with number arguments rather than a calculator taking an
expression string: SmolLM2-135M writes `{"expression": 3171 * 2742}` (unquoted, not JSON)
for the latter, so almost no call parses; numbers need no quotes. Measured over 40 held-out
items with HF `generate` (fp32): calculator 2.5% greedy / 1.9% sampled (3 of 40 groups of 4
with any reward variance); multiply 0% greedy (it writes the call inside <tool_response>
tags, copying the few-shot's tool turns) but 6.2% sampled with 9 of 40 groups varying,
which is what GRPO learns from.
"""

from __future__ import annotations

import json

from openai import AsyncOpenAI
from reasoning_gym.utils import extract_answer

from asyncrl.agents.tools import ToolBox
from asyncrl.rewards.rgym import reasoning_gym_reward

MAX_TURNS = 3  # call, read the result, answer; one spare for a retried call
MAX_TOKENS = 48  # per model turn: a call or an answer is ~30 tokens
SYSTEM = ("You cannot multiply in your head: always use the multiply tool, "
          "then copy its result into <answer></answer> tags.")


class Multiply:
    """multiply(a, b) -> a * b, for numbers the model writes as JSON numbers."""

    name = "multiply"
    description = "Multiply two numbers."
    parameters = {"type": "object", "required": ["a", "b"],
                  "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}
    deterministic = True

    async def __call__(self, args: dict) -> str:
        a, b = args.get("a"), args.get("b")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
            return "error: a and b must be numbers"
        product = a * b
        return str(int(product)) if float(product).is_integer() else str(product)


def _worked_example(question: str, a: int, b: int) -> list[dict]:
    """One episode done right: question, tool call, its result, the copied answer."""
    call = {"id": "call_0", "type": "function",
            "function": {"name": "multiply", "arguments": json.dumps({"a": a, "b": b})}}
    # The lead-in text gives the tiny model words that precede a call, which it imitates
    # far more often than a bare <tool_call> turn.
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": "I will use the multiply tool.",
             "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": str(a * b)},
            {"role": "assistant",
             "content": f"The result is {a * b}.\n<answer>{a * b}</answer>"}]


# Two shots: with one, the model copies the last turn's <answer> form and skips the call.
FEW_SHOT = (_worked_example("Calculate 4821 * 37.", 4821, 37)
            + _worked_example("Calculate 718 * 2054.", 718, 2054))


async def agent(base_url: str, api_key: str, item: dict) -> float:
    """Up to MAX_TURNS model turns with the tool; the reward of the final <answer>."""
    toolbox = ToolBox([Multiply()])
    messages = [{"role": "system", "content": SYSTEM}, *FEW_SHOT,
                {"role": "user", "content": item["question"]}]
    text = ""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
        for _ in range(MAX_TURNS):
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=toolbox.specs, max_tokens=MAX_TOKENS)
            message = response.choices[0].message
            text = message.content or ""
            calls = [call.model_dump(exclude_none=True) for call in message.tool_calls or []]
            # An answer ends the episode even beside a call: it was written before any result.
            if extract_answer(text, tag_name="answer") is not None or not calls:
                break
            messages.append({"role": "assistant", "content": message.content, "tool_calls": calls})
            messages += await toolbox.run_tool_calls(calls)
    return reasoning_gym_reward(text, item)
