"""Tool-call formats (hermes, llama3_json, mistral): parsing, streaming hold, detection, and the
marker special tokens end to end through the OpenAI routes and the agent proxy."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from serving import serving

from asyncrl.agents.capture import export
from asyncrl.agents.proxy import AgentProxy
from asyncrl.api.types import GenerationRequest, GenerationResponse, StopReason
from asyncrl.models.tiny import CHATML_TEMPLATE, make_tiny_tokenizer
from asyncrl.openai.detokenize import detokenize
from asyncrl.openai.routes import OpenAIRoutes, openai_app
from asyncrl.openai.tool_calls import (
    FORMATS,
    ToolCallHold,
    detect_tool_format,
    parse_tool_calls,
    tool_format,
)

HERMES, LLAMA3, MISTRAL = FORMATS["hermes"], FORMATS["llama3_json"], FORMATS["mistral"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

# Small stand-ins for the real templates: they render tools, and the marker tokens.
LLAMA3_TEMPLATE = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}"
    "<|start_header_id|>{{ 'ipython' if m['role'] == 'tool' else m['role'] }}<|end_header_id|>"
    "\n\n{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<|python_tag|>"
    "{{ {'name': c['function']['name'], 'parameters': c['function']['arguments']} | tojson }}"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
    "{% elif m['role'] == 'tool' %}[TOOL_RESULTS]{{ m['content'] }}[/TOOL_RESULTS]"
    "{% elif m.get('tool_calls') %}{% for c in m['tool_calls'] %}[TOOL_CALLS]"
    "{{ c['function']['name'] }}[ARGS]{{ c['function']['arguments'] | tojson }}{% endfor %}</s>"
    "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}")


def byte_tokenizer(specials: list[str], eos: str, template: str):
    """A byte-level tokenizer whose `specials` are special tokens (decoding skips them), as
    `<|python_tag|>` is in Llama 3's tokenizer and `[TOOL_CALLS]` in Mistral's."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, chat_template=template)


@pytest.fixture(scope="module")
def llama3_tok():
    return byte_tokenizer(["<|eot_id|>", "<|eom_id|>", "<|start_header_id|>",
                           "<|end_header_id|>", "<|python_tag|>"], "<|eot_id|>", LLAMA3_TEMPLATE)


@pytest.fixture(scope="module")
def mistral_tok():
    return byte_tokenizer(["</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                           "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                           "[TOOL_CALLS]", "[ARGS]"], "</s>", MISTRAL_TEMPLATE)


def named(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# ---- parsing -------------------------------------------------------------------------------

F, G = ("f", {"x": 1}), ("g", {})


@pytest.mark.parametrize("fmt, text, content, calls", [
    (HERMES, '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', "", [F]),
    (HERMES, ('Sure.\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n'
              '<tool_call>{"name": "g", "arguments": {}}</tool_call>'), "Sure.", [F, G]),
    (LLAMA3, '{"name": "f", "parameters": {"x": 1}}', "", [F]),
    (LLAMA3, ' <|python_tag|>{"name": "f", "arguments": {"x": 1}}\n', "", [F]),
    (LLAMA3, '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', "",
     [F, G]),
    (LLAMA3, '{"name": "f", "parameters": {"q": "a; b"}}', "", [("f", {"q": "a; b"})]),
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]', "", [F]),
    (MISTRAL, ('Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, '
               '{"name": "g", "arguments": {}}]'), "Sure.", [F, G]),
    (MISTRAL, 'Sure.[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}', "Sure.", [F, G]),
])
def test_each_format_reads_its_calls_and_the_content_around_them(fmt, text, content, calls):
    got_content, got = parse_tool_calls(text, fmt)
    assert (got_content, named(got)) == (content, calls)
    assert all(c["type"] == "function" for c in got)


@pytest.mark.parametrize("fmt, text", [
    (HERMES, '<tool_call>{"name": "f", "arguments": {</tool_call>'),
    (LLAMA3, '<|python_tag|>{"name": "f", "parameters": {'),
    (LLAMA3, 'Sure. {"name": "f", "parameters": {}}'),  # a call must be the whole message
    (LLAMA3, '{"name": "Ada", "age": 36}'),  # JSON that is an answer, not a call
    (LLAMA3, '{"name": "f", "parameters": {}} and more'),
    (MISTRAL, 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"x": '),
    (MISTRAL, '[TOOL_CALLS]f[ARGS]{"x": 1} then text'),
    (MISTRAL, '[TOOL_CALLS][{"arguments": {}}]'),
])
def test_a_malformed_call_stays_in_the_content_as_written(fmt, text):
    assert parse_tool_calls(text, fmt) == (text, [])


def test_call_ids_are_unique_and_mistral_ids_are_nine_letters_or_digits():
    calls = parse_tool_calls('[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]f[ARGS]{}', MISTRAL)[1]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    assert parse_tool_calls('{"name": "f", "parameters": {}}', LLAMA3)[1][0]["id"] \
        .startswith("call_")


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL])
def test_written_calls_parse_back_to_the_same_calls(fmt):
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "f", "arguments": '{"x": 1}'}},
             {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    text = fmt.write(calls)
    assert named(parse_tool_calls(text, fmt)[1]) == [F, G]


def test_llama3_and_mistral_write_their_own_forms():
    call = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]
    assert LLAMA3.write(call) == '{"name": "f", "parameters": {"x": 1}}'
    assert MISTRAL.write(call) == '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]'


