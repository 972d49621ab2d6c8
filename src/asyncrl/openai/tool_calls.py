"""Tool calls in the text a model writes: one format per model family, as vLLM's tool parsers.

    hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen, Hermes,
                 SmolLM2; a block may hold a list of calls). Text around blocks is content.
    llama3_json  Llama 3.1-3.3: the whole message is `{"name": ..., "parameters": {...}}`
                 ("arguments" too), or several joined by `;`, after an optional
                 `<|python_tag|>`. Anything else, plain JSON included, is content.
    mistral      `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3), or
                 `[TOOL_CALLS]name[ARGS]{...}`, repeated (v11+; `[ARGS]` may be missing).
                 Text before it is content; call ids are 9 letters or digits, as Mistral's
                 templates require.

Each `ToolFormat` finds the calls in a finished message (`parse`), says where a call starts
in a message being streamed (so `ToolCallHold` streams the text before it and holds the
rest), and writes calls back as text. A call that does not parse stays in the content, as
the model wrote it. `<|python_tag|>` and `[TOOL_CALLS]` are special tokens, which decoding
usually drops: `special_ids` names the ones the decoder must keep for `parse` to see them.

`tool_format` picks the format from the chat template (or by name). When the template does
not render `tools` (SmolLM2, the tiny test tokenizer), tools are described in a Hermes
system block and the history's calls and `role: "tool"` results are written as Hermes text
(`hermes_messages`; results as a user turn in `<tool_response>`, as Qwen2.5 renders them).
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from collections.abc import Mapping
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_NAME = re.compile(r"[\w.\-]+")
_WS = re.compile(r"\s*")
_JSON = json.JSONDecoder()


class ToolFormat:
    """How one model family writes tool calls."""

    name = ""
    markers: tuple[str, ...] = ()  # special tokens the calls are written with

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Split a finished message into its content and OpenAI `tool_calls`."""
        raise NotImplementedError

    def call_start(self, text: str) -> int | None:
        """Where a call begins in `text` (the message so far), if one has begun."""
        raise NotImplementedError

    def pending(self, text: str) -> int:
        """How many characters at the end of `text` may still begin a call."""
        raise NotImplementedError

    def write(self, calls: list[dict[str, Any]]) -> str:
        """OpenAI `tool_calls` as the text the model writes for them."""
        raise NotImplementedError

    def special_ids(self, tokenizer: Any) -> frozenset[int]:
        """The ids of this format's markers that are single tokens of `tokenizer`."""
        ids = set()
        for marker in self.markers:
            i = tokenizer.convert_tokens_to_ids(marker)
            if i is not None and tokenizer.convert_ids_to_tokens(i) == marker:
                ids.add(i)
        return frozenset(ids)

    def new_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def _call(self, name: str, args: Any) -> dict[str, Any]:
        return {"id": self.new_id(), "type": "function",
                "function": {"name": name, "arguments": args if isinstance(args, str)
                             else json.dumps(args, ensure_ascii=False)}}


class _Marked(ToolFormat):
    """A format whose calls begin with a marker; text before the first one streams out."""

    opener = ""

    def call_start(self, text: str) -> int | None:
        at = text.find(self.opener)
        return at if at >= 0 else None

    def pending(self, text: str) -> int:
        return next((k for k in range(min(len(self.opener) - 1, len(text)), 0, -1)
                     if text.endswith(self.opener[:k])), 0)


class Hermes(_Marked):
    """`<tool_call>` blocks, each an object or a list of them; other text is content."""

    name, opener = "hermes", OPEN

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        calls: list[dict[str, Any]] = []
        kept: list[str] = []
        pos = 0
        for match in _BLOCK.finditer(text):
            found = self._block(match.group(1))
            if found is None:
                continue
            kept.append(text[pos:match.start()])
            pos = match.end()
            calls.extend(found)
        kept.append(text[pos:])
        content = "".join(kept)
        return (content.strip() if calls else content), calls

    def _block(self, body: str) -> list[dict[str, Any]] | None:
        """An object, or a non-empty list of them (SmolLM2's trained form); None if neither."""
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        named = [_named(o, need_args=False) for o in (obj if isinstance(obj, list) and obj
                                                      else [obj])]
        if any(n is None for n in named):
            return None
        return [self._call(*n) for n in named]

    def write(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(_call_text(c) for c in calls)


class Llama3Json(ToolFormat):
    """The whole message is the calls: JSON objects joined by `;`, maybe after `<|python_tag|>`."""

    name, markers = "llama3_json", (PYTHON_TAG,)

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        body = text.strip().removeprefix(PYTHON_TAG)
        objs = _json_values(body, sep=";")
        # A call needs its arguments: `{"name": "Ada"}` is an answer, not a call.
        named = [_named(o, need_args=True) for o in objs or []]
        if not named or any(n is None for n in named):
            return text, []
        return "", [self._call(*n) for n in named]

    def call_start(self, text: str) -> int | None:
        head = text.lstrip()
        return 0 if head.startswith(("{", PYTHON_TAG)) else None

    def pending(self, text: str) -> int:
        """All of it while it is blank or a part of `<|python_tag|>`: the call may start yet."""
        return len(text) if PYTHON_TAG.startswith(text.lstrip()) else 0

    def write(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": c["function"]["name"],
                                     "parameters": _arguments(c)}, ensure_ascii=False)
                         for c in calls)


