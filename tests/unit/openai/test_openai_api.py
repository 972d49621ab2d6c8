"""The OpenAI routes in-thread, over a scripted engine, through the official `openai` client."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import openai
import pytest
from serving import serving

from asyncrl.api.types import (
    GenerationRequest,
    GenerationResponse,
    StopReason,
    mix_seed,
)
from asyncrl.models.tiny import make_tiny_tokenizer
from asyncrl.openai.routes import openai_app

MODEL = "scripted"
KEY = "sk-test"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


class ScriptedEngine:
    """Answers every request with the tokens of a fixed text; records the prompts it got."""

    def __init__(self, tokenizer, reply: str):
        self.reply_ids = tokenizer.encode(reply) + [tokenizer.eos_token_id]
        self.prompts: list[list[int]] = []
        self.seeds: list[int | None] = []

    async def agenerate(self, req: GenerationRequest) -> GenerationResponse:
        self.prompts.append(list(req.input_ids))
        self.seeds.append(req.sampling.seed)
        ids = self.reply_ids[:req.sampling.max_new_tokens]
        reason = StopReason.STOP if len(ids) == len(self.reply_ids) else StopReason.LENGTH
        n = len(ids)
        return GenerationResponse(rid=req.rid, input_ids=list(req.input_ids), output_ids=ids,
                                  output_logprobs=[-0.25] * n, output_versions=[7] * n,
                                  stop_reason=reason)


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


@contextlib.contextmanager
def scripted(tok, reply: str) -> Iterator[tuple[openai.OpenAI, ScriptedEngine]]:
    engine = ScriptedEngine(tok, reply)
    with serving(openai_app(engine, tok, MODEL, api_key=KEY, max_model_len=2048)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0), engine


def test_tool_call_round_trip_renders_the_result_into_the_next_prompt(tok):
    with scripted(tok, CALL) as (client, engine):
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        first_prompt = tok.decode(engine.prompts[0])
        assert "<tools>" in first_prompt and '"name": "get_weather"' in first_prompt
        assert first_prompt.endswith("Weather in Paris?<|im_end|>\n<|im_start|>assistant\n")

        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
        client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        second_prompt = tok.decode(engine.prompts[1])
        assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}\n</tool_call><|im_end|>') in second_prompt
        assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>" in second_prompt


def test_streamed_tool_call_arrives_in_the_last_chunk(tok):
    with scripted(tok, "Checking." + CALL) as (client, _):
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=TOOLS, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text == "Checking."
        last = chunks[-1].choices[0]
        assert last.finish_reason == "tool_calls"
        assert last.delta.tool_calls[0].function.name == "get_weather"
        assert json.loads(last.delta.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_extension_fields_and_usage_on_a_chat_answer(tok):
    with scripted(tok, "hé") as (client, engine):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True, n=2)
        assert [c.index for c in out.choices] == [0, 1]
        choice = out.choices[0]
        assert choice.message.content == "hé" and choice.finish_reason == "stop"
        ids = tok.encode("hé") + [tok.eos_token_id]  # h, the 2 bytes of é, EOS
        assert choice.token_ids == ids and choice.prompt_token_ids == engine.prompts[0]
        assert choice.token_logprobs == [-0.25] * 4 and choice.token_versions == [7] * 4
        entries = choice.logprobs.content
        assert [e.token for e in entries] == ["h", "bytes:\\xc3", "bytes:\\xa9", "<|im_end|>"]
        assert entries[1].bytes == [0xC3] and entries[1].logprob == -0.25
        n_prompt = len(engine.prompts[0])
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (n_prompt, 8)


def test_stream_without_astream_replays_the_answer_with_usage(tok):
    with scripted(tok, "héllo") as (client, _):
        chunks = list(client.completions.create(
            model=MODEL, prompt="x", max_tokens=4, stream=True,
            stream_options={"include_usage": True}))
        pieces = [c.choices[0].text for c in chunks if c.choices]
        assert "".join(pieces) == "hél"  # 4 tokens: h, é (2 bytes), l
        assert chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.prompt_tokens == 1


def test_completion_stop_string_is_cut_from_text_but_not_from_token_ids(tok):
    with scripted(tok, "abc. def") as (client, _):
        out = client.completions.create(model=MODEL, prompt=[5, 6], stop=". ", logprobs=0)
        choice = out.choices[0]
        assert choice.text == "abc"
        assert tok.decode(choice.token_ids, skip_special_tokens=True) == "abc. def"
        assert choice.logprobs.tokens[:3] == ["a", "b", "c"]
        assert choice.logprobs.text_offset[:4] == [0, 1, 2, 3]


@pytest.mark.parametrize("kwargs, param", [
    ({"model": "other"}, "model"),
    ({"temperature": 3}, "temperature"),
    ({"top_logprobs": 2, "logprobs": True}, "top_logprobs"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "x" * 2100}]}, "messages"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
])
def test_bad_chat_requests_are_400_naming_the_field(tok, kwargs, param):
    with scripted(tok, "ok") as (client, _):
        args = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **kwargs}
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**args)
        assert err.value.status_code == 400
        assert err.value.body["param"] == param and param.split("[")[0] in err.value.message


def test_wrong_api_key_is_401_in_openai_shape(tok):
    with scripted(tok, "ok") as (client, _):
        bad = client.with_options(api_key="wrong")
        with pytest.raises(openai.AuthenticationError) as err:
            bad.models.list()
        assert err.value.body["code"] == "invalid_api_key"
        assert [m.id for m in client.models.list()] == [MODEL]


TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}CALL {{ c.function.name }}({{ c.function.arguments.city }})"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_renders_tools_gets_them_natively_with_arguments_as_objects():
    from asyncrl.openai.protocol import render_chat, template_renders_tools

    tok = make_tiny_tokenizer()
    assert not template_renders_tools(tok)
    tok.chat_template = TOOL_TEMPLATE
    assert template_renders_tools(tok)
    messages = [{"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "18 C", "tool_call_id": "c1"}]
    text = tok.decode(render_chat(tok, messages, TOOLS, "auto", native_tools=True))
    assert text == ("<tools>get_weather</tools><|im_start|>user\nParis?<|im_end|>\n"
                    "<|im_start|>assistant\nCALL get_weather(Paris)<|im_end|>\n"
                    "<|im_start|>tool\n18 C<|im_end|>\n<|im_start|>assistant\n")


def test_a_seed_gives_each_choice_its_own_stream(tok):
    with scripted(tok, "ok") as (client, engine):
        messages = [{"role": "user", "content": "hi"}]
        client.chat.completions.create(model=MODEL, messages=messages, n=3, seed=5)
        assert engine.seeds == [mix_seed(5, 0), mix_seed(5, 1), mix_seed(5, 2)]
        assert len(set(engine.seeds)) == 3
        engine.seeds.clear()
        client.completions.create(model=MODEL, prompt="hi", seed=-3)  # OpenAI allows < 0
        client.completions.create(model=MODEL, prompt="hi")
        assert engine.seeds == [mix_seed(2**63 - 3, 0), None]
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="hi", extra_body={"seed": "x"})
        assert err.value.body["param"] == "seed"
