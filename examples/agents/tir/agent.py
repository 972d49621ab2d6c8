"""Tool-integrated reasoning: a tiny model learns to call a calculator and copy its result.

Items are reasoning-gym `basic_arithmetic` expressions of 2-3 terms with 3-4 digit numbers
and + - * (no "/": the task scores floor division, the calculator divides exactly). The
model alone cannot do them; with the calculator they are a copy job: copy the expression
into a tool call, then copy the result into <answer></answer>. The reward is reasoning-gym's
score of the last turn's <answer>.

Dataset config (no custom items needed):

    train_dataset: {path: "reasoning_gym:basic_arithmetic", task_kwargs: <TASK_KWARGS below>}
    agent: {mode: inline, fn: "examples/agents/tir/agent.py:agent"}

Baseline of SmolLM2-135M-Instruct (40 held-out items, seed 100000; HF generate, fp32):
model alone 0% greedy and 0% at T=1. With this prompt: greedy 2.5% solved, 20% of first turns
a well-formed call; T=1 (4 samples) 1.9% solved, 18% well-formed calls, 3 of 40 groups with
reward variance. Most misses are a call whose expression is not quoted (invalid JSON), so
learning to quote it lifts the reward towards the ceiling of 100%.
"""

from __future__ import annotations

import json

from openai import AsyncOpenAI
from reasoning_gym.utils import extract_answer

from asyncrl.agents.tools import Calculator, ToolBox
from asyncrl.rewards.rgym import reasoning_gym_reward

TASK_KWARGS = {"min_terms": 2, "max_terms": 3, "min_digits": 3, "max_digits": 4,
               "operators": ["+", "-", "*"]}
MAX_TURNS = 3  # call, read the result, answer; one spare for a retried call
MAX_TOKENS = 64  # per model turn: a call or an answer is ~30 tokens
SYSTEM = ("You cannot do arithmetic in your head: always use the calculator tool, "
          "then copy its result into <answer></answer> tags.")


def _worked_example(question: str, expression: str, result: str) -> list[dict]:
    """One episode done right: question, calculator call, its result, the copied answer."""
    call = {"id": "call_0", "type": "function", "function": {
        "name": "calculator", "arguments": json.dumps({"expression": expression})}}
    # The lead-in text gives the tiny model words that precede a call ("I will use..."),
    # which it imitates far more often than a bare <tool_call> turn.
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": "I will use the calculator.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": result},
            {"role": "assistant",
             "content": f"The calculator says {result}.\n<answer>{result}</answer>"}]


# Two shots: with one, the model copies the last turn's <answer> form and skips the call.
FEW_SHOT = (_worked_example("Calculate 4821 * -37 + 905.", "4821 * -37 + 905", "-177472")
            + _worked_example("Calculate ( 63 - -718 ) * 2054.", "( 63 - -718 ) * 2054",
                              "1604174"))


async def agent(base_url: str, api_key: str, item: dict) -> float:
    """Up to MAX_TURNS model turns with the calculator; the reward of the final <answer>."""
    toolbox = ToolBox([Calculator()])
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
