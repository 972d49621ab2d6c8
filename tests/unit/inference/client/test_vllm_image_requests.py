"""A prompt's images as the vLLM client sends them: one item per run of image tokens, its
tiles in vLLM's msgpack encoding (decoded here by vLLM's own decoder where vllm is
installed), and refusals that name the request and what to change."""

import base64
import importlib.util

import pytest
import torch

from asyncrl.api import GenerationRequest, SamplingParams
from asyncrl.api.types import ImageInputs
from asyncrl.inference.client.vllm import generate_body, parse_generate
from asyncrl.inference.client.vllm_images import (
    ImageLayout,
    _pack,
    image_features,
    image_layout,
    image_token_runs,
)

IMG = 9  # the image token id of these prompts
# Two images: one of 1 tile (4 tokens), one of 2 tiles split by a tile marker (5).
PROMPT = [1, 2, IMG, IMG, IMG, IMG, 5, IMG, IMG, IMG, IMG, 5, IMG, IMG, IMG, IMG, 7]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (pip install 'asyncrl[vllm]')")


def tiles(n: int) -> ImageInputs:
    g = torch.Generator().manual_seed(n)
    return ImageInputs(pixel_values=torch.randn(n, 3, 8, 8, generator=g),
                       pixel_attention_mask=torch.rand(n, 8, 8, generator=g) > 0.3)


def test_each_run_of_image_tokens_is_one_placeholder():
    assert image_token_runs(PROMPT, IMG) == [(2, 4), (7, 4), (12, 4)]
    assert image_token_runs([IMG, IMG, 3, IMG], IMG) == [(0, 2), (3, 1)]
    assert image_token_runs([1, 2], IMG) == []


def test_features_place_each_tile_at_its_run_and_name_it_by_its_content():
    f = image_features(PROMPT, tiles(3), ImageLayout(IMG, tokens_per_tile=4))
    assert f["mm_placeholders"] == {"image": [{"offset": 2, "length": 4},
                                              {"offset": 7, "length": 4},
                                              {"offset": 12, "length": 4}]}
    hashes = f["mm_hashes"]["image"]
    assert len(set(hashes)) == 3 and all(len(h) == 64 for h in hashes)
    # equal pixels, equal names (vLLM's cache of encoder outputs is keyed by them)
    twice = ImageInputs(pixel_values=tiles(1).pixel_values.repeat(2, 1, 1, 1),
                        pixel_attention_mask=tiles(1).pixel_attention_mask.repeat(2, 1, 1))
    a, b = image_features([IMG, IMG, 0, IMG, IMG], twice,
                          ImageLayout(IMG, tokens_per_tile=2))["mm_hashes"]["image"]
    assert a == b


def test_adjacent_tiles_share_one_item():
    f = image_features([0, IMG, IMG, IMG, IMG, 0], tiles(2), ImageLayout(IMG, tokens_per_tile=2))
    assert f["mm_placeholders"]["image"] == [{"offset": 1, "length": 4}]


@pytest.mark.parametrize("prompt", [PROMPT[:-6] + [7], [1, IMG, IMG, IMG, 5] + PROMPT[7:]])
def test_image_tokens_that_do_not_stand_for_the_tiles_are_refused(prompt):
    with pytest.raises(ValueError, match=r"request r7: .*3 image tiles take 4 tokens each; "
                                         "build the prompt and the images"):
        image_features(prompt, tiles(3), ImageLayout(IMG, tokens_per_tile=4), rid="r7")


def test_idefics3_and_qwen2_vl_models_take_these_tensors_and_others_are_refused():
    assert image_layout({"model_type": "smolvlm", "image_token_id": 49190,
                         "tokens_per_tile": 64}, "http://a") == ImageLayout(49190, 64)
    assert image_layout({"model_type": "qwen2_5_vl", "image_token_id": 151655,
                         "merge_size": 2}, "http://a") == ImageLayout(151655, merge_size=2)
    with pytest.raises(ValueError, match=r"http://a serves a 'qwen3_vl' model.*idefics3, "
                                         "smolvlm, qwen2_vl, qwen2_5_vl models only"):
        image_layout({"model_type": "qwen3_vl"}, "http://a")


def grid_images(*grids: tuple[int, int, int]) -> ImageInputs:
    grid = torch.tensor(grids)
    g = torch.Generator().manual_seed(len(grids))
    return ImageInputs(pixel_values=torch.randn(int(grid.prod(-1).sum()), 12, generator=g),
                       image_grid_thw=grid)


QWEN = ImageLayout(IMG, merge_size=2)