class Mistral(_Marked):
    """`[TOOL_CALLS]` then a JSON list of calls, or `name[ARGS]{...}` (repeated); text before is
    content."""

    name, opener, markers = "mistral", TOOL_CALLS, (TOOL_CALLS, ARGS)

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        at = text.find(TOOL_CALLS)
        calls = self._calls(text, at) if at >= 0 else None
        return (text, []) if calls is None else (text[:at].strip(), calls)

    def _calls(self, text: str, pos: int) -> list[dict[str, Any]] | None:
        """The calls from `pos` (a `[TOOL_CALLS]`) to the end; None unless all of it parses."""
        calls: list[dict[str, Any]] = []
        while (pos := _WS.match(text, pos).end()) < len(text):
            if text.startswith(TOOL_CALLS, pos):
                pos = _WS.match(text, pos + len(TOOL_CALLS)).end()
            if text.startswith("[", pos):  # v3: a JSON list of {name, arguments}
                objs, pos = _json_at(text, pos)
                named = [_named(o, need_args=False) for o in objs] \
                    if isinstance(objs, list) and objs else [None]
            else:  # v11+: name[ARGS]{...}
                match = _NAME.match(text, pos)
                if match is None:
                    return None
                pos = match.end() + (len(ARGS) if text.startswith(ARGS, match.end()) else 0)
                args, pos = _json_at(text, pos)
                named = [(match.group(), args) if isinstance(args, dict) else None]
            if any(n is None for n in named):
                return None
            calls.extend(self._call(*n) for n in named)
        return calls or None

    def new_id(self) -> str:
        """Nine letters and digits: Mistral's templates reject other tool call ids."""
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def write(self, calls: list[dict[str, Any]]) -> str:
        return TOOL_CALLS + json.dumps([{"name": c["function"]["name"],
                                         "arguments": _arguments(c)} for c in calls],
                                       ensure_ascii=False)


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral())}
HERMES = FORMATS["hermes"]


def detect_tool_format(chat_template: str | Mapping[str, str] | None) -> ToolFormat:
    """The format a chat template writes tool calls in; Hermes when it shows none."""
    if isinstance(chat_template, Mapping):  # named templates ("default", "tool_use")
        chat_template = "\n".join(chat_template.values())
    text = chat_template or ""
    if OPEN in text:
        return FORMATS["hermes"]
    if PYTHON_TAG in text or "ipython" in text:
        return FORMATS["llama3_json"]
    if TOOL_CALLS in text:
        return FORMATS["mistral"]
    return HERMES


def tool_format(tokenizer: Any, name: str | None = None) -> ToolFormat:
    """The format called `name`, or (None) the one the tokenizer's chat template writes."""
    if name is None:
        return detect_tool_format(getattr(tokenizer, "chat_template", None))
    if name not in FORMATS:
        raise ValueError(f"unknown tool parser {name!r}; valid: {', '.join(FORMATS)}")
    return FORMATS[name]


def parse_tool_calls(text: str, fmt: ToolFormat = HERMES) -> tuple[str, list[dict[str, Any]]]:
    """Split `text` into its content and OpenAI `tool_calls` (`fmt.parse`).

    A call that does not parse (bad JSON, no string `name`, an unterminated block) stays in
    the content so the caller sees what the model wrote.
    """
    return fmt.parse(text)


class ToolCallHold:
    """Streams text until a call starts, then holds the rest for the format's `parse`."""

    def __init__(self, fmt: ToolFormat = HERMES) -> None:
        self._fmt = fmt
        self._text = ""  # the message so far
        self._sent = 0  # characters of it already released
        self._holding = False

    def push(self, delta: str) -> str:
        """The part of `delta` that can go out as content now."""
        self._text += delta
        if self._holding:
            return ""
        at = self._fmt.call_start(self._text)
        self._holding = at is not None
        end = at if at is not None else len(self._text) - self._fmt.pending(self._text)
        out, self._sent = self._text[self._sent:end], end
        return out

    def finish(self) -> str:
        """Everything held back (from where the call starts, or a partial marker)."""
        out, self._sent = self._text[self._sent:], len(self._text)
        return out


# ---- the Hermes system block, for templates that do not render tools --------------------------

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
            calls = HERMES.write(m["tool_calls"])
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


# ---- helpers ---------------------------------------------------------------------------------

def _call_text(call: dict[str, Any]) -> str:
    body = {"name": call["function"]["name"], "arguments": _arguments(call)}
    return f"{OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CLOSE}"


def _arguments(call: dict[str, Any]) -> Any:
    """A call's arguments as an object: OpenAI sends a JSON string, the model writes an object."""
    args = call["function"]["arguments"]
    try:
        return json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return args  # keep what the client sent; the model saw it that way


def _named(obj: Any, *, need_args: bool) -> tuple[str, Any] | None:
    """(name, arguments) of a call object, or None; arguments may be under "parameters"."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if args is None:
        return None if need_args else (obj["name"], {})
    return None if need_args and not isinstance(args, dict) else (obj["name"], args)


def _json_at(text: str, pos: int) -> tuple[Any, int]:
    """The JSON value at `pos` and the index after it; (None, pos) if there is none."""
    try:
        return _JSON.raw_decode(text, pos)
    except json.JSONDecodeError:
        return None, pos


def _json_values(text: str, sep: str) -> list[Any] | None:
    """The JSON values that make up all of `text`, joined by `sep`; None if it is not that."""
    values, pos = [], 0
    while True:
        pos = _WS.match(text, pos).end()
        value, end = _json_at(text, pos)
        if end == pos:
            return None
        values.append(value)
        pos = _WS.match(text, end).end()
        if pos == len(text):
            return values
        if not text.startswith(sep, pos):
            return None
        pos = _WS.match(text, pos + len(sep)).end()
        if pos == len(text):  # a trailing separator
            return values
