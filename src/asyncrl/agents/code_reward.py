"""Code rewards: a completion's program run against the item's tests in the sandbox.

`code_reward` (`workflow.reward_fn: code`) scores the share of tests that pass. An item
gives its tests in one of two forms:

- HumanEval's: "prompt" (signature and docstring), "test" (source defining
  `check(candidate)`) and "entry_point" (the function's name). One test: `check(<entry>)`.
- a list "tests" of Python statements (e.g. `assert add(1, 2) == 3`), each run on its own,
  after the program, in one sandboxed process; the reward is the share that run without
  raising.

The program is the completion's last fenced ```python block that defines the item's entry
point (else its last fenced block; with none, the whole completion). When it does not
define the entry point, it is the item's "prompt" followed by the completion (HumanEval's
format: the model continues the prompt).

The program runs in the tests' process, as in HumanEval's own harness. A test counts as
passed only when the run prints a mark after it, a name drawn per run: a program that
exits early (`sys.exit(0)`, `os._exit(0)`) passes nothing, in either form. What the mark
does not stop is a program that reads it from its own process (its frames, or
/proc/self/cmdline, which the sandbox lets it read); training against this reward at scale
should still look at what the high-reward programs do.

`code_reward` returns (share, info): info records the sandbox's limits (`limits`: CPU and
wall seconds, memory MB, processes, file MB, network), the fences in force (`isolation`,
see agents/sandbox.py), and the run's tests, passes, exit code and timeout; the RLVR
workflow keeps it in each trajectory's meta as "reward_info".

It lives beside the sandbox (agents/) because the reward layer sits below it; the reward
registry names it by module path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import secrets
from typing import Any

from asyncrl.agents.sandbox import Sandbox, SandboxLimits, SandboxResult

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
# Per test in the "tests" form: run it, print a mark if it did not raise. Each mark starts
# a line of its own, even after output that did not end with one.
_RUN_TESTS = """
import sys as _sys
for _i, _src in enumerate({tests!r}):
    try:
        exec(compile(_src, f"<test {{_i}}>", "exec"), globals())
    except BaseException as _e:
        print(f"test {{_i}} failed: {{type(_e).__name__}}: {{_e}}", file=_sys.stderr)
    else:
        print("\\n" + {mark!r}, _i, flush=True)
"""
# HumanEval's form: the mark after check(...) returns.
_RUN_CHECK = """
check({entry})
print("\\n" + {mark!r}, 0, flush=True)
"""
DEFAULT_LIMITS = SandboxLimits(cpu_s=5.0, wall_s=10.0, memory_mb=1024)


def _defines(program: str, entry: str) -> bool:
    return re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", program, re.MULTILINE) is not None


def extract_program(completion: str, entry_point: str | None = None) -> str:
    """The last fenced python block of `completion` that defines `entry_point` (else its last
    fenced block; with none, all of it): a usage example after the function is not the
    program."""
    blocks = _FENCE.findall(completion)
    if entry_point:
        defining = [b for b in blocks if _defines(b, entry_point)]
        blocks = defining or blocks
    return blocks[-1] if blocks else completion


def build_program(completion: str, item: dict[str, Any]) -> str:
    """The code under test: the completion's program, after the item's prompt when the
    program does not define the entry point itself."""
    entry = item.get("entry_point")
    program = extract_program(completion, entry)
    if entry and not _defines(program, entry):
        return item.get("prompt", "") + program
    return program


def _humaneval_form(item: dict[str, Any]) -> bool:
    return "test" in item and "entry_point" in item


def test_script(completion: str, item: dict[str, Any],
                mark: str = "passed") -> tuple[str, int]:
    """(the script to run, how many tests it holds) for `item`'s tests in either form; each
    test that passes prints `mark` and its index on a line of its own."""
    program = build_program(completion, item)
    if _humaneval_form(item):
        entry = item["entry_point"]
        if not isinstance(entry, str) or not entry.isidentifier():
            raise ValueError(f"item {item.get('id', '?')!r}: entry_point {entry!r} is not a "
                             "Python name")
        return f"{program}\n\n{item['test']}\n{_RUN_CHECK.format(entry=entry, mark=mark)}", 1
    tests = item.get("tests")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError(f"item {item.get('id', '?')!r} has no tests: give HumanEval's 'test' "
                         "and 'entry_point', or 'tests' (a non-empty list of Python statements)")
    return f"{program}\n{_RUN_TESTS.format(tests=tests, mark=mark)}", len(tests)


def passed_share(result: SandboxResult, n_tests: int, mark: str = "passed") -> float:
    """The share of tests a sandboxed run passed: the marks it printed (a run killed half-way
    keeps the tests it passed before)."""
    return _passed(result, n_tests, mark) / n_tests


def _passed(result: SandboxResult, n_tests: int, mark: str) -> int:
    indices = {line.split()[1] for line in result.stdout.splitlines()
               if line.startswith(mark + " ") and len(line.split()) == 2}
    return len(indices & {str(i) for i in range(n_tests)})


def sandbox_record(limits: SandboxLimits, result: SandboxResult) -> dict[str, Any]:
    """What fenced a run and how it ended, as JSON-ready values."""
    return {"limits": dataclasses.asdict(limits), "isolation": list(result.isolation),
            "exit_code": result.exit_code, "timed_out": result.timed_out,
            "duration_s": round(result.duration_s, 3)}


async def score_code(completion: str, item: dict[str, Any], *,
                     limits: SandboxLimits = DEFAULT_LIMITS) -> tuple[float, dict[str, Any]]:
    """(the share of `item`'s tests that `completion` passes, run in the sandbox; the run's
    record: limits, isolation, tests, passed, exit code)."""
    mark = f"passed-{secrets.token_hex(8)}"
    script, n_tests = test_script(completion, item, mark)
    result = await Sandbox(limits).run_python(script)
    passed = _passed(result, n_tests, mark)
    return passed / n_tests, {"tests": n_tests, "passed": passed,
                              **sandbox_record(limits, result)}


def code_reward(completion: str, item: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """The reward function: `score_code` with the default limits (see the module doc)."""
    return asyncio.run(score_code(completion, item))