# ---- streaming -----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, deltas, out, held", [
    (HERMES, ["Hi <to", "ol_ca", 'll>{"name"', "}"], ["Hi ", "", "", ""],
     '<tool_call>{"name"}'),
    (HERMES, ["a <t", "x"], ["a ", "<tx"], ""),
    (MISTRAL, ["Sure. [TOOL", "_CA", "LLS]f[AR", "GS]{}"], ["Sure. ", "", "", ""],
     "[TOOL_CALLS]f[ARGS]{}"),
    (MISTRAL, ["a [TO", "P]"], ["a ", "[TOP]"], ""),
    # Llama 3: the call is the whole message, so blanks and a partial tag wait for the verdict.
    (LLAMA3, [" <|pyth", "on_tag|>{", "}"], ["", "", ""], " <|python_tag|>{}"),
    (LLAMA3, ["\n", '{"na', 'me"}'], ["", "", ""], '\n{"name"}'),
    (LLAMA3, [" <|py", "x {"], ["", " <|pyx {"], ""),
    (LLAMA3, ["  Hel", "lo {", "}"], ["  Hel", "lo {", "}"], ""),
])
def test_the_hold_streams_text_before_a_call_and_holds_the_call(fmt, deltas, out, held):
    hold = ToolCallHold(fmt)
    assert [hold.push(d) for d in deltas] == out
    assert hold.finish() == held


@pytest.mark.parametrize("fmt, text", [
    (HERMES, 'ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'),
    (LLAMA3, '<|python_tag|>{"name": "f", "parameters": {"x": 1}}'),
    (MISTRAL, 'ok [TOOL_CALLS]f[ARGS]{"x": 1}'),
])
def test_streamed_one_character_at_a_time_the_calls_match_the_whole_text(fmt, text):
    hold = ToolCallHold(fmt)
    streamed = "".join(hold.push(ch) for ch in text)
    rest, calls = parse_tool_calls(hold.finish(), fmt)
    assert (streamed + rest).strip() == parse_tool_calls(text, fmt)[0]
    assert named(calls) == named(parse_tool_calls(text, fmt)[1]) == [F]


# ---- detection ------------------------------------------------------------------------------

@pytest.mark.parametrize("template, name", [
    ("{{ '<tool_call>\\n' + tool_call | tojson }}", "hermes"),  # Qwen 2.5, Hermes 2 Pro
    (LLAMA3_TEMPLATE, "llama3_json"),
    ("{% if m.role == 'ipython' %}", "llama3_json"),
    (MISTRAL_TEMPLATE, "mistral"),
    ({"default": CHATML_TEMPLATE, "tool_use": MISTRAL_TEMPLATE}, "mistral"),
    (CHATML_TEMPLATE, "hermes"),  # no tool syntax: our Hermes system block
    (None, "hermes"),
])
def test_the_format_is_detected_from_the_chat_template(template, name):
    assert detect_tool_format(template).name == name


def test_a_named_parser_overrides_detection_and_an_unknown_name_is_refused(llama3_tok):
    assert tool_format(llama3_tok).name == "llama3_json"
    assert tool_format(llama3_tok, "mistral").name == "mistral"
    with pytest.raises(ValueError, match="valid: hermes, llama3_json, mistral"):
        tool_format(llama3_tok, "qwen")
    with pytest.raises(ValueError, match="'qwen'"):
        OpenAIRoutes(None, llama3_tok, "m", tool_parser="qwen")


def test_routes_use_the_template_format_only_when_the_template_renders_tools(llama3_tok):
    assert OpenAIRoutes(None, llama3_tok, "m").tool_format.name == "llama3_json"
    tiny = make_tiny_tokenizer()  # ChatML without tools: the Hermes system block teaches Hermes
    assert OpenAIRoutes(None, tiny, "m").tool_format.name == "hermes"
    assert OpenAIRoutes(None, tiny, "m", tool_parser="mistral").tool_format.name == "mistral"


