"""Tools an agent can call, in OpenAI's function-tool format, and a per-group call cache.

Whatever the model writes (bad JSON, unknown tools, wrong arguments, code that crashes)
comes back as text for the model to read; only bugs of the tools themselves raise.
Deterministic calls repeated within a GRPO group (same tool, same arguments) run once:
the workflow that runs a group sets `group_cache` and every ToolBox of the group shares it.
"""

from __future__ import annotations

import ast
import asyncio
import contextvars
import json
import math
import operator
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from asyncrl.agents.sandbox import Sandbox, SandboxLimits


@runtime_checkable
class Tool(Protocol):
    """A function the model may call; returns the text the model sees."""

    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    deterministic: bool  # same arguments -> same output: safe to run once per group

    async def __call__(self, args: dict) -> str: ...


@dataclass(frozen=True)
class ToolOutput:
    """A tool's text and the sandbox fences it ran under (none for in-process tools)."""

    text: str
    isolation: tuple[str, ...] = ()


def tool_spec(tool: Tool) -> dict:
    """The tool in OpenAI's `tools` format."""
    return {"type": "function", "function": {
        "name": tool.name, "description": tool.description, "parameters": tool.parameters}}


def _object_schema(properties: dict[str, dict]) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


# ---------------------------------------------------------------------------------------------
# Calculator

