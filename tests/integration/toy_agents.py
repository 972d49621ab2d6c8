"""Agents for the end-to-end tests: real `openai` SDK clients, rewards with signal on tiny models."""

from __future__ import annotations

import asyncio
import json
import os

import openai
from toy_rewards import text_hash


async def two_turns(base_url: str, api_key: str, item: dict) -> float:
    """Ask, then ask again with the answer in the history; reward the second answer's hash."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": item["question"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Again."}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    await client.close()
    return text_hash(second.choices[0].message.content or "", item)


async def rewards_itself(base_url: str, api_key: str, item: dict) -> None:
    """One turn; the reward goes through POST /rl/set_reward, the function returns None."""
    import aiohttp

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    out = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": item["question"]}], max_tokens=8)
    await client.close()
    root = base_url[: -len("/v1")]
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{root}/rl/set_reward", json={
                "reward": text_hash(out.choices[0].message.content or "", item)},
                headers={"Authorization": f"Bearer {api_key}"}) as r:
            r.raise_for_status()


async def _main() -> None:
    """Subprocess mode: the task from $ASYNCRL_TASK_FILE, the model from $OPENAI_BASE_URL."""
    with open(os.environ["ASYNCRL_TASK_FILE"]) as f:
        item = json.load(f)
    client = openai.AsyncOpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY
    out = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": item["question"]}], max_tokens=8)
    await client.close()
    print("some log line the agent prints")
    print(json.dumps({"reward": text_hash(out.choices[0].message.content or "", item)}))


if __name__ == "__main__":
    asyncio.run(_main())


async def two_turns_slowly(base_url: str, api_key: str, item: dict) -> float:
    """`two_turns` with a pause between the turns: sessions stay open long enough for a
    test to kill the agent service while some are in flight."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": item["question"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    await asyncio.sleep(0.5)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Again."}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    await client.close()
    return text_hash(second.choices[0].message.content or "", item)
