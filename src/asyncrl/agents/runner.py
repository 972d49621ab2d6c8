"""Agents as plain code: an async function or a command, pointed at the proxy's base_url.

    async def agent(base_url: str, api_key: str, item: dict) -> float | None

An inline agent is such a function (named "package.module:function" or
"path/to/file.py:function"); it talks to the model only through `base_url` with
`api_key` (the `openai` SDK, the OpenAI Agents SDK, raw HTTP...) and returns its reward,
or None when it reported the reward itself (POST /rl/set_reward).

A subprocess agent is any command ("python" as its program means this interpreter). It
gets OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY,
ASYNCRL_TASK_FILE (the item as JSON) and ASYNCRL_TASK_ID in its environment, and reports its reward through the proxy or as the
last line of its standard output: a number, or a JSON object with a "reward" key.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

AgentFn = Callable[[str, str, dict[str, Any]], Awaitable[float | None]]
_TAIL_CHARS = 2000  # of a failed command's stderr quoted in the error


class AgentError(RuntimeError):
    """An agent failed: it raised, timed out, exited non-zero, or left no reward."""


def resolve_agent(spec: str) -> AgentFn:
    """The function `spec` names: "package.module:function" or "path/to/file.py:function"."""
    module_name, sep, fn_name = spec.rpartition(":")
    if not sep or not module_name or not fn_name:
        raise ValueError(f"agent {spec!r} must look like 'package.module:function' or "
                         "'path/to/file.py:function'")
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"agent file {module_name!r} does not exist")
        name = f"asyncrl_agent_{path.stem}_{abs(hash(str(path)))}"
        module = sys.modules.get(name)
        if module is None:
            loader = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[name] = module
            loader.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    fn = getattr(module, fn_name, None)
    if fn is None or not asyncio.iscoroutinefunction(fn):
        raise ValueError(f"agent {spec!r}: {fn_name} must be an async function "
                         "(base_url, api_key, item) -> reward")
    return fn


def anthropic_base(base_url: str) -> str:
    """Anthropic's SDK appends /v1/messages to its base URL; OpenAI's appends to .../v1."""
    return base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url


class SubprocessAgent:
    """Runs a command per episode; its reward comes from the proxy or its last stdout line."""

    def __init__(self, command: list[str], *, timeout: float, cwd: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        if not command:
            raise ValueError("a subprocess agent needs a command (agent.command)")
        # "python" is this interpreter (the run's environment), not whatever PATH finds.
        command = [sys.executable if command[0] in ("python", "python3") else command[0],
                   *command[1:]]
        self.command, self.timeout, self.cwd, self.env = command, timeout, cwd, env or {}

    async def __call__(self, base_url: str, api_key: str, item: dict[str, Any]) -> float | None:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(item, f)
        env = {**os.environ, **self.env, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
               "ANTHROPIC_BASE_URL": anthropic_base(base_url), "ANTHROPIC_API_KEY": api_key,
               "ASYNCRL_TASK_FILE": f.name, "ASYNCRL_TASK_ID": str(item.get("id", ""))}
        proc = await asyncio.create_subprocess_exec(
            *self.command, cwd=self.cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            _kill(proc)
            await asyncio.shield(proc.wait())  # reaped even if cancelled again meanwhile
            raise
        finally:
            os.unlink(f.name)
        if proc.returncode != 0:
            raise AgentError(f"agent command {self.command[0]!r} exited with {proc.returncode}: "
                             f"{err.decode(errors='replace')[-_TAIL_CHARS:]}")
        return parse_reward_line(out.decode(errors="replace"))


def _kill(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass


def parse_reward_line(stdout: str) -> float | None:
    """The reward on the last non-empty line: a number or {"reward": x}; None if neither."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    last = lines[-1]
    try:
        value = json.loads(last)
    except json.JSONDecodeError:
        return None
    if isinstance(value, dict):
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