class CalculatorError(ValueError):
    pass


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class Calculator:
    """Arithmetic on numbers: + - * / // % ** and parentheses, evaluated without eval()."""

    name = "calculator"
    description = ("Evaluate an arithmetic expression with numbers, + - * / // % ** and "
                   "parentheses, e.g. '(17 * 23 - 4) / 3'.")
    parameters = _object_schema({"expression": {
        "type": "string", "description": "the arithmetic expression"}})
    deterministic = True

    def __init__(self, *, max_chars: int = 1000, max_exponent: int = 10_000,
                 max_digits: int = 1000):
        self.max_chars = max_chars
        self.max_exponent = max_exponent
        self.max_bits = int(max_digits * math.log2(10)) + 1

    async def __call__(self, args: dict) -> str:
        expression = args.get("expression")
        if not isinstance(expression, str):
            return "error: calculator needs a string argument 'expression'"
        try:
            return _format(self.evaluate(expression))
        except CalculatorError as exc:
            return f"error: {exc}"

    def evaluate(self, expression: str) -> float:
        """The value of `expression`; CalculatorError says what is wrong with it."""
        if len(expression) > self.max_chars:
            raise CalculatorError(f"expression longer than {self.max_chars} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
            return self._eval(tree.body)
        except SyntaxError as exc:
            raise CalculatorError(f"invalid syntax: {exc.msg}") from None
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
        except (RecursionError, MemoryError):
            raise CalculatorError("expression too deeply nested") from None

    def _eval(self, node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self._check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            return self._check(_BINARY[type(node.op)](left, right))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
            raise CalculatorError("'^' is not supported; write powers as a ** b")
        if isinstance(node, ast.Name):
            raise CalculatorError(f"unknown name '{node.id}': only numbers and operators")
        raise CalculatorError(f"unsupported expression: {ast.unparse(node)[:80]}")

    def _check_power(self, base: float, exponent: float) -> None:
        if abs(exponent) > self.max_exponent:
            raise CalculatorError(f"exponent {exponent} larger than {self.max_exponent}")
        if (isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1
                and exponent * math.log2(abs(base)) > self.max_bits):
            raise CalculatorError("result too large")
        if isinstance(base, (int, float)) and base < 0 and not float(exponent).is_integer():
            raise CalculatorError("fractional power of a negative number")

    def _check(self, value: float) -> float:
        if isinstance(value, int) and value.bit_length() > self.max_bits:
            raise CalculatorError("result too large")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("result too large")
        return value


def _format(value: float) -> str:
    return repr(value) if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------------------------
# Python in the sandbox

class PythonTool:
    """Runs Python code in a Sandbox and shows the model what it printed."""

    name = "python"
    description = ("Run a Python 3 program in a fresh sandbox (no network, no state kept "
                   "between calls) and return what it prints. Use print() to see values.")
    parameters = _object_schema({"code": {"type": "string", "description": "the program"}})

    def __init__(self, limits: SandboxLimits | None = None, *, deterministic: bool = True):
        self.sandbox = Sandbox(limits or SandboxLimits())
        self.deterministic = deterministic  # False for code that reads clocks or randomness

    async def __call__(self, args: dict) -> str:
        return (await self.invoke(args)).text

    async def invoke(self, args: dict) -> ToolOutput:
        """Run the code; the text says what it printed and how it ended."""
        code = args.get("code")
        if not isinstance(code, str):
            return ToolOutput("error: python needs a string argument 'code'")
        result = await self.sandbox.run_python(code)
        parts = [result.stdout] if result.stdout else []
        if result.stderr:
            parts.append(f"[stderr]\n{result.stderr}")
        limits = self.sandbox.limits
        if result.timed_out and result.exit_code is None:
            parts.append(f"timed out after {limits.wall_s:g} s")
        elif result.timed_out:
            parts.append(f"timed out: CPU time limit of {limits.cpu_s:g} s exceeded")
        elif result.exit_code != 0:
            parts.append(f"exit code {result.exit_code}")
        text = "\n".join(p.rstrip("\n") for p in parts) if parts else "(no output)"
        return ToolOutput(text, result.isolation)


# ---------------------------------------------------------------------------------------------
# Cache and box

class ToolCache:
    """Runs each distinct deterministic call once; identical calls in flight share one run."""

    def __init__(self) -> None:
        self._runs: dict[tuple[str, str], asyncio.Future[ToolOutput]] = {}
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(name: str, args: dict) -> tuple[str, str]:
        """(tool name, canonical JSON of the arguments)."""
        return name, json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    async def get_or_run(self, key: tuple[str, str],
                         run: Callable[[], Awaitable[ToolOutput]]) -> ToolOutput:
        """The cached output for `key`, else the output of `run()` shared with later callers."""
        if key in self._runs:
            self.hits += 1
        else:
            self.misses += 1
            task = asyncio.ensure_future(run())
            task.add_done_callback(lambda t: self._forget_failure(key, t))
            self._runs[key] = task
        # shield: one caller cancelled must not cancel the run the others await
        return await asyncio.shield(self._runs[key])

    def _forget_failure(self, key: tuple[str, str], task: asyncio.Future) -> None:
        if task.cancelled() or task.exception() is not None:
            self._runs.pop(key, None)  # failures are not cached: the next call runs again

    def stats(self) -> dict[str, int]:
        """Hits, misses and stored entries."""
        return {"hits": self.hits, "misses": self.misses, "entries": len(self._runs)}


group_cache: contextvars.ContextVar[ToolCache | None] = contextvars.ContextVar(
    "group_cache", default=None)


class ToolBox:
    """The tools of an episode: their specs for the model and the calls it makes."""

    def __init__(self, tools: list[Tool], *, cache: ToolCache | None = None):
        self.tools = {tool.name: tool for tool in tools}
        if len(self.tools) != len(tools):
            raise ValueError(f"duplicate tool names in {[t.name for t in tools]}")
        self.cache = cache  # None: the group's cache (group_cache), if the workflow set one
        self.isolation_used: set[str] = set()

    @property
    def specs(self) -> list[dict]:
        """The tools in OpenAI's `tools` format."""
        return [tool_spec(tool) for tool in self.tools.values()]

    async def call(self, name: str, arguments: str | dict) -> str:
        """Run one call as the model wrote it; mistakes come back as text."""
        tool = self.tools.get(name)
        if tool is None:
            return f"error: unknown tool '{name}'; available: {', '.join(self.tools)}"
        args = _parse_arguments(arguments)
        if isinstance(args, str):
            return args
        problem = _check_arguments(tool, args)
        if problem:
            return problem
        cache = self.cache if self.cache is not None else group_cache.get()
        if tool.deterministic and cache is not None:
            output = await cache.get_or_run(ToolCache.key(name, args), lambda: _invoke(tool, args))
        else:
            output = await _invoke(tool, args)
        self.isolation_used.update(output.isolation)
        return output.text

    async def run_tool_calls(self, tool_calls: list[dict]) -> list[dict]:
        """OpenAI assistant `tool_calls` -> tool messages, in the same order."""
        async def one(call: dict) -> dict:
            function = call.get("function") or {}
            if "name" not in function:
                content = "error: tool call without a function name"
            else:
                content = await self.call(function["name"], function.get("arguments", "{}"))
            return {"role": "tool", "tool_call_id": call.get("id", ""), "content": content}
        return list(await asyncio.gather(*(one(call) for call in tool_calls)))


async def _invoke(tool: Tool, args: dict) -> ToolOutput:
    invoke = getattr(tool, "invoke", None)  # tools that report sandbox fences
    if invoke is not None:
        return await invoke(args)
    return ToolOutput(await tool(args))


def _parse_arguments(arguments: str | dict | None) -> dict | str:
    """The arguments object, or an error text for the model."""
    if isinstance(arguments, dict):
        return arguments
    if arguments is None or not arguments.strip():
        return {}
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError as exc:
        return f"error: arguments are not valid JSON ({exc.msg} at position {exc.pos})"
    if not isinstance(args, dict):
        return "error: arguments must be a JSON object"
    return args


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "number": (int, float), "integer": (int,), "boolean": (bool,),
    "object": (dict,), "array": (list,), "null": (type(None),),
}


def _check_arguments(tool: Tool, args: dict) -> str | None:
    """An error text when `args` do not fit the tool's schema (top level only), else None."""
    properties = tool.parameters.get("properties", {})
    missing = [k for k in tool.parameters.get("required", []) if k not in args]
    if missing:
        return f"error: {tool.name} is missing argument(s): {', '.join(missing)}"
    if tool.parameters.get("additionalProperties", True) is False:
        extra = [k for k in args if k not in properties]
        if extra:
            return (f"error: {tool.name} got unexpected argument(s): {', '.join(extra)}; "
                    f"it takes: {', '.join(properties)}")
    for key, value in args.items():
        expected = properties.get(key, {}).get("type")
        if expected in _JSON_TYPES:
            ok = isinstance(value, _JSON_TYPES[expected])
            if expected in ("number", "integer") and isinstance(value, bool):
                ok = False
            if not ok:
                return f"error: argument '{key}' of {tool.name} must be a {expected}"
    return None
