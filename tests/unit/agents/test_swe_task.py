"""The generated SWE repos, their sandboxed check, and mini-swe-agent against a scripted server."""

import asyncio
import json
import os
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from aiohttp import web

from asyncrl.agents.swe import check_repo, make_repo_task, mini_swe_agent, swe_items

KEY = "sk-session-7"


def _fixed(task: dict) -> dict[str, str]:
    fix, files = task["fix"], dict(task["files"])
    files[fix["path"]] = files[fix["path"]].replace(fix["old"], fix["new"])
    return files


def test_same_seed_same_task_and_different_seeds_vary():
    assert make_repo_task(3) == make_repo_task(3)
    tasks = [make_repo_task(s) for s in range(40)]
    assert len({json.dumps(t["files"], sort_keys=True) for t in tasks}) == 40
    assert {t["bug"] for t in tasks} == {"off-by-one", "wrong operator", "swapped arguments"}


def test_items_carry_the_question_and_the_repo():
    items = swe_items(3, seed=5)
    assert [i["id"] for i in items] == ["swe-5-0", "swe-5-1", "swe-5-2"]
    assert items == swe_items(3, seed=5)
    for item in items:
        assert item["task"] == "swe" and item["answer"] == ""
        meta = item["metadata"]
        assert meta["test_cmd"][1] in meta["files"] and meta["fix"]["path"] in item["question"]
        # the fix is one unambiguous edit of the planted line
        assert meta["files"][meta["fix"]["path"]].count(meta["fix"]["old"]) == 1


@pytest.mark.parametrize("seed", range(6))
def test_repo_fails_before_the_fix_and_passes_after(seed, tmp_path):
    task = make_repo_task(seed)
    assert asyncio.run(check_repo(task["files"], task["test_cmd"], tmp_path / "a")) == 0.0
    assert asyncio.run(check_repo(_fixed(task), task["test_cmd"], tmp_path / "b")) == 1.0


def test_files_outside_the_repo_are_refused(tmp_path):
    with pytest.raises(ValueError, match="outside"):
        asyncio.run(check_repo({"../evil.py": ""}, ["python", "x.py"], tmp_path))


# -- mini-swe-agent end to end --------------------------------------------------------


def _reply(command: str | None) -> str:
    if command is None:
        return "I think the bug is somewhere."  # no command block: a format error
    return f"THOUGHT: next step.\n\n```mswea_bash_command\n{command}\n```"


def _fix_command(task: dict) -> str:
    fix = task["fix"]
    code = (f"import pathlib; p = pathlib.Path({fix['path']!r}); "
            f"p.write_text(p.read_text().replace({fix['old']!r}, {fix['new']!r}))")
    return f"python -c {shlex.quote(code)}"


class ScriptedServer:
    """An OpenAI-compatible /v1/chat/completions on 127.0.0.1 answering scripted replies."""

    def __init__(self, replies: list[str], error: dict | None = None):
        self.replies, self.error, self.seen = replies, error, []

    async def chat(self, request: web.Request) -> web.Response:
        self.seen.append((request.headers.get("Authorization"), await request.json()))
        if self.error:
            return web.json_response({"error": self.error}, status=400)
        content = self.replies[min(len(self.seen), len(self.replies)) - 1]
        return web.json_response({
            "id": f"c{len(self.seen)}", "object": "chat.completion", "created": 0,
            "model": "policy", "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                         "total_tokens": 2},
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content}}]})

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}/v1"

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


def _episode(item: dict, replies: list[str], error: dict | None = None):
    async def go():
        server = ScriptedServer(replies, error)
        async with server as base_url:
            reward = await mini_swe_agent(base_url, KEY, item)
        return reward, server.seen
    return asyncio.run(go())


@pytest.fixture(scope="module")
def item():
    pytest.importorskip("minisweagent")
    return swe_items(1, seed=11)[0]


def test_agent_that_applies_the_fix_and_submits_gets_reward_one(item):
    reward, seen = _episode(item, [_reply(_fix_command(item["metadata"])),
                                   _reply("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")])
    assert reward == 1.0
    assert len(seen) == 2 and all(auth == f"Bearer {KEY}" for auth, _ in seen)
    first, second = seen[0][1], seen[1][1]
    assert first["max_tokens"] == 192 and item["question"] in first["messages"][1]["content"]
    assert "<returncode>0</returncode>" in second["messages"][-1]["content"]


def test_agent_that_only_looks_around_hits_the_step_limit_with_reward_zero(item):
    reward, seen = _episode(item, [_reply("ls && cat *.py")])
    assert reward == 0.0 and len(seen) == 5  # SweAgentConfig.step_limit


def test_editing_the_test_file_does_not_pay(item):
    test_path = item["metadata"]["test_cmd"][1]
    reward, _ = _episode(item, [_reply(f"echo 'print(1)' > {test_path}"),
                                _reply("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")])
    assert reward == 0.0


def test_replies_without_a_command_end_after_three_format_errors(item):
    reward, seen = _episode(item, [_reply(None)])
    assert reward == 0.0 and len(seen) == 3  # mini-swe-agent's max_consecutive_format_errors


def test_a_full_context_ends_the_episode_instead_of_raising(item):
    error = {"message": "messages come to 2100 prompt tokens; the model's context is 2048",
             "type": "invalid_request_error", "param": "messages",
             "code": "context_length_exceeded"}
    reward, seen = _episode(item, [], error=error)
    assert reward == 0.0 and len(seen) == 1


def test_episodes_do_not_starve_the_sandbox_of_the_default_executor():
    """Episodes hold their threads while their commands need the sandbox (which uses one)."""
    pytest.importorskip("minisweagent")
    items = swe_items(4, seed=2)

    async def go():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=2))
        server = ScriptedServer([_reply("ls"), _reply("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")])
        async with server as base_url:
            runs = [mini_swe_agent(base_url, KEY, item) for item in items]
            return await asyncio.wait_for(asyncio.gather(*runs), 60)

    assert asyncio.run(go()) == [0.0] * 4


def test_subprocess_agent_prints_the_reward_last(item, tmp_path):
    task_json = tmp_path / "item.json"
    task_json.write_text(json.dumps(item))

    async def go():
        server = ScriptedServer([_reply(_fix_command(item["metadata"])),
                                 _reply("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")])
        async with server as base_url:
            env = os.environ | {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": KEY}
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "asyncrl.agents.swe", "--task-json", str(task_json),
                env=env, stdout=asyncio.subprocess.PIPE)
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode, out.decode(), server.seen

    code, out, seen = asyncio.run(go())
    assert code == 0 and json.loads(out.strip().splitlines()[-1]) == {"reward": 1.0}
    assert [auth for auth, _ in seen] == [f"Bearer {KEY}"] * 2
