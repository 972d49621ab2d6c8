"""A prompt with images as the SGLang client writes it: the prompt's token ids as our
processor made them, and the processor's image tensors as a "processor_output" item of
`image_data` (SGLang's documented input for processed images). Checked against the HF
processor's own output for the same chat turn; SGLang itself does not run here."""

import json

import pytest
import torch
from PIL import Image

from asyncrl.api import GenerationRequest, SamplingParams
from asyncrl.api.types import ImageInputs
from asyncrl.inference.client.sglang import SGLangClient, generate_body
from asyncrl.models.tiny_vlm import make_tiny_vlm


@pytest.fixture(scope="module")
def processed(tmp_path_factory):
    """The HF processor's output for one chat turn with two images of different sizes."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(make_tiny_vlm(tmp_path_factory.mktemp("vlm")))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                             {"type": "text", "text": "which is red?"}]}]
    chat = processor.apply_chat_template(messages, add_generation_prompt=True)
    images = [Image.new("RGB", (40, 24), (200, 10, 30)), Image.new("RGB", (20, 20), (0, 0, 9))]
    return processor(text=chat, images=images, return_tensors="pt")


def test_images_go_as_the_processors_output_beside_its_token_ids(processed):
    ids = processed["input_ids"][0].tolist()
    req = GenerationRequest(input_ids=ids, images=ImageInputs.from_processor(processed),
                            sampling=SamplingParams(max_new_tokens=8))
    body = json.loads(json.dumps(generate_body(req, [40, 41])))  # what goes on the wire
    assert body["input_ids"] == ids + [40, 41]  # no placeholder for SGLang to expand
    assert body["sampling_params"]["max_new_tokens"] == 6
    (item,) = body["image_data"]
    assert item["format"] == "processor_output"
    assert set(item) == {"format", "pixel_values", "pixel_attention_mask"}
    assert torch.equal(torch.tensor(item["pixel_values"]), processed["pixel_values"])
    assert torch.equal(torch.tensor(item["pixel_attention_mask"]),
                       processed["pixel_attention_mask"].bool())


def test_images_without_a_mask_send_an_all_real_one(processed):
    pv = processed["pixel_values"][0]
    req = GenerationRequest(input_ids=[1, 2], images=ImageInputs(pixel_values=pv),
                            sampling=SamplingParams(max_new_tokens=8))
    mask = torch.tensor(generate_body(req, [])["image_data"][0]["pixel_attention_mask"])
    assert mask.shape == (1, pv.shape[0], *pv.shape[2:]) and bool(mask.all())


def test_a_text_prompt_sends_no_image_data():
    req = GenerationRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=8))
    assert "image_data" not in generate_body(req, [])
    assert SGLangClient.serves_images


def test_qwen_images_go_as_patches_and_grids():
    grid = torch.tensor([[1, 2, 4], [1, 4, 4]])
    images = ImageInputs(pixel_values=torch.arange(24 * 12, dtype=torch.float32).view(24, 12),
                         image_grid_thw=grid)
    req = GenerationRequest(input_ids=[1, 9, 9, 2, 9, 9, 9, 9, 2], images=images,
                            sampling=SamplingParams(max_new_tokens=4))
    item = json.loads(json.dumps(generate_body(req, [])))["image_data"][0]
    assert item == {"format": "processor_output", "pixel_values": images.pixel_values.tolist(),
                    "image_grid_thw": [[1, 2, 4], [1, 4, 4]]}
