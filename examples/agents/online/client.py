"""An outside client for online RL: it knows only the proxy's base_url and the admin key.

    python examples/agents/online/client.py --base-url http://127.0.0.1:8765 \
        --admin-key "$ASYNCRL_ADMIN_KEY" --sessions 400

Each session: POST /rl/start_session (waiting out 429s with their Retry-After), one
chat completion through the session's key with the plain `openai` SDK, its own scoring
(two-digit addition, checked by reasoning-gym), POST /rl/set_reward, POST
/rl/end_session. `asyncrl train` with agent.mode=online learns from these sessions while
they run; the client keeps a few sessions in flight and stops after --sessions or when the
proxy goes away (training finished).
"""

from __future__ import annotations

import argparse
import asyncio
import random

import aiohttp
import openai

from asyncrl.data.loading import load_reasoning_gym
from asyncrl.rewards.rgym import reasoning_gym_reward

SYSTEM = "Give the final answer inside <answer></answer> tags."
FEW_SHOT = [{"role": "user", "content": "Calculate 23 + 45."},
            {"role": "assistant", "content": "23 + 45 = 68. <answer>68</answer>"}]
TASK = dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2, operators=["+"],
            allow_parentheses=False, allow_negation=False)


async def rl(http: aiohttp.ClientSession, url: str, key: str, body: dict) -> dict:
    """POST a /rl/* call; waits and retries while the proxy answers 429."""
    while True:
        async with http.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status == 429:
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                continue
            r.raise_for_status()
            return await r.json()


async def one_session(http: aiohttp.ClientSession, base: str, admin_key: str, item: dict) -> float:
    s = await rl(http, f"{base}/rl/start_session", admin_key, {"task_id": item["id"]})
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=s["api_key"])
    out = await client.chat.completions.create(model="policy", max_tokens=32, messages=[
        {"role": "system", "content": SYSTEM}, *FEW_SHOT,
        {"role": "user", "content": item["question"]}])
    await client.close()
    reward = reasoning_gym_reward(out.choices[0].message.content or "", item)
    await rl(http, f"{base}/rl/set_reward", s["api_key"], {"reward": reward})
    await rl(http, f"{base}/rl/end_session", s["api_key"], {})
    return reward


async def wait_for_proxy(http: aiohttp.ClientSession, base: str, timeout: float) -> None:
    """Poll GET /health until the proxy answers (training may still be starting up)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            async with http.get(f"{base}/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        if loop.time() > deadline:
            raise SystemExit(f"no agent proxy answered at {base} within {timeout:g} s")
        await asyncio.sleep(0.5)


async def main(base: str, admin_key: str, sessions: int, concurrency: int, seed: int,
               wait: float) -> None:
    # A few tasks asked repeatedly, so each task's running baseline means something.
    items = load_reasoning_gym("basic_arithmetic", size=64, seed=seed, **TASK)
    rng = random.Random(seed)
    done, rewards = 0, []
    async with aiohttp.ClientSession() as http:
        await wait_for_proxy(http, base, wait)

        async def worker() -> None:
            nonlocal done
            while done < sessions:
                done += 1
                try:
                    rewards.append(await one_session(http, base, admin_key, rng.choice(items)))
                except (aiohttp.ClientConnectionError, openai.APIConnectionError):
                    return  # the proxy is gone: training finished
                except (aiohttp.ClientResponseError, openai.APIStatusError) as e:
                    print(f"session failed: {e}", flush=True)  # e.g. 409: it timed out
                    continue
                if len(rewards) % 32 == 0:
                    print(f"{len(rewards)} sessions, mean reward of the last 32: "
                          f"{sum(rewards[-32:]) / 32:.3f}", flush=True)
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    print(f"client done: {len(rewards)} sessions", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True, help="the proxy, http://HOST:PORT")
    p.add_argument("--admin-key", required=True)
    p.add_argument("--sessions", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wait", type=float, default=600.0,
                   help="seconds to wait for the proxy to come up")
    a = p.parse_args()
    asyncio.run(main(a.base_url.rstrip("/"), a.admin_key, a.sessions, a.concurrency, a.seed,
                     a.wait))
