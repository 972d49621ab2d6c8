"""Online RL with Hermes Agent (`hermes-agent`): configured once, its sessions rewarded here.

    python examples/agents/hermes/client.py --base-url http://127.0.0.1:8765 \
        --admin-key "$ASYNCRL_ADMIN_KEY" --hermes .venv-hermes/bin/hermes --sessions 400

Hermes is configured once, in its own home folder (config.yaml): the proxy's base_url and
one fixed key. Each session: POST /rl/start_session {task_id, api_key: that key} (a start
with a bound key ends the key's previous session, so the configuration never changes; 429s
are waited out), `hermes -z QUESTION` (one-shot: Hermes' whole agent loop, its streamed
chat completions and tool turns, through the proxy), the answer scored here (two-digit
addition, checked by reasoning-gym), POST /rl/set_reward and /rl/end_session with the admin
key and the session id. Hermes runs in its own environment (it pins openai 2.24, the
`agents` extra needs openai 3): `--hermes` names its executable.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import shutil
import tempfile
from pathlib import Path

import aiohttp

from asyncrl.data.loading import load_reasoning_gym
from asyncrl.rewards.rgym import reasoning_gym_reward

TASK = dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2, operators=["+"],
            allow_parentheses=False, allow_negation=False)
SUFFIX = " Give the final answer inside <answer></answer> tags."


def configure(home: Path, base_url: str, key: str) -> None:
    """Hermes' one configuration: the proxy as a custom OpenAI-compatible provider.

    Hermes refuses models whose context window is under 64K tokens; `context_length`
    states one (a prompt beyond the served model's window gets a 400 naming it). Only the
    `todo` toolset: the default tools' schemas alone exceed a small model's context.
    """
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.yaml").write_text(
        "model:\n  provider: custom\n"
        f"  base_url: {base_url}/v1\n  api_key: {key}\n"
        "  default: policy\n  context_length: 65536\n"
        "platform_toolsets:\n  cli: [todo]\n")


async def rl(http: aiohttp.ClientSession, url: str, key: str, body: dict) -> dict:
    """POST a /rl/* call; waits and retries while the proxy answers 429."""
    while True:
        async with http.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status == 429:
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                continue
            r.raise_for_status()
            return await r.json()


async def hermes(exe: str, home: Path, question: str, timeout: float) -> str:
    """One Hermes conversation (`hermes -z`): its final answer."""
    proc = await asyncio.create_subprocess_exec(
        exe, "-z", question, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "HERMES_HOME": str(home)}, cwd=home)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    return out.decode(errors="replace")


async def one_session(http, base: str, admin: str, key: str, exe: str, home: Path,
                      item: dict, timeout: float) -> float:
    s = await rl(http, f"{base}/rl/start_session", admin, {"task_id": item["id"], "api_key": key})
    answer = await hermes(exe, home, item["question"] + SUFFIX, timeout)
    reward = reasoning_gym_reward(answer, item)
    await rl(http, f"{base}/rl/set_reward", admin, {"session_id": s["session_id"],
                                                     "reward": reward})
    await rl(http, f"{base}/rl/end_session", admin, {"session_id": s["session_id"]})
    print(f"session {s['session_id']} task {item['id']} reward {reward}", flush=True)
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


async def main(a: argparse.Namespace) -> None:
    items = load_reasoning_gym("basic_arithmetic", size=64, seed=a.seed, **TASK)
    rng = random.Random(a.seed)
    key = f"hermes-{secrets.token_urlsafe(12)}"
    with tempfile.TemporaryDirectory(prefix="hermes-home-") as tmp:
        home = Path(a.hermes_home or tmp)
        configure(home, a.base_url, key)  # once, for every session
        async with aiohttp.ClientSession() as http:
            await wait_for_proxy(http, a.base_url, a.wait)
            rewards = []
            for _ in range(a.sessions):  # one key: one session at a time
                try:
                    rewards.append(await one_session(http, a.base_url, a.admin_key, key,
                                                     a.hermes, home, rng.choice(items),
                                                     a.timeout))
                except aiohttp.ClientConnectionError:
                    break  # the proxy is gone: training finished
    print(f"client done: {len(rewards)} sessions", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True, help="the proxy, http://HOST:PORT")
    p.add_argument("--admin-key", required=True)
    p.add_argument("--hermes", default="hermes", help="the hermes executable")
    p.add_argument("--hermes-home", help="Hermes' home folder (default: a temporary one)")
    p.add_argument("--sessions", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per conversation")
    p.add_argument("--wait", type=float, default=600.0,
                   help="seconds to wait for the proxy to come up")
    a = p.parse_args()
    a.base_url = a.base_url.rstrip("/")
    found = shutil.which(a.hermes)
    if found is None:
        raise SystemExit(f"{a.hermes}: not found; install Hermes Agent in its own environment: "
                         "python -m venv .venv-hermes && .venv-hermes/bin/pip install "
                         "hermes-agent==0.19.0")
    a.hermes = os.path.abspath(found)
    asyncio.run(main(a))
