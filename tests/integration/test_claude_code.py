"""Claude Code's real traffic through the agent proxy: every request answered, every
served token captured. Skipped when Claude Code is not installed (make agent-runtimes)."""

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest
from aiohttp import web

from asyncrl.agents.capture import export
from asyncrl.agents.proxy import AgentProxy
from asyncrl.agents.swe import swe_items
from asyncrl.api.types import GenerationResponse, StopReason
from asyncrl.models.tiny import make_tiny_tokenizer

pytestmark = pytest.mark.integration
AGENT = Path(__file__).resolve().parents[2] / "examples" / "agents" / "claude_code" / "agent.py"
_spec = importlib.util.spec_from_file_location("claude_code_agent", AGENT)
cc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cc)


@pytest.fixture(autouse=True)
def claude_installed():
    try:
        cc.claude_bin()
    except cc.ClaudeCodeError as e:
        pytest.skip(str(e))


class Scripted:
    """Answers request i with replies[i] (+ EOS); keeps what it served."""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.served = tok, replies, []

    async def agenerate(self, req):
        ids = self.tok.encode(self.replies[min(len(self.served), len(self.replies) - 1)]) + \
            [self.tok.eos_token_id]
        self.served.append((list(req.input_ids), ids))
        return GenerationResponse(rid=req.rid, input_ids=list(req.input_ids), output_ids=ids,
                                  output_logprobs=[-0.01 * j for j in range(len(ids))],
                                  output_versions=[0] * len(ids), stop_reason=StopReason.STOP)


def bash(command: str) -> str:
    """A Hermes tool call of Claude Code's Bash tool."""
    return "<tool_call>\n" + json.dumps({"name": "Bash", "arguments": {
        "command": command, "description": "run"}}) + "\n</tool_call>"


async def episode(replies, item, *, args, max_model_len):
    tok = make_tiny_tokenizer()
    engine, seen = Scripted(tok, replies), []

    @web.middleware
    async def log(request, handler):
        response = await handler(request)
        seen.append((request.method, request.path, response.status,
                     getattr(response, "body", None)))
        return response

    proxy = AgentProxy(engine, tok, "policy", admin_key="admin-key-cc",
                       max_model_len=max_model_len)
    build = proxy.app
    proxy.app = lambda: (lambda a: (a.middlewares.append(log), a)[1])(build())
    await proxy.start()
    session = proxy.start_session(task_id=item["id"])
    try:
        outcome = await cc.run_claude(proxy.base_url, session.api_key, item, args=args)
    except cc.ClaudeCodeError as e:
        outcome = e
    await proxy.stop()
    return outcome, seen, session, engine


def test_claude_code_fixes_the_repository_and_every_served_token_is_captured():
    item = swe_items(1, seed=0)[0]
    meta = item["metadata"]
    fix = meta["fix"]
    code = (f"import pathlib; p = pathlib.Path({fix['path']!r}); "
            f"p.write_text(p.read_text().replace({fix['old']!r}, {fix['new']!r}))")
    replies = [bash(f"python -c {json.dumps(code)}"), bash(f"python {meta['test_cmd'][1]}"),
               "Fixed; the test passes."]
    outcome, seen, session, engine = asyncio.run(
        episode(replies, item, args=cc.CLAUDE_ARGS, max_model_len=32_768))
    reward, result = outcome
    # What Claude Code sent with the example's settings: three streamed messages calls.
    assert [(m, p, st) for m, p, st, _ in seen] == [("POST", "/v1/messages", 200)] * 3
    assert reward == 1.0 and result["num_turns"] == 3  # its Bash tool applied the fix
    assert [(c.prompt_ids, c.output_ids) for c in session.completions] == engine.served
    # The test's own output came back to the model as the second tool result.
    assert "all tests passed" in make_tiny_tokenizer().decode(engine.served[2][0])
    out = export(session.completions, style="tree", discount=1.0, group_id="g")
    [traj] = out.trajectories
    assert (out.merged, out.drift) == (2, 0)
    prompt, last = engine.served[-1]
    assert traj.input_ids == prompt + last
    assert sum(traj.loss_mask) == sum(len(o) for _, o in engine.served)


def test_claude_codes_default_request_overflows_8k_and_the_error_names_the_settings():
    item = swe_items(1, seed=0)[0]
    outcome, seen, session, engine = asyncio.run(
        episode(["never"], item, args=[], max_model_len=8192))
    assert isinstance(outcome, cc.ClaudeCodeError)
    assert all(s in str(outcome) for s in ("--bare", "--system-prompt", "--tools"))
    [(method, path, status, body)] = seen
    assert (method, path, status, engine.served) == ("POST", "/v1/messages", 400, [])
    message = json.loads(body)["error"]["message"]
    assert message.startswith("prompt is too long: ") and "> 8191 maximum" in message
    assert session.refused == [f"POST /v1/messages 400: {message}"]
