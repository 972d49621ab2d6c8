"""Qwen2.5-VL prompts (tiny, random): an image in a chat request or a dataset item is written
between the vision markers, as Qwen's chat template writes an image part, and the processor
expands its token into the image's merged patches."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image
from scripted_engine import ScriptedEngine
from serving import serving

from asyncrl.config.schema import GenerationConfig
from asyncrl.controller.workflows.rlvr import RLVRWorkflow
from asyncrl.models.tiny_qwen_vl import make_tiny_qwen_vl
from asyncrl.openai.images import load_image_prompts
from asyncrl.openai.routes import openai_app


class ImageEngine(ScriptedEngine):
    serves_images = True


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory) -> str:
    return make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen_vl") / "m")


def expected_tokens(before: str, after: str) -> list[str]:
    # a 40 x 24 image: 6 x 10 patches of 4 pixels, merged 2 x 2: 15 image tokens
    return (["<|im_start|>", *"user", "Ċ", *before, "<|vision_start|>"]
            + ["<|image_pad|>"] * 15
            + ["<|vision_end|>", *after, "<|im_end|>", "Ċ", "<|im_start|>", *"assistant", "Ċ"])


def test_image_url_part_becomes_the_vision_markers_and_the_images_tokens(qwen_vl):
    prompts = load_image_prompts(qwen_vl)
    tok = prompts.processor.tokenizer
    engine = ImageEngine(tok, ["ok"])
    buf = io.BytesIO()
    Image.new("RGB", (40, 24), (200, 10, 30)).save(buf, format="PNG")
    data = base64.b64encode(buf.getvalue()).decode()
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "see"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
        {"type": "text", "text": "?"}]}]}
    with serving(openai_app(engine, tok, "m", max_model_len=256, images=prompts)) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    req = engine.calls[-1]
    assert tok.convert_ids_to_tokens(req.input_ids) == expected_tokens("see", "?")
    assert req.images.image_grid_thw.tolist() == [[1, 6, 10]]
    assert list(req.images.pixel_values.shape) == [60, 96]


def test_dataset_items_image_goes_first_in_the_user_turn(qwen_vl):
    prompts = load_image_prompts(qwen_vl)
    tok = prompts.processor.tokenizer
    workflow = RLVRWorkflow(tok, GenerationConfig(n_samples=1, max_new_tokens=4), None,
                            images=prompts)
    ids, images = workflow.prompt({"id": "a", "question": "how many?",
                                   "images": [Image.new("RGB", (40, 24), (0, 0, 255))]})
    assert tok.convert_ids_to_tokens(ids) == expected_tokens("", "howĠmany?")
    assert images.image_grid_thw.tolist() == [[1, 6, 10]]


def test_our_engine_refuses_qwen_vl_naming_the_backends_that_serve_it(qwen_vl):
    from asyncrl.config.schema import LocalEngineConfig
    from asyncrl.inference.server.engine import LocalEngine

    with pytest.raises(NotImplementedError, match=r"'qwen2_5_vl'.*M-RoPE.*vLLM or SGLang"):
        LocalEngine(qwen_vl, LocalEngineConfig(dtype="float32", max_batch_size=2,
                                               max_seq_len=256))
