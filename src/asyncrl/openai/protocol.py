"""OpenAI request bodies checked and turned into token ids plus our `SamplingParams`.

Every rejection is an `OpenAIError` whose `param` names the field, the way OpenAI's API
answers. `seed` gives the request its own random stream (choice i of n: a stream derived
from it), so the same weights answer it the same way whatever else the server batches.
Which fields are honoured, ignored (with a note logged once) or refused is `compat.py`'s
tables (`compat.CHAT`, `compat.COMPLETIONS`): every field OpenAI's API accepts is in them.
Top-k alternatives (completions `logprobs: k`, chat
`top_logprobs: k`) and completions `echo` (the prompt's log-probs; with `max_tokens: 0`
only those) are served by engines that compute them (our own), non-streamed; elsewhere
they are rejected. Extensions (vLLM's names): `top_k`, `ignore_eos`, `stop_token_ids`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import jinja2

from asyncrl.api.types import ImageInputs, SamplingParams
from asyncrl.openai import compat
from asyncrl.openai.errors import ContextLengthError, OpenAIError
from asyncrl.openai.images import ImagePrompts
from asyncrl.openai.tool_calls import hermes_messages

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 4096  # when the context length is not known
MAX_N = 64
MAX_TOP_LOGPROBS = 20  # alternatives per token at most (OpenAI's chat limit, vLLM's default)


@dataclass(kw_only=True)
class Job:
    """What one request asks for: prompts, sampling, and how to answer."""

    prompts: list[list[int]]
    sampling: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token (completions logprobs: k, chat top_logprobs)
    echo: bool = False  # completions: the prompt (and its log-probs) before the completion
    generate: bool = True  # False: echo with max_tokens 0, the prompt's log-probs only
    tools: list[dict[str, Any]] | None = None  # set when tool calls are to be parsed
    stop: list[str] = field(default_factory=list)
    images: ImageInputs | None = None  # chat: the images of its (one) prompt


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _int(body: dict, name: str, default: int | None, lo: int | None = None,
         hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f" in [{lo}, {hi}]" if hi is not None else f" >= {lo}" if lo is not None else ""
        raise OpenAIError(f"{name} must be an integer{bounds}, got {value!r}", param=name)
    return value


def _num(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_num(value) or not lo <= value <= hi:
        raise OpenAIError(f"{name} must be a number in [{lo}, {hi}], got {value!r}", param=name)
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpenAIError(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _check_fields(body: Any, table: compat.Table, api: str, model_name: str) -> dict:
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    compat.check(body, table, api)
    if body.get("model") != model_name:
        raise OpenAIError(f"model {body.get('model')!r} is not served here; use {model_name!r}",
                          param="model", code="model_not_found")
    return body


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise OpenAIError(f"stop must be a non-empty string or a list of them, got {stop!r}",
                          param="stop")
    return stop


def _sampling(body: dict, max_tokens: int, stop: list[str],
              top_logprobs: int = 0) -> SamplingParams:
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
        raise OpenAIError("stop_token_ids must be a list of token ids", param="stop_token_ids")
    return SamplingParams(
        max_new_tokens=max_tokens, temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_num(body, "top_p", 1.0, 1e-9, 1.0), top_k=_int(body, "top_k", 0, lo=0),
        stop=stop, stop_token_ids=ids, ignore_eos=_bool(body, "ignore_eos", False),
        top_logprobs=top_logprobs,
        seed=None if (seed := _int(body, "seed", None)) is None else seed % 2**63)


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise OpenAIError("stream_options must be {\"include_usage\": bool}",
                          param="stream_options")
    if not stream:
        raise OpenAIError("stream_options needs stream: true", param="stream_options")
    return stream, _bool(options, "include_usage", False)


def _check_length(prompt: list[int], max_model_len: int | None, param: str) -> None:
    if max_model_len is not None and len(prompt) >= max_model_len:
        raise ContextLengthError(f"{param} come to {len(prompt)} prompt tokens; the model's "
                                 f"context is {max_model_len} tokens, which leaves no room to "
                                 "generate", tokens=len(prompt), limit=max_model_len,
                                 param=param)


def parse_completion(body: Any, tokenizer, model_name: str,
                     max_model_len: int | None) -> Job:
    """Check a /v1/completions body and tokenize its prompts."""
    body = _check_fields(body, compat.COMPLETIONS, "/v1/completions", model_name)
    echo = _bool(body, "echo", False)
    logprobs = _int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    prompts = _prompts(body.get("prompt"), tokenizer)
    max_tokens = _int(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, lo=0)
    if max_tokens == 0 and not echo:
        raise OpenAIError("max_tokens: 0 generates nothing; it is for echo: true (the prompt's "
                          "log-probs)", param="max_tokens")
    for p in prompts:
        if max_tokens:
            _check_length(p, max_model_len, "prompt")
    stop = _stop(body)
    stream, usage = _stream_flags(body)
    _check_not_streamed(stream, echo=echo, top_logprobs=logprobs or 0)
    sampling = _sampling(body, max(max_tokens, 1), stop, logprobs or 0)
    return Job(prompts=prompts, sampling=sampling,
               n=_int(body, "n", 1, lo=1, hi=MAX_N), stream=stream, include_usage=usage,
               logprobs=logprobs is not None, top_logprobs=logprobs or 0, echo=echo,
               generate=max_tokens > 0, stop=stop)


def _check_not_streamed(stream: bool, *, echo: bool, top_logprobs: int) -> None:
    if stream and echo:
        raise OpenAIError("echo is served non-streamed only; drop stream", param="echo")
    if stream and top_logprobs:
        raise OpenAIError("top-k log-probs are served non-streamed only; drop stream or ask "
                          "for the sampled tokens' log-probs alone", param="logprobs")


def _prompts(prompt: Any, tokenizer) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    bad = OpenAIError("prompt must be a non-empty string, list of strings, list of token ids "
                      "or list of token-id lists", param="prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad
    out = []
    for p in prompt:
        if isinstance(p, str) and p:
            out.append(tokenizer.encode(p))
        elif isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p):
            out.append(list(p))
        else:
            raise bad
    return out


def parse_chat(body: Any, tokenizer, model_name: str, max_model_len: int | None,
               native_tools: bool, vision: ImagePrompts | None = None) -> Job:
    """Check a /v1/chat/completions body and render its messages with the chat template;
    `vision`: the processor of a model that reads images (None: image parts are refused)."""
    body = _check_fields(body, compat.CHAT, "/v1/chat/completions", model_name)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise OpenAIError("response_format other than {\"type\": \"text\"} is not supported",
                          param="response_format")
    logprobs = _bool(body, "logprobs", False)
    top_logprobs = _int(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
    if top_logprobs and not logprobs:
        raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs")
    images: list[Any] = []
    messages = _messages(body.get("messages"), vision, images)
    tools, choice = _tools(body.get("tools"), body.get("tool_choice"))
    text = render_chat_text(tokenizer, messages, tools if choice != "none" else None, choice,
                            native_tools)
    image_inputs = None
    if images or (vision is not None and vision.placeholder in text):
        prompt, image_inputs = vision.encode(text, images)
    else:
        prompt = tokenizer.encode(text, add_special_tokens=False)
    _check_length(prompt, max_model_len, "messages")
    room = max_model_len - len(prompt) if max_model_len else DEFAULT_CHAT_MAX_TOKENS
    max_tokens = _int(body, "max_completion_tokens", None, lo=1)
    max_tokens = _int(body, "max_tokens", max_tokens, lo=1) or min(room, DEFAULT_CHAT_MAX_TOKENS)
    stop = _stop(body)
    stream, usage = _stream_flags(body)
    _check_not_streamed(stream, echo=False, top_logprobs=top_logprobs)
    return Job(prompts=[prompt], sampling=_sampling(body, max_tokens, stop, top_logprobs),
               n=_int(body, "n", 1, lo=1, hi=MAX_N), stream=stream, include_usage=usage,
               logprobs=logprobs, top_logprobs=top_logprobs, stop=stop,
               tools=tools if tools and choice != "none" else None, images=image_inputs)


def _messages(messages: Any, vision: ImagePrompts | None = None,
              images: list[Any] | None = None) -> list[dict[str, Any]]:
    """Checked messages: role, text content, and tool calls or tool_call_id where present.
    Image parts (user turns, a model that reads images) become the processor's placeholder
    in the text, their images appended to `images` in order."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise OpenAIError(f"{where} must be an object with a role", param=where)
        compat.kind(compat.CHAT_ROLES, m.get("role"), "/v1/chat/completions", f"{where}.role",
                    "role")
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role,
                               "content": _content(m.get("content"), where, vision, images,
                                                   user=role == "user")}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _history_calls(m["tool_calls"], where)
        elif msg["content"] is None and role != "assistant":
            raise OpenAIError(f"{where}.content is missing", param=f"{where}.content")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise OpenAIError(f"{where}.tool_call_id must be a string",
                                  param=f"{where}.tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _content(content: Any, where: str, vision: ImagePrompts | None = None,
             images: list[Any] | None = None, user: bool = False) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise OpenAIError(f"{where}.content[{j}] must be a content part object",
                                  param=f"{where}.content[{j}]")
            compat.kind(compat.CHAT_PARTS, part.get("type"), "/v1/chat/completions",
                        f"{where}.content[{j}].type")
            if part["type"] == "image_url":
                texts.append(_image(part, f"{where}.content[{j}]", vision, images, user))
                continue
            if not isinstance(part.get("text"), str):
                raise OpenAIError(f"{where}.content[{j}].text must be a string",
                                  param=f"{where}.content[{j}].text")
            texts.append(part["text"])
        return "".join(texts)
    raise OpenAIError(f"{where}.content must be a string or a list of text parts",
                      param=f"{where}.content")