def test_qwen_images_are_one_item_each_at_their_tokens():
    # grids (1, 2, 4) and (1, 4, 4): 8 / 4 = 2 and 16 / 4 = 4 image tokens; adjacent images
    # share one run of image tokens and are cut where the first one's tokens end
    images = grid_images((1, 2, 4), (1, 4, 4))
    f = image_features([1, 3, IMG, IMG, 4, 3, IMG, IMG, IMG, IMG, 4], images, QWEN)
    assert f["mm_placeholders"]["image"] == [{"offset": 2, "length": 2},
                                             {"offset": 6, "length": 4}]
    adjacent = image_features([1, IMG, IMG, IMG, IMG, IMG, IMG, 4], images, QWEN)
    assert adjacent["mm_placeholders"]["image"] == [{"offset": 1, "length": 2},
                                                    {"offset": 3, "length": 4}]
    assert len(set(f["mm_hashes"]["image"])) == 2


@pytest.mark.parametrize("prompt", [[1, IMG, IMG, 4, IMG, IMG, IMG, 4],
                                    [1, IMG, IMG, IMG, 4, IMG, IMG, IMG, 4],
                                    [1, IMG, IMG, 4, IMG, IMG, IMG, IMG, IMG, 4]])
def test_qwen_image_tokens_that_do_not_stand_for_the_grids_are_refused(prompt):
    with pytest.raises(ValueError, match=r"request r2: .*runs of .*\[\[1, 2, 4\], \[1, 4, 4\]\] "
                                         r"take \[2, 4\] tokens each"):
        image_features(prompt, grid_images((1, 2, 4), (1, 4, 4)), QWEN, rid="r2")


@needs_vllm
def test_vllms_own_decoder_reads_qwen_patches_and_grids():
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item

    images = grid_images((1, 2, 4), (1, 4, 4))
    f = image_features([1, IMG, IMG, 4, IMG, IMG, IMG, IMG, 4], images, QWEN)
    items = [decode_mm_kwargs_item(d) for d in f["kwargs_data"]["image"]]
    assert torch.equal(items[0]["pixel_values"].data, images.pixel_values[:8])
    assert torch.equal(items[1]["pixel_values"].data, images.pixel_values[8:])
    assert [item["image_grid_thw"].data.tolist() for item in items] == [[1, 2, 4], [1, 4, 4]]
    assert items[1]["image_grid_thw"].field.keep_on_cpu


def test_msgpack_of_the_basic_types_is_the_spec_bytes():
    # worked out from the msgpack spec: fixmap 1, fixstr "a", fixarray 3 of nil, true, -1
    assert _pack({"a": [None, True, -1]}) == bytes([0x81, 0xA1, 0x61, 0x93, 0xC0, 0xC3, 0xFF])
    assert _pack(300) == bytes([0xD3]) + (300).to_bytes(8, "big")
    assert _pack("x" * 40)[:2] == bytes([0xD9, 40])
    assert _pack(list(range(20)))[:3] == bytes([0xDC, 0, 20])


@needs_vllm
def test_vllms_own_decoder_reads_the_tiles_and_the_route_accepts_the_features():
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    images = tiles(3)
    f = image_features(PROMPT, images, ImageLayout(IMG, tokens_per_tile=4))
    for k, data in enumerate(f["kwargs_data"]["image"]):
        item = decode_mm_kwargs_item(data)
        assert torch.equal(item["pixel_values"].data, images.pixel_values[k:k + 1])
        assert torch.equal(item["pixel_attention_mask"].data,
                           images.pixel_attention_mask[k:k + 1])
        assert int(item["num_patches"].data) == 1 and item["num_patches"].field.keep_on_cpu
    req = GenerationRequest(input_ids=PROMPT, images=images, sampling=SamplingParams(
        max_new_tokens=8, temperature=0.7, seed=3))
    parsed = GenerateRequest.model_validate(generate_body(req, [40, 41], f, adapter="lora-2"))
    assert parsed.token_ids == PROMPT + [40, 41] and parsed.model == "lora-2"
    sp = parsed.sampling_params
    assert (sp.max_tokens, sp.temperature, sp.logprobs, sp.skip_special_tokens) == (
        6, 0.7, 0, False)


def test_generate_answer_gives_tokens_logprobs_and_finish():
    body = {"choices": [{"index": 0, "finish_reason": "length", "token_ids": [4, 5],
                         "logprobs": {"content": [{"token_id": 4, "logprob": -0.5},
                                                  {"token_id": 5, "logprob": -1.25}]}}]}
    piece = parse_generate(body, "http://a")
    assert (piece.output_ids, piece.output_logprobs, piece.finish.value) == (
        [4, 5], [-0.5, -1.25], "length")


def test_encoding_is_plain_base64_of_msgpack():
    f = image_features([IMG], tiles(1), ImageLayout(IMG, tokens_per_tile=1))
    data = f["kwargs_data"]["image"][0]
    assert base64.b64decode(data)[0] == 0x83  # a map of the three tensors
