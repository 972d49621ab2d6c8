"""Agent tools: the calculator, Python in the sandbox, the tool box and the group cache."""

import asyncio
import json
from typing import ClassVar

import pytest

from asyncrl.agents.sandbox import Sandbox, SandboxLimits
from asyncrl.agents.tools import Calculator, PythonTool, ToolBox, ToolCache, group_cache, tool_spec


def calc(expression: str) -> str:
    return asyncio.run(Calculator()({"expression": expression}))


@pytest.mark.parametrize(("expression", "value"), [
    ("2 + 3 * 4", "14"),
    ("(2 + 3) * 4", "20"),
    ("7 / 2", "3.5"),
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),
    ("17 % 5", "2"),
    ("2 ** 10", "1024"),
    ("-2 ** 2", "-4"),
    ("(-2) ** 2", "4"),
    ("2 ** -1", "0.5"),
    ("1.5 * 4", "6.0"),
    (" (17 * 23 - 4) / 3 ", "129.0"),
])
def test_calculator_values(expression, value):
    assert calc(expression) == value


@pytest.mark.parametrize(("expression", "error"), [
    ("2 +", "error: invalid syntax"),
    ("x + 1", "error: unknown name 'x'"),
    ("__import__('os').system('id')", "error: unsupported expression"),
    ("2 ** 100000", "error: exponent 100000 larger than 10000"),
    ("10 ** 5000", "error: result too large"),  # 5001 digits > 1000
    ("1.5 ** 5000", "error: result too large"),  # float overflow
    ("1 / 0", "error: division by zero"),
    ("5 % 0", "error: division by zero"),
    ("2 ^ 3", "error: '^' is not supported"),
    ("(-8) ** 0.5", "error: fractional power of a negative number"),
    ("1" * 2000, "error: expression longer than 1000 characters"),
    ("True + 1", "error: unsupported expression"),
])
def test_calculator_errors_come_back_as_text(expression, error):
    assert calc(expression).startswith(error)


def test_calculator_without_expression_is_an_error_text():
    assert asyncio.run(Calculator()({})).startswith("error:")


def python(code: str, limits: SandboxLimits | None = None) -> str:
    return asyncio.run(PythonTool(limits)({"code": code}))


def test_python_tool_returns_what_was_printed():
    assert python("print(6 * 7)") == "42"


def test_python_tool_shows_stderr_after_stdout():
    assert python("import sys; print('a'); print('w', file=sys.stderr)") == "a\n[stderr]\nw"


def test_python_tool_reports_an_exception_and_the_exit_code():
    text = python("print('before')\n1 / 0")
    assert text.startswith("before\n[stderr]\nTraceback")
    assert "ZeroDivisionError: division by zero" in text
    assert text.endswith("exit code 1")


def test_python_tool_reports_a_timeout():
    assert python("import time; time.sleep(30)", SandboxLimits(wall_s=1)) == "timed out after 1 s"


def test_python_tool_without_output_says_so():
    assert python("x = 1") == "(no output)"


class Counting:
    """A fake tool that counts its real executions; each takes 50 ms."""

    name = "count"
    description = "echo"
    parameters: ClassVar[dict] = {"type": "object", "properties": {"x": {"type": "integer"}},
                  "required": ["x"], "additionalProperties": False}

    def __init__(self, deterministic: bool = True):
        self.deterministic = deterministic
        self.runs = 0

    async def __call__(self, args: dict) -> str:
        self.runs += 1
        await asyncio.sleep(0.05)
        return f"x={args['x']}"


class Sleepy:
    """Answers after args['s'] seconds, so later calls can finish first."""

    name = "sleepy"
    description = "sleep"
    parameters: ClassVar[dict] = {"type": "object", "properties": {"s": {"type": "number"}}, "required": ["s"]}
    deterministic = False

    async def __call__(self, args: dict) -> str:
        await asyncio.sleep(args["s"])
        return f"slept {args['s']}"


def test_tool_spec_has_the_openai_function_shape():
    spec = tool_spec(Calculator())
    assert spec["type"] == "function"
    assert spec["function"]["name"] == "calculator"
    assert spec["function"]["parameters"]["required"] == ["expression"]
    assert [s["function"]["name"] for s in ToolBox([Calculator(), Counting()]).specs] == [
        "calculator", "count"]