def _image(part: dict[str, Any], where: str, vision: ImagePrompts | None,
           images: list[Any] | None, user: bool) -> str:
    """An image_url part of a user turn: its image appended to `images`, the placeholder
    returned."""
    if vision is None or images is None:
        compat.refuse_text_only(f"{where}.type", "image_url")
    if not user:
        raise OpenAIError(f"{where}: image parts are for user messages", param=where)
    spec = part.get("image_url")
    if not isinstance(spec, dict):
        raise OpenAIError(f"{where}.image_url must be an object {{url, detail}}",
                          param=f"{where}.image_url")
    images.append(vision.decode_url(spec.get("url"), f"{where}.image_url.url"))
    return vision.image_text


def _history_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    ok = isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments"), str) for c in calls)
    if not ok:
        raise OpenAIError(f"{where}.tool_calls must be a list of {{id, type, function: {{name, "
                          "arguments (a JSON string)}}}}", param=f"{where}.tool_calls")
    return [{"id": c.get("id", ""), "type": "function",
             "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
            for c in calls]


def _tools(tools: Any, choice: Any) -> tuple[list[dict[str, Any]] | None, Any]:
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise OpenAIError("tool_choice needs tools", param="tool_choice")
        return None, "none"
    ok = isinstance(tools, list) and all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str) for t in tools)
    if not ok:
        raise OpenAIError("tools must be a list of {type: \"function\", function: {name, ...}}",
                          param="tools")
    names = {t["function"]["name"] for t in tools}
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or name not in names:
            raise OpenAIError(f"tool_choice names a function that is not in tools: {name!r}",
                              param="tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise OpenAIError(f"tool_choice must be none, auto, required or a named function, got "
                          f"{choice!r}", param="tool_choice")
    return tools, choice


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template renders `tools=` (else we write the Hermes form ourselves)."""
    probe = {"type": "function", "function": {"name": "asyncrl_probe_function",
                                              "parameters": {"type": "object", "properties": {}}}}
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe],
                                             tokenize=False, add_generation_prompt=True)
    except (jinja2.TemplateError, ValueError):  # no template, or one that rejects tools
        return False
    return "asyncrl_probe_function" in text


def render_chat(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                tool_choice: Any, native_tools: bool) -> list[int]:
    """The prompt token ids of `messages` under the tokenizer's chat template."""
    return tokenizer.encode(render_chat_text(tokenizer, messages, tools, tool_choice,
                                             native_tools), add_special_tokens=False)


