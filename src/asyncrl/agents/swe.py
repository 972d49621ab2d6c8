"""A software-engineering task for `mini-swe-agent`, run unchanged through a base_url.

Each item is a tiny generated Python project whose test fails because of one planted bug
(an off-by-one, a wrong operator or swapped arguments). The agent is mini-swe-agent's own
`DefaultAgent` with its text-based litellm model (```mswea_bash_command``` blocks, so no
tool-calling support is needed from the model) pointed at an OpenAI-compatible base_url,
and an environment that runs each command in `Sandbox` inside a copy of the repo. Reward:
1.0 if the project's test passes afterwards, with the test file restored first so that
editing the test does not pay.

mini-swe-agent is an optional dependency (`pip install mini-swe-agent`; it pulls litellm):
it is imported only when an agent runs, so the task generator works without it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import random
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncrl.agents.sandbox import Sandbox, SandboxLimits

logger = logging.getLogger(__name__)

# -- tasks ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Bug:
    kind: str
    names: tuple[str, ...]  # disjoint across bugs, so a module's two functions never clash
    params: str
    good: str  # the correct return expression
    bad: str  # the planted bug
    args: Callable[[random.Random], tuple]


def _ints(rng: random.Random, lo: int = 3, hi: int = 7) -> list[int]:
    return [rng.randint(-5, 20) for _ in range(rng.randint(lo, hi))]


def _below_args(rng: random.Random) -> tuple:
    xs = _ints(rng)
    return xs, rng.choice(xs)  # a limit equal to an element is what tells < from <=


_BUGS = [
    _Bug("off-by-one", ("sum_upto", "total_to", "sum_first"), "n",
         "sum(range(1, n + 1))", "sum(range(1, n))", lambda r: (r.randint(2, 30),)),
    _Bug("off-by-one", ("last_items", "take_last", "tail_of"), "xs, n",
         "xs[len(xs) - n:]", "xs[len(xs) - n + 1:]", lambda r: (_ints(r), r.randint(1, 3))),
    _Bug("off-by-one", ("factorial", "fact", "product_upto"), "n",
         "math.prod(range(1, n + 1))", "math.prod(range(1, n))", lambda r: (r.randint(2, 9),)),
    _Bug("wrong operator", ("count_below", "n_below", "how_many_below"), "xs, limit",
         "len([x for x in xs if x < limit])", "len([x for x in xs if x <= limit])", _below_args),
    _Bug("wrong operator", ("mean", "average", "avg"), "xs",
         "sum(xs) / len(xs)", "sum(xs) // len(xs)", lambda r: (_ints(r, 2, 5),)),
    _Bug("wrong operator", ("is_even", "even", "check_even"), "n",
         "n % 2 == 0", "n % 2 == 1", lambda r: (r.randint(0, 99),)),
    _Bug("wrong operator", ("perimeter", "rect_perimeter", "border_length"), "w, h",
         "2 * (w + h)", "2 * (w * h)", lambda r: (r.randint(1, 12), r.randint(3, 12))),
    _Bug("swapped arguments", ("clamp", "bound", "limit_to"), "x, lo, hi",
         "max(lo, min(x, hi))", "max(hi, min(x, lo))",
         lambda r: (r.randint(-10, 30), r.randint(0, 5), r.randint(10, 20))),
    _Bug("swapped arguments", ("power", "pow_of", "raise_to"), "base, exp",
         "base ** exp", "exp ** base", lambda r: (r.randint(2, 5), r.randint(0, 6))),
    _Bug("swapped arguments", ("difference", "subtract", "minus"), "a, b",
         "a - b", "b - a", lambda r: (r.randint(-20, 50), r.randint(-20, 50))),
]
_MODULES = ["calc", "mathutils", "helpers", "numtools", "arith", "listops", "core", "toolbox"]


def _call(bug: _Bug, body: str, args: tuple) -> Any:
    namespace: dict[str, Any] = {}
    # Our own table's expressions, never model output.
    exec(f"import math\ndef f({bug.params}):\n    return {body}\n", namespace)  # noqa: S102
    return namespace["f"](*args)


def _cases(bug: _Bug, rng: random.Random, n: int = 3) -> list[tuple[tuple, Any]]:
    """`n` (args, expected) pairs, the first of which the bug gets wrong."""
    while True:
        args = bug.args(rng)
        if _call(bug, bug.good, args) != _call(bug, bug.bad, args):
            break
    cases = [args] + [bug.args(rng) for _ in range(n - 1)]
    return [(a, _call(bug, bug.good, a)) for a in cases]


def _asserts(name: str, cases: list[tuple[tuple, Any]]) -> str:
    return "".join(f"    assert {name}({', '.join(map(repr, a))}) == {want!r}\n"
                   for a, want in cases)


def make_repo_task(seed: int) -> dict[str, Any]:
    """A two-file project (module + test) with one planted bug; the same seed, the same task."""
    rng = random.Random(f"swe-task-{seed}")
    bug, other = rng.sample(_BUGS, 2)  # `other` is a correct neighbour function, a distractor
    name, other_name, module = rng.choice(bug.names), rng.choice(other.names), rng.choice(_MODULES)
    cases, other_cases = _cases(bug, rng), _cases(other, rng, 2)
    source = (f'"""Small helpers."""\nimport math\n\n\n'
              f"def {other_name}({other.params}):\n    return {other.good}\n\n\n"
              f"def {name}({bug.params}):\n    return {bug.bad}\n")
    test = (f"from {module} import {name}, {other_name}\n\n\n"
            f"def test_{name}():\n{_asserts(name, cases)}\n\n"
            f"def test_{other_name}():\n{_asserts(other_name, other_cases)}\n\n"
            f'if __name__ == "__main__":\n    test_{name}()\n    test_{other_name}()\n'
            f'    print("all tests passed")\n')
    test_path = f"test_{module}.py"
    (args, want) = cases[0]
    call = f"{name}({', '.join(map(repr, args))})"
    question = (f"Running `python {test_path}` fails: `{call}` should return {want!r}, "
                f"but it does not. The bug is in `{module}.py`. Fix the code so that the test "
                "passes; do not edit the test file.")
    return {"files": {f"{module}.py": source, test_path: test},
            "test_cmd": ["python", test_path], "question": question, "bug": bug.kind,
            "fix": {"path": f"{module}.py", "old": f"return {bug.bad}", "new": f"return {bug.good}"}}


def swe_items(size: int, seed: int, **_: Any) -> list[dict[str, Any]]:
    """`size` dataset items; item i is `make_repo_task(seed * 100_000 + i)` (keep size below that)."""
    items = []
    for i in range(size):
        task = make_repo_task(seed * 100_000 + i)
        meta = {k: task[k] for k in ("files", "test_cmd", "bug", "fix")}
        items.append({"id": f"swe-{seed}-{i}", "question": task["question"], "answer": "",
                      "task": "swe", "metadata": meta})
    return items


# -- sandboxed execution --------------------------------------------------------------

TEST_LIMITS = SandboxLimits(cpu_s=10, wall_s=30, memory_mb=1024, max_procs=64, file_mb=16,
                            output_chars=4000, network=False)
COMMAND_LIMITS = SandboxLimits(cpu_s=10, wall_s=15, memory_mb=1024, max_procs=64, file_mb=16,
                               output_chars=4000, network=False)


def _command_env(workdir: Path) -> dict[str, str]:
    """What a command sees: `python` is this interpreter (it has pytest), no keys or proxies."""
    path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
    return {"PATH": path, "HOME": str(workdir), "LANG": "C.UTF-8", "PAGER": "cat",
            "PYTHONDONTWRITEBYTECODE": "1"}


def write_files(workdir: str | Path, files: dict[str, str]) -> None:
    """Write `files` (relative path -> text) under `workdir`, refusing paths that leave it."""
    root = Path(workdir).resolve()
    for rel, text in files.items():
        path = (root / rel).resolve()
        if not path.is_relative_to(root):
            raise ValueError(f"file path {rel!r} is outside the repository")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


async def check_repo(files: dict[str, str], test_cmd: list[str], workdir: str | Path) -> float:
    """Write `files` into `workdir`, run `test_cmd` in the sandbox: 1.0 if it exits 0."""
    write_files(workdir, files)
    argv = [sys.executable if a == "python" else a for a in test_cmd]
    result = await Sandbox(TEST_LIMITS).run(argv, cwd=str(workdir),
                                             env=_command_env(Path(workdir)))
    return 1.0 if result.exit_code == 0 and not result.timed_out else 0.0


# -- the agent ------------------------------------------------------------------------

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # mini-swe-agent's end-of-task marker

# Short prompts in mini-swe-agent's text format: its stock ones are ~1,500 tokens, too many
# for a 2,048-token context.
SYSTEM_TEMPLATE = f"""You are a coding agent in a Linux shell. Reply with one short THOUGHT \
line, then exactly ONE bash command in this block:

```mswea_bash_command
<command>
```
When the test passes, reply with the command: echo {SUBMIT}"""
INSTANCE_TEMPLATE = """{{task}}

The repository is the current directory; every command runs in a new shell there. Edit \
files with sed or python. You have {{step_limit}} commands."""
OBSERVATION_TEMPLATE = """{% if output.exception_info %}<exception>{{output.exception_info}}\
</exception>
{% endif %}<returncode>{{output.returncode}}</returncode>
<output>
{{ output.output[-1500:] }}</output>"""
FORMAT_ERROR_TEMPLATE = """Format error: {{error}} Reply with exactly ONE \
```mswea_bash_command``` block."""


@dataclass(kw_only=True)
class SweAgentConfig:
    step_limit: int = 5  # model calls, format errors included
    max_tokens: int = 192  # per reply
    wall_time_limit_s: int = 300
    model: str = "policy"  # sent as the request's model name

    def __post_init__(self):
        if self.step_limit < 1 or self.max_tokens < 1 or self.wall_time_limit_s < 1:
            raise ValueError(f"step_limit, max_tokens and wall_time_limit_s must be >= 1: {self}")


class SandboxEnvironment:
    """A mini-swe-agent environment: each command is `bash -c` in `Sandbox`, cwd the repo.

    mini-swe-agent calls `execute` from its (worker) thread; the sandbox runs on `loop`.
    """

    def __init__(self, workdir: Path, loop: asyncio.AbstractEventLoop):
        self.workdir, self.loop = workdir, loop
        self.config = {"cwd": str(workdir), "limits": asdict(COMMAND_LIMITS)}

    def execute(self, action: dict, cwd: str = "", **_: Any) -> dict[str, Any]:
        from minisweagent.exceptions import Submitted

        run = Sandbox(COMMAND_LIMITS).run(["bash", "-c", action.get("command", "")],
                                           cwd=cwd or str(self.workdir),
                                           env=_command_env(self.workdir))
        r = asyncio.run_coroutine_threadsafe(run, self.loop).result()
        code = -1 if r.exit_code is None else r.exit_code  # None: killed at the time limit
        output = {"output": r.stdout + r.stderr, "returncode": code, "exception_info": ""}
        if r.timed_out:
            output["exception_info"] = f"the command timed out after {COMMAND_LIMITS.wall_s} s"
        lines = r.stdout.lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT and r.exit_code == 0:  # as LocalEnvironment
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {"cwd": str(self.workdir), **kwargs}

    def serialize(self) -> dict:
        return {"info": {"config": {"environment": self.config,
                                    "environment_type": f"{__name__}.SandboxEnvironment"}}}


def _import_mini_swe_agent():
    # Offline: litellm would fetch its model cost map from GitHub at import; mini-swe-agent
    # would print a banner and retry a failing request 10 times with up to 60 s waits.
    for key, value in [("LITELLM_LOCAL_MODEL_COST_MAP", "True"), ("LITELLM_OFFLINE_MODE", "true"),
                       ("MSWEA_SILENT_STARTUP", "1"), ("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "2")]:
        os.environ.setdefault(key, value)
    import litellm
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    litellm.suppress_debug_info = True  # else it prints provider help on every unknown model
    return litellm, DefaultAgent, LitellmTextbasedModel


def _run_agent(base_url: str, api_key: str, task: str, env: SandboxEnvironment,
               config: SweAgentConfig) -> str:
    """Run mini-swe-agent to its end (synchronous); returns its exit status."""
    litellm, DefaultAgent, LitellmTextbasedModel = _import_mini_swe_agent()
    model = LitellmTextbasedModel(
        model_name=f"openai/{config.model}",  # litellm's generic OpenAI-compatible provider
        model_kwargs={"api_base": base_url, "api_key": api_key, "max_tokens": config.max_tokens,
                      "drop_params": True},
        cost_tracking="ignore_errors",  # an unknown model has no price; cost stays 0
        observation_template=OBSERVATION_TEMPLATE, format_error_template=FORMAT_ERROR_TEMPLATE)
    # A 400 is never worth retrying, and mini-swe-agent would retry it after a 4 s wait.
    model.abort_exceptions = [*model.abort_exceptions, litellm.BadRequestError]
    agent = DefaultAgent(model, env, system_template=SYSTEM_TEMPLATE,
                         instance_template=INSTANCE_TEMPLATE, step_limit=config.step_limit,
                         cost_limit=0, wall_time_limit_seconds=config.wall_time_limit_s)
    try:
        return agent.run(task).get("exit_status", "")
    except litellm.BadRequestError as e:
        # A tiny context fills up: the episode just ends. litellm recognises only some
        # servers' wording as ContextWindowExceededError; OpenAI's error code is surer.
        if isinstance(e, litellm.ContextWindowExceededError) or e.code == "context_length_exceeded":
            return "ContextWindowExceeded"
        raise


# mini-swe-agent holds a thread for a whole episode. Taken from the loop's default executor
# (CPUs + 4 threads), a few episodes would hold them all while their commands wait for the
# sandbox, which needs one of them too: a deadlock. Threads start only when needed.
_AGENT_THREADS = ThreadPoolExecutor(max_workers=512, thread_name_prefix="mini-swe-agent")


async def mini_swe_agent(base_url: str, api_key: str, item: dict[str, Any],
                         config: SweAgentConfig | None = None) -> float:
    """One mini-swe-agent episode on `item`'s repo through `base_url`; returns the reward."""
    config = config or SweAgentConfig()
    meta = item["metadata"]
    with tempfile.TemporaryDirectory(prefix="swe-") as tmp:
        workdir = Path(tmp)
        write_files(workdir, meta["files"])
        loop = asyncio.get_running_loop()
        episode = functools.partial(_run_agent, base_url, api_key, item["question"],
                                    SandboxEnvironment(workdir, loop), config)
        status = await loop.run_in_executor(_AGENT_THREADS, episode)
        tests = {p: t for p, t in meta["files"].items() if Path(p).name.startswith("test_")}
        reward = await check_repo(tests, meta["test_cmd"], workdir)
    logger.info("swe item %s: %s, reward %s", item.get("id"), status, reward)
    return reward


def main(argv: list[str] | None = None) -> None:
    """`python -m asyncrl.agents.swe --task-json FILE`: one episode, `{"reward": x}` last."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--task-json", required=True, type=Path, help="a dataset item (JSON)")
    parser.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "policy"),
                        help="the model name to request (default: $OPENAI_MODEL or 'policy')")
    args = parser.parse_args(argv)
    item = json.loads(args.task_json.read_text())
    reward = asyncio.run(mini_swe_agent(os.environ["OPENAI_BASE_URL"],
                                        os.environ["OPENAI_API_KEY"], item,
                                        SweAgentConfig(model=args.model)))
    print(json.dumps({"reward": reward}), flush=True)


if __name__ == "__main__":
    main()
