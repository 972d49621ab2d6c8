"""A customer-service agent against a simulated customer (a small tau2-style retail domain).

The agent is a plain `openai` SDK loop over `asyncrl.agents.customer_service.converse`:
the model reads the shop's policy, looks the order up, changes it or refuses, and tells
the customer; the customer answers until it is satisfied or the turn limit. The reward is
tau2's: 1 when the final database equals the task's goal and every fact the customer
needed (the refund amount, the new address, or why not: the order's status) was said.

The customer is, by the item's `metadata.user`:
- "model": the served model playing the customer with its own prompt, greedy, through the
  proxy's untrained routes with this session's key (never recorded, never trained);
- "scripted": `scripted_reply` (gives the new address when asked, else thanks and stops).
"""

from __future__ import annotations

from openai import AsyncOpenAI

from asyncrl.agents.customer_service import (
    converse,
    parse_task,
    score,
    scripted_reply,
    user_prompt,
)
from asyncrl.agents.user import ModelUser, ScriptedUser

# Per model call: a lead-in sentence and one call, or one message. The longest worked
# message (an address change and its call) is 67 SmolLM2 tokens; a budget below that cuts
# the call off and no address change can succeed.
MAX_TOKENS = 96
MAX_MODEL_CALLS = 6  # lookup, ask, act, report and two spare
MAX_USER_TURNS = 3


async def agent(base_url: str, api_key: str, item: dict) -> float:
    task = parse_task(item)
    mode = item["metadata"].get("user", "model")
    if mode == "model":
        user = ModelUser(base_url, api_key, system=user_prompt(task), opening=task.opening)
    elif mode == "scripted":
        user = ScriptedUser(task.opening, scripted_reply(task))
    else:
        raise ValueError(f"item {item.get('id')!r}: metadata.user must be 'model' or "
                         f"'scripted', got {mode!r}")
    async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
        async def policy(messages: list[dict], tools: list[dict]) -> dict:
            out = await client.chat.completions.create(
                model="policy", messages=messages, tools=tools, max_tokens=MAX_TOKENS)
            message = out.choices[0].message
            return {"content": message.content or "",
                    "tool_calls": [c.model_dump(exclude_none=True)
                                   for c in message.tool_calls or []]}
        try:
            episode = await converse(policy, user, task, max_model_calls=MAX_MODEL_CALLS,
                                     max_user_turns=MAX_USER_TURNS)
        finally:
            if isinstance(user, ModelUser):
                await user.close()
    return score(episode.db, episode.said_to_user, task)