# ---- marker special tokens, end to end ------------------------------------------------------

class ScriptedEngine:
    """Answers request i with replies[i]'s tokens (special tokens included) and EOS."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.replies = tokenizer, replies
        self.prompts: list[list[int]] = []

    def ids(self, i: int) -> list[int]:
        text = self.replies[min(i, len(self.replies) - 1)]
        return self.tokenizer.encode(text, add_special_tokens=False) + \
            [self.tokenizer.eos_token_id]

    async def agenerate(self, req: GenerationRequest) -> GenerationResponse:
        ids = self.ids(len(self.prompts))
        self.prompts.append(list(req.input_ids))
        return GenerationResponse(rid=req.rid, input_ids=list(req.input_ids), output_ids=ids,
                                  output_logprobs=[-0.5] * len(ids), output_versions=[0] * len(ids),
                                  stop_reason=StopReason.STOP)


MISTRAL_REPLY = 'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'


def test_the_marker_is_a_special_token_that_plain_decoding_drops(mistral_tok):
    ids = ScriptedEngine(mistral_tok, [MISTRAL_REPLY]).ids(0)
    marker = mistral_tok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert ids.count(marker) == 1 and MISTRAL.special_ids(mistral_tok) == {
        marker, mistral_tok.convert_tokens_to_ids("[ARGS]")}
    assert detokenize(mistral_tok, ids)[0] == MISTRAL_REPLY.replace("[TOOL_CALLS]", "")
    assert detokenize(mistral_tok, ids, keep={marker})[0] == MISTRAL_REPLY


@pytest.mark.parametrize("stream", [False, True])
def test_a_mistral_call_written_with_the_special_token_comes_back_as_a_tool_call(
        mistral_tok, stream):
    engine = ScriptedEngine(mistral_tok, [MISTRAL_REPLY])
    with serving(openai_app(engine, mistral_tok, "m")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        args = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}],
                "tools": TOOLS}
        if stream:
            chunks = list(client.chat.completions.create(**args, stream=True))
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            last = chunks[-1].choices[0]
            finish, calls = last.finish_reason, last.delta.tool_calls
            assert content == "Checking. "  # the text before the marker, as it was made
        else:
            choice = client.chat.completions.create(**args).choices[0]
            finish, calls = choice.finish_reason, choice.message.tool_calls
            assert choice.message.content == "Checking."
    assert finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris"})]
    assert len(calls[0].id) == 9
    assert "[AVAILABLE_TOOLS]" in mistral_tok.decode(engine.prompts[0])  # rendered natively


def test_without_tools_the_marker_is_not_kept(mistral_tok):
    engine = ScriptedEngine(mistral_tok, [MISTRAL_REPLY])
    with serving(openai_app(engine, mistral_tok, "m")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(model="m",
                                             messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content == MISTRAL_REPLY.replace("[TOOL_CALLS]", "")


ADMIN = "admin"


@pytest.mark.parametrize("which, reply", [
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'),
])
def test_the_proxy_renders_a_returned_call_as_the_tokens_the_model_sampled(
        which, reply, llama3_tok, mistral_tok):
    tok = {"llama3": llama3_tok, "mistral": mistral_tok}[which]

    async def main():
        engine = ScriptedEngine(tok, [reply, "18 C and sunny."])
        proxy = AgentProxy(engine, tok, "policy", admin_key=ADMIN)
        await proxy.start("127.0.0.1", 0)
        start = proxy.base_url.removesuffix("/v1") + "/rl/start_session"
        async with aiohttp.ClientSession() as s, s.post(
                start, json={}, headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            key = (await r.json())["api_key"]
        client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        first = await client.chat.completions.create(model="p", messages=messages, tools=TOOLS)
        msg = first.choices[0].message
        messages += [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "18 C"}]
        await client.chat.completions.create(model="p", messages=messages, tools=TOOLS)
        session = proxy.store.active()[0]
        await client.close()
        await proxy.stop()
        return engine, msg, session

    engine, msg, session = asyncio.run(asyncio.wait_for(main(), 60))
    assert msg.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    # The second prompt continues the first prompt and the sampled ids, marker token included.
    first, sampled = engine.prompts[0], engine.ids(0)
    assert engine.prompts[1][:len(first) + len(sampled)] == first + sampled
    assert session.completions[0].text == reply
    out = export(session.completions, style="tree", discount=1.0, group_id="g")
    assert (len(out.trajectories), out.merged, out.drift) == (1, 1, 0)
