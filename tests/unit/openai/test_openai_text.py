"""Incremental detokenization and tool-call parsing for the OpenAI routes."""

from __future__ import annotations

import json

import pytest

from asyncrl.models.tiny import make_tiny_tokenizer
from asyncrl.openai.detokenize import (
    IncrementalDetokenizer,
    detokenize,
    token_bytes,
    token_string,
)
from asyncrl.openai.tool_calls import ToolCallHold, hermes_messages, parse_tool_calls


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def _deltas(tok, text: str, stop=()) -> list[str]:
    detok = IncrementalDetokenizer(tok, stop)
    out = [detok.push(t) for t in tok.encode(text)]
    return out + [detok.finish()]


def test_multibyte_character_split_over_tokens_is_emitted_whole(tok):
    # "é" is 2 UTF-8 bytes and "世" is 3: one byte per token in the tiny tokenizer.
    assert len(tok.encode("aé世")) == 1 + 2 + 3
    assert _deltas(tok, "aé世") == ["a", "", "é", "", "", "世", ""]


def test_stop_string_cuts_text_and_held_prefix_is_released_when_it_diverges(tok):
    # Text that could begin the stop string is held: "l", then "lo"; at the end of the
    # generation "lo" never became "lox", so it is released.
    assert _deltas(tok, "hello", stop=["lox"]) == ["h", "e", "", "l", "", "lo"]
    # "lo w" completes at the 7th token: the held "lo " is dropped and nothing follows.
    assert _deltas(tok, "hello world", stop=["lo w"]) == (
        ["h", "e", "", "l", "", "", ""] + [""] * 5)
    assert detokenize(tok, tok.encode("hello world"), ["lo w"])[0] == "hel"


def test_eos_is_dropped_from_text_and_offsets_count_emitted_characters(tok):
    ids = tok.encode("hé") + [tok.eos_token_id]
    text, offsets = detokenize(tok, ids)
    assert text == "hé"
    assert offsets == [0, 1, 1, 2]  # the second byte of é is where é is emitted


def test_token_bytes_of_a_partial_character_and_a_special_token(tok):
    first_byte = tok.encode("é")[0]
    assert token_bytes(tok, first_byte) == b"\xc3"
    assert token_string(b"\xc3") == "bytes:\\xc3"
    assert token_bytes(tok, tok.eos_token_id) == b"<|im_end|>"
    assert token_bytes(tok, tok.encode(" ")[0]) == b" "
    assert token_bytes(tok, len(tok) + 5) == b""  # the model's vocabulary is padded past it


def test_parse_tool_calls_reads_several_blocks_and_keeps_malformed_json_as_content():
    text = ('Let me check.<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
            '<tool_call>{"name": "broken", "arguments": {</tool_call>\n'
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["add", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert calls[1]["function"]["arguments"] == "{}"
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert content == 'Let me check.<tool_call>{"name": "broken", "arguments": {</tool_call>'


def test_parse_tool_calls_leaves_text_without_valid_blocks_untouched():
    for text in ["  plain\n", '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>{"]:
        assert parse_tool_calls(text) == (text, [])


def test_tool_call_hold_streams_text_before_the_tag_and_holds_the_rest():
    hold = ToolCallHold()
    assert [hold.push(d) for d in ["Hi <to", "ol", "_call>{", "}"]] == ["Hi ", "", "", ""]
    assert hold.finish() == "<tool_call>{}"
    hold = ToolCallHold()
    assert [hold.push(d) for d in ["a <t", "x"]] == ["a ", "<tx"]


def test_hermes_messages_render_history_calls_results_and_tools():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    out = hermes_messages(history, tools, "required")
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "add"' in out[0]["content"] and "must call at least one" in out[0]["content"]
    assert out[1] == {"role": "assistant",
                      "content": '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'}
    assert out[2] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}


def test_parse_tool_calls_reads_a_list_of_calls_in_one_block():
    """SmolLM2 was trained to write `<tool_call>[{...}, {...}]</tool_call>`."""
    text = ('ok <tool_call>[{"name": "a", "arguments": {"x": 1}}, '
            '{"name": "b", "arguments": {}}]</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "ok"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("a", '{"x": 1}'), ("b", "{}")]
    # A list with a malformed call, or an empty list, stays text.
    for bad in ('<tool_call>[{"name": "a"}, {"x": 1}]</tool_call>', "<tool_call>[]</tool_call>"):
        assert parse_tool_calls(bad) == (bad, [])
