"""What each imitated API's request fields do here: translated, ignored with a note, or refused.

A runtime written against OpenAI's or Anthropic's API sends whatever that API accepts, so
every field the real API accepts is accepted here. Each has one treatment:

    translated  honoured: it reaches the chat prompt or the sampling
    ignored     accepted; it changes nothing a local model does (billing, caching, tiers,
                ids of server-held state that is absent). Logged once per field per process.
    refused     it would change the answer and this server cannot do it: a 400 naming the
                field when it is set to anything but its neutral value.

A field the real API does not accept stays a 400 (`unknown field`), as it is there. The
tables cover the top-level fields, message roles, content parts and input items of
/v1/chat/completions, /v1/completions, /v1/responses and /v1/messages (and
/v1/messages/count_tokens, whose fields are a subset of /v1/messages'). A test reads the
installed `openai` and `anthropic` SDKs' request types and fails on any field they list
that is not classified here.

    python -m asyncrl.openai.compat > docs/reference/api-compatibility.md
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

from asyncrl.openai.errors import OpenAIError

logger = logging.getLogger(__name__)

Treatment = Literal["translated", "ignored", "refused"]
_UNSET = (None, False, [], {})  # a refused field with one of these values is not "set"


@dataclass(frozen=True)
class Rule:
    """One field's treatment, why, and (refused fields) the values that are not refused."""

    treatment: Treatment
    note: str
    neutral: tuple[Any, ...] = _UNSET


def tr(note: str) -> Rule:
    return Rule("translated", note)


def ign(note: str) -> Rule:
    return Rule("ignored", note)


def ref(note: str, neutral: tuple[Any, ...] = _UNSET) -> Rule:
    return Rule("refused", note, neutral)


Table = dict[str, Rule]
_NO_STATE = "this server keeps no state between requests; send the whole conversation"
_BILLING = "billing, quota and account routing have no meaning here"
_CACHE = "prompt caching is automatic (a shared prefix is reused) and changes no token"
TEXT_ONLY = "the model reads text only"

# ---- /v1/chat/completions and /v1/completions -----------------------------------------------

_SAMPLING: Table = {
    "model": tr("must name the served model (the agent proxy takes any name)"),
    "temperature": tr("0 to 2"),
    "top_p": tr("(0, 1]"),
    "seed": tr("the request's own random stream"),
    "n": tr("choices per prompt, up to 64"),
    "stop": tr("stop strings; the text ends before the match"),
    "stream": tr("server-sent events"),
    "stream_options": tr("include_usage"),
    "max_tokens": tr("the completion's token limit"),
    "presence_penalty": ref("penalties are not implemented", (None, 0)),
    "frequency_penalty": ref("penalties are not implemented", (None, 0)),
    "logit_bias": ref("logit bias is not implemented"),
    "user": ign("an end-user id for abuse monitoring"),
    "top_k": tr("extension (vLLM's name): sample among the k most likely tokens"),
    "ignore_eos": tr("extension (vLLM's name): generate past the end-of-sequence token"),
    "stop_token_ids": tr("extension (vLLM's name): token ids that end the completion"),
}

COMPLETIONS: Table = {
    **_SAMPLING,
    "prompt": tr("a string, strings, token ids, or lists of token ids"),
    "logprobs": tr("the sampled tokens' log-probs and up to 20 alternatives (our engine)"),
    "echo": tr("the prompt (and its log-probs) before the completion (our engine)"),
    "suffix": ref("insertion (text after the completion) is not implemented"),
    "best_of": ref("server-side best-of-n is not implemented; ask for n and pick",
                   (None, 1)),
}

CHAT: Table = {
    **_SAMPLING,
    "messages": tr("see the roles and content parts below"),
    "max_completion_tokens": tr("as max_tokens"),
    "logprobs": tr("the sampled tokens' log-probs"),
    "top_logprobs": tr("up to 20 alternatives per token (our engine)"),
    "tools": tr("function tools, rendered by the chat template (or in Hermes form)"),
    "tool_choice": tr("none, auto, required (by the prompt), or a named function"),
    "response_format": tr("{type: text}; a JSON schema or json_object is refused (no "
                          "constrained decoding)"),
    "parallel_tool_calls": ign("the model may write several calls either way"),
    "metadata": ign("stored-completion tags; nothing is stored"),
    "store": ign("nothing is stored"),
    "service_tier": ign(_BILLING),
    "safety_identifier": ign("an end-user id for abuse monitoring"),
    "prompt_cache_key": ign(_CACHE),
    "prompt_cache_retention": ign(_CACHE),
    "prompt_cache_options": ign(_CACHE),
    "reasoning_effort": ign("the served model has no reasoning-effort control"),
    "verbosity": ign("the served model has no verbosity control"),
    "prediction": ign("predicted output only speeds up OpenAI's decoding; the answer is "
                      "the same"),
    "modalities": ref("the model writes text only", (None, [], ["text"])),
    "audio": ref("the model writes text only"),
    "web_search_options": ref("no server-side web search"),
    "moderation": ref("no moderation runs here"),
    "functions": ref("the deprecated function-calling form; send tools"),
    "function_call": ref("the deprecated function-calling form; send tool_choice"),
}

