"""A search agent: answer questions about a corpus that only the `search` tool knows.

The corpus (made-up people, towns, provinces, inventions and firms; `asyncrl.agents.search`)
is indexed with bm25s. The agent is a plain `openai` SDK loop: the model may call
`search(query)`, reads the results, and answers inside <answer></answer>. 1-hop questions
need one lookup, 2-hop questions two.
Identical searches within a GRPO group run once (the group's tool cache).
"""

from __future__ import annotations

from openai import AsyncOpenAI

from asyncrl.agents.search import (
    FEW_SHOT,
    SYSTEM_PROMPT,
    SearchTool,
    extract_answer,
    score_answer,
)
from asyncrl.agents.tools import ToolBox

MAX_TURNS = 3  # up to two searches (2-hop questions), then the answer
MAX_TOKENS = 80


async def agent(base_url: str, api_key: str, item: dict) -> float:
    toolbox = ToolBox([SearchTool.for_item(item)])
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, *FEW_SHOT,
                {"role": "user", "content": item["question"]}]
    text = ""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
        for _ in range(MAX_TURNS):
            out = await client.chat.completions.create(
                model="policy", messages=messages, tools=toolbox.specs, max_tokens=MAX_TOKENS)
            message = out.choices[0].message
            text = message.content or ""
            calls = [c.model_dump(exclude_none=True) for c in message.tool_calls or []]
            if extract_answer(text) is not None or not calls:
                break
            messages.append({"role": "assistant", "content": message.content, "tool_calls": calls})
            messages += await toolbox.run_tool_calls(calls)
    return score_answer(text, item)
