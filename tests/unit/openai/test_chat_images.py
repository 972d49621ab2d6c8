"""Images in chat requests for a vision-language model served by our engine: OpenAI
image_url parts (data URLs) and Anthropic image blocks become the processor's prompt ids and
pixels, and the ids the engine served are the ones the model's processor gives."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import pytest
import torch
from PIL import Image
from serving import serving
from transformers import AutoModelForImageTextToText, AutoProcessor

from asyncrl.agents.capture import export
from asyncrl.agents.proxy import AgentProxy
from asyncrl.config.schema import LocalEngineConfig
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.inference.server.local_backend import LocalBackend
from asyncrl.models.tiny_vlm import make_tiny_vlm
from asyncrl.openai.images import load_image_prompts
from asyncrl.openai.routes import openai_app

MODEL = "tiny-vlm"
FP32_TOL = 1e-4


class Served(LocalBackend):
    """Our engine, keeping each request it was given and its response."""

    def __init__(self, engine: LocalEngine):
        super().__init__(engine)
        self.served: list = []

    async def agenerate(self, req):
        resp = await super().agenerate(req)
        self.served.append((req, resp))
        return resp


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> str:
    return make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "m")


@pytest.fixture(scope="module")
def server(vlm):
    torch.set_num_threads(1)
    engine = LocalEngine(vlm, LocalEngineConfig(dtype="float32", max_batch_size=2,
                                                max_seq_len=256))
    engine.start()
    backend = Served(engine)
    with serving(openai_app(backend, engine.tokenizer, MODEL,
                            max_model_len=256, images=load_image_prompts(vlm))) as url:
        yield url, backend
    engine.close()


def png(size=(40, 24), color=(200, 10, 30)) -> tuple[Image.Image, str]:
    image = Image.new("RGB", size, color)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return image, base64.b64encode(buf.getvalue()).decode("ascii")


def test_image_url_part_is_served_with_the_processors_ids_and_pixels(vlm, server):
    url, backend = server
    image, data = png()
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0.7, "logprobs": True,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "look: "},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                {"type": "text", "text": " what?"}]}]}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    req, resp = backend.served[-1]
    # independently: the processor on the same turn (its own template and image handling)
    processor = AutoProcessor.from_pretrained(vlm)
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "look: "}, {"type": "image"},
        {"type": "text", "text": " what?"}]}], add_generation_prompt=True)
    expected = processor(text=text, images=[image], add_special_tokens=False,
                         return_tensors="pt")
    assert req.input_ids == expected["input_ids"][0].tolist() == resp.input_ids
    assert torch.equal(req.images.pixel_values, expected["pixel_values"][0])
    assert r.json()["usage"]["prompt_tokens"] == len(req.input_ids)
    # the answer's log-probs are HF's whole model's on these ids and pixels
    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()
    ids = resp.input_ids + resp.output_ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), pixel_values=expected["pixel_values"],
                       pixel_attention_mask=expected["pixel_attention_mask"]).logits[0]
    logits = logits[len(resp.input_ids) - 1:-1] / 0.7
    hf = logits.log_softmax(-1).gather(-1, torch.tensor(resp.output_ids)[:, None])[:, 0]
    got = [t["logprob"] for t in r.json()["choices"][0]["logprobs"]["content"]]
    torch.testing.assert_close(torch.tensor(got), hf, atol=FP32_TOL, rtol=0)


def test_anthropic_image_block_gives_the_same_prompt_as_the_chat_part(server):
    url, backend = server
    _, data = png(size=(24, 40))
    chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
        {"type": "text", "text": "and this?"}]}]}
    assert httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
    chat_ids = backend.served[-1][0].input_ids
    messages = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": data}},
        {"type": "text", "text": "and this?"}]}]}
    r = httpx.post(f"{url}/v1/messages", json=messages, timeout=60)
    assert r.status_code == 200, r.text
    req = backend.served[-1][0]
    assert req.input_ids == chat_ids and req.images is not None
    count = httpx.post(f"{url}/v1/messages/count_tokens", json=messages, timeout=60)
    assert count.json()["input_tokens"] == len(chat_ids)


def test_responses_input_image_gives_the_same_prompt_as_the_chat_part(server):
    url, backend = server
    image, data = png(size=(32, 48), color=(10, 200, 30))
    chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "count: "},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}]}]}
    assert httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
    chat_req = backend.served[-1][0]
    body = {"model": MODEL, "max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "count: "},
        {"type": "input_image", "image_url": f"data:image/png;base64,{data}",
         "detail": "auto"}]}]}
    r = httpx.post(f"{url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    req = backend.served[-1][0]
    assert req.input_ids == chat_req.input_ids
    assert torch.equal(req.images.pixel_values, chat_req.images.pixel_values)
    # a stored file or an image in the model's own turn cannot be honoured: 400s naming them
    for part, role, param in [({"type": "input_image", "file_id": "file-1"}, "user",
                               "input[0].content[0].file_id"),
                              ({"type": "input_image", "image_url": f"data:image/png;base64,"
                                f"{data}"}, "assistant", "input[0].content[0]")]:
        n = len(backend.served)
        bad = {"model": MODEL, "input": [{"role": role, "content": [part]}]}
        r = httpx.post(f"{url}/v1/responses", json=bad, timeout=60)
        assert r.status_code == 400 and len(backend.served) == n
        assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path,content,param,says", [
    ("/v1/chat/completions",
     [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
     "messages[0].content[0].image_url.url", "data:image/png;base64"),
    ("/v1/chat/completions",
     [{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}],
     "messages[0].content[0].image_url.url", "holds no image"),
    ("/v1/chat/completions", [{"type": "text", "text": "a literal <image> here"}],
     "messages", "remove the placeholder"),
    ("/v1/messages",
     [{"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}],
     "messages[0].content[0].source", "send the image as {type: base64"),
])
def test_bad_images_are_a_400_naming_the_field_and_what_to_send(server, path, content, param,
                                                                 says):
    url, backend = server
    n = len(backend.served)
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 400 and len(backend.served) == n
    err = r.json()["error"]
    if path == "/v1/chat/completions":
        assert err["param"] == param
    assert param in err["message"] and says in err["message"]


def test_the_agent_proxy_records_the_served_ids_and_images_of_each_turn(vlm, server):
    _, backend = server
    admin = "admin-key"
    proxy = AgentProxy(backend, backend.engine.tokenizer, MODEL, admin_key=admin,
                       images=load_image_prompts(vlm))

    async def main():
        await proxy.start("127.0.0.1", 0)
        root = proxy.base_url[: -len("/v1")]
        async with httpx.AsyncClient(timeout=60) as client:
            s = (await client.post(f"{root}/rl/start_session", json={"task_id": "t"},
                                   headers={"Authorization": f"Bearer {admin}"})).json()
            key = {"Authorization": f"Bearer {s['api_key']}"}
            messages = [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png()[1]}"}},
                {"type": "text", "text": "first"}]}]
            for size in ((64, 16), None):
                r = await client.post(f"{root}/v1/chat/completions", headers=key, json={
                    "model": MODEL, "max_tokens": 3, "messages": messages})
                assert r.status_code == 200, r.text
                messages.append(r.json()["choices"][0]["message"])
                if size is not None:  # the second turn adds a second image
                    messages.append({"role": "user", "content": [{"type": "image_url",
                                     "image_url": {"url": "data:image/png;base64,"
                                                   + png(size=size)[1]}}]})
            await client.post(f"{root}/rl/end_session", headers=key, json={})
        session = proxy.store.get(s["session_id"])
        await proxy.stop()
        return session

    session = asyncio.run(main())
    served = backend.served[-2:]
    assert [c.prompt_ids for c in session.completions] == [req.input_ids for req, _ in served]
    assert [c.output_ids for c in session.completions] == [resp.output_ids for _, resp in served]
    trajectories = export(session.completions, style="individual", discount=1.0,
                          group_id="g").trajectories
    for trajectory, (req, resp) in zip(trajectories, served, strict=True):
        assert trajectory.input_ids == req.input_ids + resp.output_ids
        assert torch.equal(trajectory.images.pixel_values, req.images.pixel_values)
    # the second turn's prompt holds the first image's 5 tiles, then the second's 3
    assert [t.images.n_items for t in trajectories] == [5, 5 + 3]