CHAT_ROLES: Table = {
    "system": tr("a system turn at its position"),
    "developer": tr("a system turn"),
    "user": tr("text content, and image parts (a vision-language model)"),
    "assistant": tr("text content and tool_calls"),
    "tool": tr("a tool result for tool_call_id"),
    "function": ref("the deprecated function-result role; send role tool"),
}

CHAT_PARTS: Table = {
    "text": tr("parts of one message are joined as they are"),
    "image_url": tr("a vision-language model's (its folder has an image processor): the "
                    "image at its place in the turn, from a data:image/...;base64 URL (the "
                    "server fetches nothing: an http(s) URL is a 400); detail is ignored. A "
                    "text-only model refuses it: " + TEXT_ONLY),
    "input_audio": ref("the model reads text only"),
    "file": ref("the model reads text only"),
}

# ---- /v1/responses --------------------------------------------------------------------------

RESPONSES: Table = {
    "model": tr("must name the served model (the agent proxy takes any name)"),
    "input": tr("a string, or items (below)"),
    "instructions": tr("a system turn first"),
    "tools": tr("function tools; other tool types are refused"),
    "tool_choice": tr("none, auto, required, or a named function"),
    "max_output_tokens": tr("the completion's token limit"),
    "temperature": tr("0 to 2"),
    "top_p": tr("(0, 1]"),
    "stream": tr("the Responses event stream"),
    "text": tr("format {type: text}; a JSON schema is refused (no constrained decoding); "
               "verbosity is ignored"),
    "top_logprobs": tr("0 only on this route"),
    "store": ign("nothing is stored"),
    "metadata": ign("stored-response tags; nothing is stored"),
    "parallel_tool_calls": ign("the model may write several calls either way"),
    "truncation": ign("a prompt longer than the context is a 400 either way"),
    "include": ign("extra output data of server tools; there are none"),
    "reasoning": ign("the served model has no reasoning-effort control or summaries"),
    "user": ign("an end-user id for abuse monitoring"),
    "safety_identifier": ign("an end-user id for abuse monitoring"),
    "prompt_cache_key": ign(_CACHE),
    "prompt_cache_retention": ign(_CACHE),
    "prompt_cache_options": ign(_CACHE),
    "service_tier": ign(_BILLING),
    "stream_options": ign("obfuscation padding of stream events"),
    "max_tool_calls": ign("limits built-in tool calls; there are none"),
    "access_programs": ign(_BILLING),
    "background_options": ign("options of background mode, which is refused"),
    "image": ign("options of the image-generation tool, which is refused"),
    "previous_response_id": ref(f"{_NO_STATE} in input (Agents SDK: leave "
                                "previous_response_id unset)"),
    "conversation": ref(f"{_NO_STATE} in input"),
    "prompt": ref("no stored prompt templates"),
    "background": ref("responses are answered while the request waits"),
    "context_management": ref("server-side compaction is not implemented"),
    "moderation": ref("no moderation runs here"),
}

RESPONSES_ITEMS: Table = {
    "message": tr("roles user, system, developer, assistant; text parts, and in user turns "
                  "input_image parts (a data URL; no file_id) for a vision-language model"),
    "function_call": tr("joined to the assistant turn before it"),
    "function_call_output": tr("a tool turn"),
    "reasoning": ign("another model's reasoning; the served model has no reasoning channel, "
                     "so the item is dropped"),
}
_SERVER_ITEM = ref("an item of a server-side tool or of server-held state, which this "
                   "server does not have")
for _kind in ("additional_tools", "apply_patch_call", "apply_patch_call_output",
              "code_interpreter_call", "compaction", "compaction_trigger", "computer_call",
              "computer_call_output", "configuration_update", "custom_tool_call",
              "custom_tool_call_output", "file_search_call", "image_generation_call",
              "item_reference", "local_shell_call", "local_shell_call_output",
              "mcp_approval_request", "mcp_approval_response", "mcp_call", "mcp_list_tools",
              "program", "program_output", "shell_call", "shell_call_output",
              "tool_search_call", "tool_search_output", "web_search_call"):
    RESPONSES_ITEMS[_kind] = _SERVER_ITEM