def render_chat_text(tokenizer, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None, tool_choice: Any,
                     native_tools: bool) -> str:
    """The prompt text of `messages` under the tokenizer's chat template."""
    if native_tools:
        messages = [_native(m) for m in messages]
    else:
        messages, tools = hermes_messages(messages, tools, tool_choice), None
    try:
        text = _apply_template(tokenizer, messages, tools)
    except (jinja2.TemplateError, ValueError) as e:  # e.g. roles out of the template's order
        merged = merge_late_system(messages)
        try:
            if merged is messages:  # nothing to merge: the template's refusal stands
                raise e
            text = _apply_template(tokenizer, merged, tools)
        except (jinja2.TemplateError, ValueError):
            raise OpenAIError(f"the chat template rejected the messages: {e}",
                              param="messages") from None
        compat.note_once(("chat template", "late system"), "the chat template rejects system "
                         f"messages after the first turn ({e}); each is merged into the next "
                         "user message (the last one when none follows)")
    return text


def _apply_template(tokenizer, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=True)


def merge_late_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each system message after the first turn merged into the next user
    message's text (the last user message's, when none follows), for templates that render
    system turns only first. `messages` itself when there is nothing to merge."""
    if all(m["role"] != "system" for m in messages[1:]):
        return messages
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    for i, m in enumerate(messages):
        if m["role"] == "system" and i > 0:
            pending.append(m["content"] or "")
        elif m["role"] == "user" and pending:
            out.append({**m, "content": "\n\n".join([*pending, m["content"] or ""])})
            pending = []
        else:
            out.append(m)
    if pending:
        last = max((i for i, m in enumerate(out) if m["role"] == "user"), default=None)
        if last is None:
            return messages
        out[last] = {**out[last], "content": "\n\n".join([out[last]["content"] or "",
                                                           *pending])}
    return out


def _native(m: dict[str, Any]) -> dict[str, Any]:
    """HF templates expect tool-call arguments as an object, OpenAI sends a JSON string."""
    if "tool_calls" not in m:
        return m
    calls = []
    for c in m["tool_calls"]:
        try:
            args = json.loads(c["function"]["arguments"])
        except json.JSONDecodeError:
            args = c["function"]["arguments"]
        calls.append({**c, "function": {"name": c["function"]["name"], "arguments": args}})
    return {**m, "tool_calls": calls}
