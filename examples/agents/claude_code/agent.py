"""Claude Code, unchanged, as the agent of the SWE task: `claude -p` through the proxy.

Each session writes the task's generated repository (`asyncrl.agents.swe`) into a fresh
folder and runs Claude Code headless in it, inside the sandbox: writes only in that folder,
CPU/memory/process limits, and TCP only to the proxy's port where the kernel's Landlock
can say so. Claude Code reads `ANTHROPIC_BASE_URL` (the proxy) and `ANTHROPIC_API_KEY`
(the session's key) and talks to `POST /v1/messages`; its Bash, Read and Edit tools act
on the repository. Reward: 1.0 when the repository's test passes afterwards (the test
file restored first, run in the sandbox).

Claude Code's default request (its system prompt and about 24 tools) is about 20,000
tokens: more than a small model's context, which answers "prompt is too long". The
settings in `CLAUDE_ARGS` make it fit: `--bare` (no hooks, plugins, CLAUDE.md or MCP
discovery), a short `--system-prompt` and `--tools` naming three tools. An episode whose
first request does not fit fails, and its error says which of these to change.

Install: `make agent-runtimes` (npm, pinned), or put `claude` on PATH, or set $CLAUDE_BIN.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from asyncrl.agents.runner import anthropic_base
from asyncrl.agents.sandbox import Sandbox, SandboxLimits
from asyncrl.agents.swe import check_repo, write_files

REPO = Path(__file__).resolve().parents[3]
# Where `make agent-runtimes` installs it (npm, into the ignored build/ folder).
LOCAL_BIN = REPO / "build" / "node" / "node_modules" / ".bin" / "claude"
INSTALL = "make agent-runtimes (npm install @anthropic-ai/claude-code@2.1.332)"

SYSTEM_PROMPT = ("You are a coding agent. Fix the bug with the tools, then check that the "
                 "test passes. Be brief.")
TOOLS = "Bash,Read,Edit"
MAX_TURNS = 4  # model calls per session
# What makes its request fit a small context (see the module docstring).
CLAUDE_ARGS = ["--bare", "--system-prompt", SYSTEM_PROMPT, "--tools", TOOLS]
# Claude Code ships as one large executable: its address space is most of the memory limit.
LIMITS = dict(cpu_s=120, wall_s=300, memory_mb=4096, max_procs=256, file_mb=64,
              output_chars=200_000)
# Nothing but the model's requests: no telemetry, error reports, update checks or surveys.
QUIET = {"DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
         "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
         "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
         "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1"}
TOO_LONG = "prompt is too long"


class ClaudeCodeError(RuntimeError):
    """Claude Code could not run an episode (not installed, or its request did not fit)."""


def claude_bin() -> str:
    """The `claude` executable: $CLAUDE_BIN, else PATH, else `make agent-runtimes`' copy."""
    found = os.environ.get("CLAUDE_BIN") or shutil.which("claude") or (
        str(LOCAL_BIN) if LOCAL_BIN.exists() else None)
    if found is None:
        raise ClaudeCodeError(f"Claude Code is not installed: {INSTALL}, or set $CLAUDE_BIN")
    return os.path.realpath(found)


def claude_command(prompt: str, *, args: list[str], max_turns: int) -> list[str]:
    """The headless command line: one prompt, JSON result, tools allowed without asking."""
    return [claude_bin(), "-p", prompt, *args, "--max-turns", str(max_turns),
            "--output-format", "json", "--permission-mode", "acceptEdits",
            "--allowedTools", TOOLS]


def claude_env(base_url: str, api_key: str, home: Path) -> dict[str, str]:
    """Its whole environment: the proxy, the session key, a private HOME, quiet switches."""
    path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"  # `python` has pytest
    return {"PATH": path, "HOME": str(home), "ANTHROPIC_BASE_URL": anthropic_base(base_url),
            "ANTHROPIC_API_KEY": api_key, "SHELL": "/bin/bash", **QUIET}


def read_result(stdout: str, stderr: str) -> dict[str, Any]:
    """Claude Code's `--output-format json` result; a clear error when its request was too long."""
    try:
        result = json.loads(stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        raise ClaudeCodeError(f"Claude Code printed no JSON result; stdout {stdout[-1500:]!r}, "
                              f"stderr {stderr[-1500:]!r}") from None
    text = str(result.get("result", ""))
    too_long = result.get("terminal_reason") == "prompt_too_long" or TOO_LONG in text.lower()
    if result.get("is_error") and too_long and result.get("num_turns", 0) <= 1:
        raise ClaudeCodeError(
            f"Claude Code's first request does not fit the model's context ({text.strip()}). "
            "Its default system prompt and tools come to about 20,000 tokens: run it with "
            "--bare, a short --system-prompt and --tools naming few tools (CLAUDE_ARGS in "
            "examples/agents/claude_code/agent.py), or serve a longer context "
            "(local_engine.max_seq_len).")
    return result


async def run_claude(base_url: str, api_key: str, item: dict[str, Any], *,
                     args: list[str] = CLAUDE_ARGS, max_turns: int = MAX_TURNS,
                     ) -> tuple[float, dict[str, Any]]:
    """One Claude Code episode on `item`'s repository; returns (reward, Claude Code's result)."""
    meta = item["metadata"]
    port = urlsplit(base_url).port
    limits = SandboxLimits(network=True, tcp_ports=(port,) if port else None, **LIMITS)
    binary = claude_command(item["question"], args=args, max_turns=max_turns)
    with tempfile.TemporaryDirectory(prefix="claude-code-") as tmp:
        repo, home = Path(tmp) / "repo", Path(tmp) / "home"
        home.mkdir()
        write_files(repo, meta["files"])
        # The sandbox may write in its working dir only: the episode folder holds the repo
        # (Claude Code's working dir, `env -C`) and the HOME where it keeps its state.
        ran = await Sandbox(limits, read_paths=(Path(binary[0]).parent,)).run(
            ["/usr/bin/env", "-C", str(repo), *binary], cwd=tmp,
            env=claude_env(base_url, api_key, home))
        if ran.timed_out:
            raise ClaudeCodeError(f"Claude Code ran past its limits ({LIMITS})")
        result = read_result(ran.stdout, ran.stderr)
        tests = {p: t for p, t in meta["files"].items() if Path(p).name.startswith("test_")}
        reward = await check_repo(tests, meta["test_cmd"], repo)
    return reward, result


async def claude_code_agent(base_url: str, api_key: str, item: dict[str, Any]) -> float:
    """The inline agent (`agent.fn`): one Claude Code episode, its reward."""
    reward, _ = await run_claude(base_url, api_key, item)
    return reward


if __name__ == "__main__":  # as a subprocess agent: the task from $ASYNCRL_TASK_FILE
    task = json.loads(Path(os.environ["ASYNCRL_TASK_FILE"]).read_text())
    got, _ = asyncio.run(run_claude(os.environ["OPENAI_BASE_URL"],
                                    os.environ["OPENAI_API_KEY"], task))
    print(json.dumps({"reward": got}))
