"""Function calling in the Hermes / Qwen text form, for chat templates that lack tools.

A model calls a tool by writing `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
When the tokenizer's chat template does not render `tools` (SmolLM2, the tiny test
tokenizer), the tools are described in a system block and the history's assistant tool
calls and `role: "tool"` results are rewritten into that text form (results as a user turn
wrapped in `<tool_response>`, as Qwen2.5's template renders them).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def tools_system_block(tools: list[dict[str, Any]], tool_choice: Any) -> str:
    """The system text that describes `tools` and how to call them."""
    specs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    text = ("# Tools\n\nYou may call one or more functions to help with the user's request. "
            f"The functions are described inside <tools></tools>:\n<tools>\n{specs}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments inside "
            f"{OPEN}{CLOSE} tags:\n{OPEN}\n"
            '{"name": <function-name>, "arguments": <arguments-json-object>}\n' + CLOSE)
    # Without constrained decoding, `required` and a named choice are honoured by instruction.
    if tool_choice == "required":
        text += "\n\nYou must call at least one function."
    elif isinstance(tool_choice, dict):
        text += f"\n\nYou must call the function {tool_choice['function']['name']}."
    return text


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    tool_choice: Any) -> list[dict[str, Any]]:
    """`messages` with tools, tool calls and tool results written as plain text turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            content = m.get("content") or ""
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        block = tools_system_block(tools, tool_choice)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _call_text(call: dict[str, Any]) -> str:
    fn = call["function"]
    args = fn["arguments"]
    try:  # OpenAI sends arguments as a JSON string; the model should see an object
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass  # keep what the client sent; the model saw it that way
    return f"{OPEN}\n{json.dumps({'name': fn['name'], 'arguments': args}, ensure_ascii=False)}\n{CLOSE}"


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split `text` into its content and OpenAI `tool_calls`.

    A block holds one call object or a list of them. A block whose JSON does not parse, or
    whose calls lack a string `name`, stays in the content so the caller sees what the model
    wrote. An unterminated `<tool_call>` stays there too.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for match in _BLOCK.finditer(text):
        found = _as_calls(match.group(1))
        if found is None:
            continue
        kept.append(text[pos:match.start()])
        pos = match.end()
        calls.extend(found)
    kept.append(text[pos:])
    content = "".join(kept)
    return (content.strip() if calls else content), calls


def _as_calls(body: str) -> list[dict[str, Any]] | None:
    """The calls of one block: an object, or a list of objects (SmolLM2's trained form,
    `<tool_call>[{"name": ..., "arguments": ...}]</tool_call>`); None if it is neither."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    objs = obj if isinstance(obj, list) and obj else [obj]
    calls = [_as_call(o) for o in objs]
    return None if any(c is None for c in calls) else calls


def _as_call(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"],
                         "arguments": args if isinstance(args, str)
                         else json.dumps(args, ensure_ascii=False)}}


class ToolCallHold:
    """Streams text until a `<tool_call>` starts, then holds the rest for `parse_tool_calls`."""

    def __init__(self) -> None:
        self._buf = ""
        self._holding = False

    def push(self, delta: str) -> str:
        """The part of `delta` that can go out as content now."""
        self._buf += delta
        if self._holding:
            return ""
        at = self._buf.find(OPEN)
        if at >= 0:
            self._holding = True
            out, self._buf = self._buf[:at], self._buf[at:]
            return out
        keep = next((k for k in range(min(len(OPEN) - 1, len(self._buf)), 0, -1)
                     if self._buf.endswith(OPEN[:k])), 0)
        out, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return out

    def finish(self) -> str:
        """Everything held back (from the first `<tool_call>` on, or a partial tag)."""
        out, self._buf = self._buf, ""
        return out