# ---- /v1/messages ---------------------------------------------------------------------------

MESSAGES: Table = {
    "model": tr("any name: the served model answers"),
    "max_tokens": tr("required; generation also ends where the model's context does; 0 "
                     "(the API's cache warm-up) answers no content and the prompt's token "
                     "count as input_tokens"),
    "messages": tr("see the roles and content blocks below"),
    "system": tr("a system turn first"),
    "tools": tr("custom tools {name, description, input_schema}; server tools are refused"),
    "tool_choice": tr("auto, any (required), none, or {type: tool, name}"),
    "stop_sequences": tr("stop strings"),
    "stream": tr("Anthropic's event stream"),
    "temperature": tr("0 to 2 (older clients send it)"),
    "top_p": tr("(0, 1] (older clients send it)"),
    "top_k": tr("older clients send it"),
    "context_management": tr("clear_thinking edits hold (thinking never reaches the model); "
                             "a clear_tool_uses or compact edit is a 400 when its trigger "
                             "fires, and changes nothing below it"),
    "thinking": ign("the served model has no separate thinking channel: the answer has no "
                    "thinking blocks"),
    "output_config": ign("effort and task_budget have no control in the served model; a "
                         "format (JSON schema) is refused (no constrained decoding)"),
    "metadata": ign("a user id for abuse monitoring"),
    "service_tier": ign(_BILLING),
    "cache_control": ign(_CACHE),
    "betas": ign("beta flags of Anthropic's API; the fields they enable are classified "
                 "here one by one"),
    "container": ign("a code-execution container id; server tools are refused"),
    "diagnostics": ign("prompt-cache diagnostics"),
    "inference_geo": ign(_BILLING),
    "speed": ign("the engine runs at one speed"),
    "user_profile_id": ign(_BILLING),
    "workspace_id": ign(_BILLING),
    "billing_policy": ign(_BILLING),
    "fallback_credit_token": ign(_BILLING),
    "fallbacks": ign("fallback models answer a declined request; the served model never "
                     "declines by policy"),
    "mcp_servers": ref("no MCP client runs here; give the agent its MCP tools as custom "
                       "tools"),
    "compaction": ref("a compaction request asks the server to summarise; not implemented"),
    "thread": ref(f"{_NO_STATE} in messages"),
}

MESSAGE_ROLES: Table = {
    "user": tr("text, tool_result and image blocks"),
    "assistant": tr("text and tool_use blocks"),
    "system": tr("a system turn at its position (merged into the next user turn where the "
                 "chat template renders system turns only first); clear_at "
                 "next_user_message drops it once a later user message exists; "
                 "output_config.effort is ignored"),
}

MESSAGE_BLOCKS: Table = {
    "text": tr("blocks of one turn are joined as they are; cache_control and citations "
               "are ignored"),
    "tool_use": tr("an assistant tool call"),
    "tool_result": tr("a tool turn; is_error prefixes 'Error: '"),
    "thinking": ign("another model's thinking, dropped: the served model has none"),
    "redacted_thinking": ign("another model's thinking, dropped: the served model has none"),
    "fallback": ign("a marker of a server-side model fallback, dropped"),
    "image": tr("a vision-language model's: a base64 source as the image at its place in "
                "the turn (a url source is a 400: the server fetches nothing). A text-only "
                "model refuses it: " + TEXT_ONLY),
    "document": ref("the model reads text only"),
    "search_result": ref("search-result blocks (citations) are not rendered"),
    "container_upload": ref("no code-execution container"),
    "tool_addition": ref("mid-conversation tool changes are not rendered; send tools"),
    "tool_removal": ref("mid-conversation tool changes are not rendered; send tools"),
    "compaction": ref("a compaction summary from Anthropic's server; send the messages"),
}
_SERVER_BLOCK = ref("a block of a server-side tool, which this server does not run")
for _kind in ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
              "advisor_tool_result", "code_execution_tool_result",
              "bash_code_execution_tool_result", "text_editor_code_execution_tool_result",
              "tool_search_tool_result", "mcp_tool_use", "mcp_tool_result", "mcp_tool_listing"):
    MESSAGE_BLOCKS[_kind] = _SERVER_BLOCK