@pytest.mark.parametrize(("name", "arguments", "error"), [
    ("calculator", '{"expression": "1 +', "error: arguments are not valid JSON"),
    ("calculator", "[1, 2]", "error: arguments must be a JSON object"),
    ("calculator", "{}", "error: calculator is missing argument(s): expression"),
    ("calculator", '{"expression": "1", "x": 2}', "error: calculator got unexpected argument(s): x"),
    ("calculator", '{"expression": 5}', "error: argument 'expression' of calculator must be a"),
    ("search", "{}", "error: unknown tool 'search'; available: calculator"),
])
def test_toolbox_turns_model_mistakes_into_text(name, arguments, error):
    assert asyncio.run(ToolBox([Calculator()]).call(name, arguments)).startswith(error)


def test_toolbox_calls_with_a_json_string():
    assert asyncio.run(ToolBox([Calculator()]).call("calculator", '{"expression": "6*7"}')) == "42"


def test_run_tool_calls_answers_in_request_order():
    calls = [
        {"id": "a", "type": "function", "function": {"name": "sleepy", "arguments": '{"s": 0.2}'}},
        {"id": "b", "type": "function", "function": {"name": "sleepy", "arguments": '{"s": 0}'}},
        {"id": "c", "type": "function", "function": {"name": "nope", "arguments": "{}"}},
    ]
    messages = asyncio.run(ToolBox([Sleepy()]).run_tool_calls(calls))
    assert [m["tool_call_id"] for m in messages] == ["a", "b", "c"]
    assert [m["content"] for m in messages[:2]] == ["slept 0.2", "slept 0"]
    assert messages[2]["content"].startswith("error: unknown tool 'nope'")
    assert all(m["role"] == "tool" for m in messages)


def test_toolbox_records_the_sandbox_isolation_of_python_calls():
    box = ToolBox([Calculator(), PythonTool()])
    asyncio.run(box.call("calculator", {"expression": "1"}))
    assert box.isolation_used == set()
    asyncio.run(box.call("python", {"code": "print(1)"}))
    assert box.isolation_used == set(Sandbox().isolation)


def test_identical_concurrent_calls_run_once():
    tool, cache = Counting(), ToolCache()
    box = ToolBox([tool], cache=cache)

    async def two_at_once():
        return await asyncio.gather(box.call("count", '{"x": 1}'), box.call("count", {"x": 1}))

    assert asyncio.run(two_at_once()) == ["x=1", "x=1"]
    assert tool.runs == 1
    assert cache.stats() == {"hits": 1, "misses": 1, "entries": 1}


def test_different_arguments_run_separately():
    tool = Counting()
    box = ToolBox([tool], cache=ToolCache())

    async def calls():
        return [await box.call("count", {"x": 1}), await box.call("count", {"x": 2})]

    assert asyncio.run(calls()) == ["x=1", "x=2"]
    assert tool.runs == 2


def test_non_deterministic_tools_are_never_cached():
    tool, cache = Counting(deterministic=False), ToolCache()
    box = ToolBox([tool], cache=cache)

    async def twice():
        return await asyncio.gather(box.call("count", {"x": 1}), box.call("count", {"x": 1}))

    asyncio.run(twice())
    assert tool.runs == 2
    assert cache.stats() == {"hits": 0, "misses": 0, "entries": 0}


def test_group_cache_is_shared_by_the_toolboxes_of_a_group():
    tool = Counting()

    async def group():
        token = group_cache.set(ToolCache())
        try:
            samples = [ToolBox([tool]) for _ in range(4)]  # one box per sample
            # the same arguments, written with different spacing
            texts = await asyncio.gather(*(box.call("count", json.dumps({"x": 3}, indent=i))
                                           for i, box in enumerate(samples)))
            return texts, group_cache.get().stats()
        finally:
            group_cache.reset(token)

    texts, stats = asyncio.run(group())
    assert texts == ["x=3"] * 4
    assert tool.runs == 1
    assert stats == {"hits": 3, "misses": 1, "entries": 1}
    assert group_cache.get() is None


def test_cache_key_ignores_key_order_and_spacing():
    assert ToolCache.key("t", json.loads('{"a": 1, "b": [2]}')) == ToolCache.key(
        "t", json.loads('{"b":[2],"a":1}'))
    assert ToolCache.key("t", {"a": 1}) != ToolCache.key("u", {"a": 1})


def test_failed_runs_are_not_cached():
    class Flaky(Counting):
        async def __call__(self, args: dict) -> str:
            self.runs += 1
            if self.runs == 1:
                raise RuntimeError("tool bug")
            return "fine"

    tool = Flaky()
    box = ToolBox([tool], cache=ToolCache())
    with pytest.raises(RuntimeError, match="tool bug"):
        asyncio.run(box.call("count", {"x": 1}))
    assert asyncio.run(box.call("count", {"x": 1})) == "fine"
    assert tool.runs == 2
