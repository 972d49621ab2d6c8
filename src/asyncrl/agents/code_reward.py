"""Code rewards: a completion's program run against the item's tests in the sandbox.

`code_reward` (`workflow.reward_fn: code`) scores the share of tests that pass. An item
gives its tests in one of two forms:

- HumanEval's: "prompt" (signature and docstring), "test" (source defining
  `check(candidate)`) and "entry_point" (the function's name). One test: `check(<entry>)`.
- a list "tests" of Python statements (e.g. `assert add(1, 2) == 3`), each run on its own,
  after the program, in one sandboxed process; the reward is the share that run without
  raising.

The program is the completion's last fenced ```python block when it has one, else the
whole completion. When it does not define the item's entry point, it is the item's
"prompt" followed by the completion (HumanEval's format: the model continues the prompt).

The program runs in the tests' process, as in HumanEval's own harness: code that exits 0
before the tests run (or prints the pass marks, whose name is drawn per run) passes.
Training against this reward should check for such programs.

It lives beside the sandbox (agents/) because the reward layer sits below it; the reward
registry names it by module path.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from typing import Any

from asyncrl.agents.sandbox import Sandbox, SandboxLimits, SandboxResult

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
# Per test in the "tests" form: run it, print a mark if it did not raise.
_RUN_TESTS = """
import sys as _sys
for _i, _src in enumerate({tests!r}):
    try:
        exec(compile(_src, f"<test {{_i}}>", "exec"), globals())
    except BaseException as _e:
        print(f"test {{_i}} failed: {{type(_e).__name__}}: {{_e}}", file=_sys.stderr)
    else:
        print({mark!r}, _i, flush=True)
"""
DEFAULT_LIMITS = SandboxLimits(cpu_s=5.0, wall_s=10.0, memory_mb=1024)


def extract_program(completion: str) -> str:
    """The last fenced python block of `completion`, or all of it when it has none."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def build_program(completion: str, item: dict[str, Any]) -> str:
    """The code under test: the completion's program, after the item's prompt when the
    program does not define the entry point itself."""
    program = extract_program(completion)
    entry = item.get("entry_point")
    if entry and not re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", program, re.MULTILINE):
        return item.get("prompt", "") + program
    return program


def test_script(completion: str, item: dict[str, Any],
                mark: str = "passed") -> tuple[str, int]:
    """(the script to run, how many tests it holds) for `item`'s tests in either form; in
    the "tests" form each test that passes prints `mark` and its index."""
    program = build_program(completion, item)
    if "test" in item and "entry_point" in item:
        return f"{program}\n\n{item['test']}\n\ncheck({item['entry_point']})\n", 1
    tests = item.get("tests")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError(f"item {item.get('id', '?')!r} has no tests: give HumanEval's 'test' "
                         "and 'entry_point', or 'tests' (a non-empty list of Python statements)")
    return f"{program}\n{_RUN_TESTS.format(tests=tests, mark=mark)}", len(tests)


def passed_share(result: SandboxResult, n_tests: int, *, single: bool,
                 mark: str = "passed") -> float:
    """The share of tests a sandboxed run passed: the run's success for one `check`, else
    the marks it printed (a run killed half-way keeps the tests it passed before)."""
    if single:
        return 1.0 if result.ok else 0.0
    passed = {line.split()[1] for line in result.stdout.splitlines()
              if line.startswith(mark + " ")}
    return len(passed) / n_tests


async def score_code(completion: str, item: dict[str, Any], *,
                     limits: SandboxLimits = DEFAULT_LIMITS) -> float:
    """The share of `item`'s tests that `completion` passes, run in the sandbox."""
    mark = f"passed-{secrets.token_hex(8)}"
    script, n_tests = test_script(completion, item, mark)
    result = await Sandbox(limits).run_python(script)
    return passed_share(result, n_tests, single="test" in item and "entry_point" in item,
                        mark=mark)


def code_reward(completion: str, item: dict[str, Any]) -> float:
    """The reward function: `score_code` with the default limits (see the module doc)."""
    return asyncio.run(score_code(completion, item))