# Each table under the heading its docs section has.
SECTIONS: list[tuple[str, str, Table]] = [
    ("POST /v1/chat/completions", "field", CHAT),
    ("Chat message roles", "role", CHAT_ROLES),
    ("Chat content parts", "type", CHAT_PARTS),
    ("POST /v1/completions", "field", COMPLETIONS),
    ("POST /v1/responses", "field", RESPONSES),
    ("Responses input items", "type", RESPONSES_ITEMS),
    ("POST /v1/messages (and /v1/messages/count_tokens)", "field", MESSAGES),
    ("Messages roles", "role", MESSAGE_ROLES),
    ("Messages content blocks", "type", MESSAGE_BLOCKS),
]


# ---- applying a table -----------------------------------------------------------------------

_noted: set[tuple[str, str]] = set()


def note_once(key: tuple[str, str], message: str) -> None:
    """Log `message` the first time `key` is seen in this process."""
    if key not in _noted:
        _noted.add(key)
        logger.info("%s", message)


def note_ignored(api: str, name: str, why: str) -> None:
    """Log once per process that `name` of `api` is accepted and ignored."""
    note_once((api, name), f"{api}: {name} is accepted and ignored ({why})")


def check(body: dict[str, Any], table: Table, api: str, where: str = "") -> None:
    """400 for a field `table` does not know or refuses; a note for each one it ignores."""
    unknown = sorted(set(body) - set(table))
    if unknown:
        raise OpenAIError(f"unknown field {where}{unknown[0]!r}; {api} accepts "
                          f"{sorted(table)}", param=where + unknown[0])
    for name, value in body.items():
        rule = table[name]
        if rule.treatment == "ignored" and value is not None:
            note_ignored(api, where + name, rule.note)
        elif rule.treatment == "refused" and not _neutral(value, rule.neutral):
            raise OpenAIError(f"{where}{name} is not supported: {rule.note}",
                              param=where + name)


def kind(table: Table, value: Any, api: str, where: str, what: str = "type") -> Rule:
    """The rule of a role or type `value` (a 400 naming `where` when unknown or refused)."""
    rule = table.get(value) if isinstance(value, str) else None
    if rule is None:
        known = sorted(k for k, r in table.items() if r.treatment != "refused")
        raise OpenAIError(f"{where} {what} {value!r} is not one {api} accepts; use one of "
                          f"{known}", param=where)
    if rule.treatment == "refused":
        raise OpenAIError(f"{where} {what} {value!r} is not supported: {rule.note}",
                          param=where)
    if rule.treatment == "ignored":
        note_ignored(api, f"{what} {value}", rule.note)
    return rule


def refuse_text_only(where: str, value: str, what: str = "type") -> None:
    """The 400 of an image part or block sent to a model that reads text only."""
    raise OpenAIError(f"{where} {what} {value!r} is not supported: {TEXT_ONLY}", param=where)


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether `value` is one of `neutral` (0 is not false, 1 is not true)."""
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


# ---- the docs page --------------------------------------------------------------------------

def markdown() -> str:
    """docs/reference/api-compatibility.md: one table per API part."""
    lines = ["# API compatibility", "",
             "<!-- Generated by `python -m asyncrl.openai.compat`; edit "
             "src/asyncrl/openai/compat.py instead. -->", "",
             "What each request field of the imitated APIs does here (the OpenAI gateway "
             "and engine server, and the agent proxy). **translated**: honoured. "
             "**ignored**: accepted, changes nothing for a local model, logged once per "
             "field per process. **refused**: it would change the answer and cannot be "
             "honoured here: a 400 naming it when it is set (to anything but null, false, an "
             "empty list or object, or the values a row names as accepted). A field the real "
             "API does not accept is a 400 here too. A test checks that every field of the "
             "installed `openai` and `anthropic` SDKs' request types is in these tables.", ""]
    for title, column, table in SECTIONS:
        counts = {t: sum(r.treatment == t for r in table.values())
                  for t in ("translated", "ignored", "refused")}
        lines += [f"## {title}", "",
                  ", ".join(f"{n} {t}" for t, n in counts.items()) + ".", "",
                  f"| {column} | treatment | note |", "|---|---|---|"]
        for name in sorted(table):
            rule = table[name]
            note = rule.note
            if rule.treatment == "refused" and rule.neutral != _UNSET:
                accepted = ", ".join(json.dumps(n) for n in rule.neutral if n is not None)
                note += f" (accepted: {accepted})"
            lines.append(f"| `{name}` | {rule.treatment} | {note} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
