"""Multi-turn math, written as a plain `openai` SDK agent: answer, hear "incorrect", retry.

The model answers a two-digit addition (the quickstart's task, with its one-shot example
of the answer format). A wrong answer gets "Incorrect, try again." and another turn, up
to MAX_TURNS. The reward, 1.0 for a correct answer (set on the turn that got it right), is
discounted per turn by `agent.turn_discount` when the conversation is exported: solved
at turn k, every turn of the episode trains on turn_discount^(k-1).

Nothing here knows about RL: the same function runs against any OpenAI-compatible
server. `asyncrl train` calls it inline (agent.fn) or, as a command, through __main__
(agent.command: the task comes in $ASYNCRL_TASK_FILE, the model in $OPENAI_BASE_URL).
"""

from __future__ import annotations

import asyncio
import json
import os

import openai

from asyncrl.rewards.rgym import reasoning_gym_reward

MAX_TURNS = 3
SYSTEM = "Give the final answer inside <answer></answer> tags."
FEW_SHOT = [{"role": "user", "content": "Calculate 23 + 45."},
            {"role": "assistant", "content": "23 + 45 = 68. <answer>68</answer>"}]
RETRY = "Incorrect, try again."


async def agent(base_url: str, api_key: str, item: dict) -> float | None:
    """Up to MAX_TURNS attempts; the reward of the last one (1.0 if it is right)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    messages = [{"role": "system", "content": SYSTEM}, *FEW_SHOT,
                {"role": "user", "content": item["question"]}]
    reward = 0.0
    try:
        for _ in range(MAX_TURNS):
            out = await client.chat.completions.create(model="policy", messages=messages,
                                                       max_tokens=32)
            answer = out.choices[0].message.content or ""
            reward = reasoning_gym_reward(answer, item)
            if reward == 1.0:
                break
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": RETRY}]
    finally:
        await client.close()
    return reward  # lands on the last completion; earlier turns get it discounted


async def _main() -> None:
    """As a command: the item from $ASYNCRL_TASK_FILE; the reward as the last stdout line."""
    with open(os.environ["ASYNCRL_TASK_FILE"]) as f:
        item = json.load(f)
    reward = await agent(os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], item)
    print(json.dumps({"reward": reward}))


if __name__ == "__main__":
    asyncio.run(_main())
