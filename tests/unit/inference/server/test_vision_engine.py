"""Our engine serving a vision-language model (Idefics3): HF's vision encoder and connector
at prefill, our decoder for the text; log-probs against HF's whole model."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from asyncrl.api.types import GenerationRequest, ImageInputs, SamplingParams
from asyncrl.config.schema import LocalEngineConfig
from asyncrl.inference.server.engine import LocalEngine, _prompt_keys, _shared_prefixes
from asyncrl.inference.server.model import Transformer
from asyncrl.models.tiny import make_tiny_model
from asyncrl.models.tiny_vlm import make_tiny_vlm

torch.set_num_threads(1)
FP32_TOL = 1e-4  # as the text engine's parity tests: same maths, different op order


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> str:
    return make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "v0", seed=0)


@pytest.fixture(scope="module")
def vlm_v1(tmp_path_factory) -> str:
    return make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "v1", seed=1)


def prompt(path: str, size=(40, 24), color=(200, 10, 30), text="what is it?"):
    """(input_ids, ImageInputs) of a chat turn with one image, from the model's processor."""
    processor = AutoProcessor.from_pretrained(path)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    chat = processor.apply_chat_template(messages, add_generation_prompt=True)
    out = processor(text=chat, images=[Image.new("RGB", size, color)], return_tensors="pt")
    return out["input_ids"][0].tolist(), ImageInputs.from_processor(out)


def hf_logits(path: str, ids: list[int], images: ImageInputs | None) -> torch.Tensor:
    """HF's whole model (vision encoder, connector, decoder) on one sequence: [T, V]."""
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    kwargs = {}
    if images is not None:
        kwargs = dict(pixel_values=images.pixel_values[None],
                      pixel_attention_mask=images.pixel_attention_mask[None])
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), **kwargs).logits[0]


def new_engine(path: str, **kw) -> LocalEngine:
    cfg = dict(dtype="float32", max_batch_size=4, max_seq_len=256)
    return LocalEngine(path, LocalEngineConfig(**{**cfg, **kw}), seed=0)


def run(engine: LocalEngine, reqs: list[GenerationRequest], steps_between: int = 0) -> dict:
    """Submit `reqs` (the later ones `steps_between` steps after the first) and drain."""
    out: dict = {}
    for i, req in enumerate(reqs):
        engine.submit(req, lambda r, rid=req.rid: out.__setitem__(rid, r))
        for _ in range(steps_between if i == 0 else 0):
            engine.step()
    while len(out) < len(reqs):
        engine.step()
    return out


def test_prefill_logits_with_image_features_match_hf_whole_model(vlm):
    ids, images = prompt(vlm)
    model = Transformer.from_pretrained(vlm, dtype=torch.float32, max_seq_len=128)
    vision = new_engine(vlm).vision
    tokens = torch.tensor([ids])
    mask = tokens == vision.image_token_id
    assert int(mask.sum()) == images.n_items * 4  # 4 image tokens per 32-pixel tile
    logits = model.prefill(tokens, torch.tensor([len(ids)]), model.new_cache(1, 128), 0,
                           all_logits=True, embeds=(mask, vision.embed(images)))[0]
    reference = hf_logits(vlm, ids, images)
    torch.testing.assert_close(logits, reference, atol=FP32_TOL, rtol=0)
    # the image matters: the text-only logits after it differ
    blank = hf_logits(vlm, ids, ImageInputs(pixel_values=-images.pixel_values,
                                            pixel_attention_mask=images.pixel_attention_mask))
    assert (blank[-1] - reference[-1]).abs().max() > 1e-2


def sampled_logprobs_match_hf(path: str, ids: list[int], images: ImageInputs, resp,
                              temperature: float) -> None:
    logits = hf_logits(path, ids + resp.output_ids, images)[len(ids) - 1:-1] / temperature
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(resp.output_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(resp.output_logprobs), expected,
                               atol=FP32_TOL, rtol=0)


def test_sampled_tokens_log_probs_match_hf_with_the_image(vlm):
    ids, images = prompt(vlm)
    req = GenerationRequest(input_ids=ids, images=images,
                            sampling=SamplingParams(temperature=0.8, max_new_tokens=12,
                                                    ignore_eos=True))
    resp = run(new_engine(vlm), [req])[req.rid]
    assert resp.input_ids == ids and len(resp.output_ids) == 12
    sampled_logprobs_match_hf(vlm, ids, images, resp, 0.8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_image_and_text_requests_batched_mid_decode_match_running_alone(vlm, dtype):
    # bf16 on CPU takes the one-call C forward: the new prompts are computed with the
    # decode rows, the image prompt with its features
    ids_a, images_a = prompt(vlm, color=(10, 200, 30))
    ids_b, images_b = prompt(vlm, size=(24, 40), color=(10, 200, 30))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    reqs = [GenerationRequest(input_ids=ids_a, images=images_a, sampling=greedy),
            GenerationRequest(input_ids=ids_b, images=images_b, sampling=greedy),
            GenerationRequest(input_ids=ids_a[:6] + ids_a[-8:], sampling=greedy)]
    together = run(new_engine(vlm, dtype=dtype), reqs, steps_between=3)
    for req in reqs:
        alone = run(new_engine(vlm, dtype=dtype), [req])[req.rid]
        assert together[req.rid].output_ids == alone.output_ids


def test_a_weight_update_reloads_the_vision_side_and_recomputes_the_image_prompt(vlm, vlm_v1):
    ids, images = prompt(vlm)
    req = GenerationRequest(input_ids=ids, images=images, sampling=SamplingParams(
        temperature=0.8, max_new_tokens=16, ignore_eos=True))
    engine, out = new_engine(vlm, recompute_kv_on_update=True), {}
    engine.submit(req, lambda r: out.__setitem__(req.rid, r))
    for _ in range(4):
        engine.step()
    engine.update_weights(vlm_v1, version=1)
    while not out:
        engine.step()
    resp = out[req.rid]
    assert resp.output_versions == [0] * 5 + [1] * 11
    # every token after the update is exactly version 1's, image side included
    logits = hf_logits(vlm_v1, ids + resp.output_ids, images)[len(ids) - 1:-1] / 0.8
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(resp.output_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(resp.output_logprobs[5:]), expected[5:],
                               atol=FP32_TOL, rtol=0)


def test_mismatched_images_and_text_models_are_refused_with_what_to_change(vlm, tmp_path):
    ids, images = prompt(vlm)
    engine = new_engine(vlm)
    one_tile = ImageInputs(pixel_values=images.pixel_values[:1],
                           pixel_attention_mask=images.pixel_attention_mask[:1])
    n = ids.count(engine.vision.image_token_id)
    with pytest.raises(ValueError, match=rf"input_ids holds {n} image tokens .* but 1 image "
                                         r"tiles give 4 features .* one processor call"):
        engine.submit(GenerationRequest(input_ids=ids, images=one_tile), print)
    with pytest.raises(ValueError, match=rf"holds {n} image tokens .* the request has no images"):
        engine.submit(GenerationRequest(input_ids=ids), print)
    small = ImageInputs(pixel_values=torch.zeros(1, 3, 16, 16))
    with pytest.raises(ValueError, match=r"3 x 16 x 16 pixels, but the model takes 3 x 32 x 32"):
        engine.submit(GenerationRequest(input_ids=ids, images=small), print)
    text = new_engine(make_tiny_model(tmp_path / "text"))
    with pytest.raises(ValueError, match=r"has images but the model .* reads text only"):
        text.submit(GenerationRequest(input_ids=[5, 6, 7], images=one_tile), print)


def test_image_inputs_cross_json_unchanged(vlm):
    ids, images = prompt(vlm)
    req = GenerationRequest(input_ids=ids, images=images)
    back = GenerationRequest.from_dict(req.to_dict())
    assert torch.equal(back.images.pixel_values, images.pixel_values)
    assert torch.equal(back.images.pixel_attention_mask, images.pixel_attention_mask)
    with pytest.raises(ValueError, match="whose size fits its shape"):
        ImageInputs.from_dict({"pixel_values": {"shape": [1, 3, 32, 32], "data": "AAAA"}})


# ---- shared prefixes of image prompts (the C forward) --------------------------------------


def fused_engine(path: str, **kw) -> LocalEngine:
    engine = new_engine(path, dtype="bfloat16", max_batch_size=8, **kw)
    if not engine.model.fused:
        pytest.skip("needs the C forward (AVX512-BF16)")
    return engine


def spy(engine: LocalEngine) -> tuple[list[int], list[int]]:
    """(rows of each forward_rows call, tiles of each vision-encoder call) from now on."""
    rows, tiles = [], []
    forward, embed = engine.model.forward_rows, engine.vision.embed
    engine.model.forward_rows = lambda tokens, *a: rows.append(len(tokens)) or forward(tokens, *a)
    engine.vision.embed = lambda images: tiles.append(images.n_items) or embed(images)
    return rows, tiles


def copy(images: ImageInputs) -> ImageInputs:
    return ImageInputs(pixel_values=images.pixel_values.clone(),
                       pixel_attention_mask=images.pixel_attention_mask.clone())


def sampled(ids: list[int], images: ImageInputs | None, seed: int) -> GenerationRequest:
    return GenerationRequest(input_ids=ids, images=images, sampling=SamplingParams(
        temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=seed))


def alone(path: str, req: GenerationRequest):
    return run(fused_engine(path), [req])[req.rid]


def test_prompt_keys_tell_images_apart_by_their_pixels(vlm):
    ids, images = prompt(vlm)
    other_ids, other = prompt(vlm, color=(10, 200, 30))
    assert other_ids == ids  # same tokens, other pixels
    image_id = new_engine(vlm).vision.image_token_id
    keys, end = _prompt_keys(ids, image_id, images)
    at = [i for i, t in enumerate(ids) if t == image_id]
    assert end == at[-1] + 1 and len({keys[i] for i in at}) == 1 and keys[at[0]] < 0
    assert [k for i, k in enumerate(keys) if i not in at] == [t for i, t in enumerate(ids)
                                                              if i not in at]
    assert _prompt_keys(ids, image_id, copy(images)) == (keys, end)
    other_keys, _ = _prompt_keys(ids, image_id, other)
    assert [i for i, (a, b) in enumerate(zip(keys, other_keys)) if a != b] == at


def test_a_group_of_image_prompts_runs_the_encoder_and_the_prompt_once(vlm):
    ids, images = prompt(vlm)
    _, other = prompt(vlm, color=(10, 200, 30))
    group = [sampled(ids, copy(images), seed) for seed in range(4)]
    stranger = sampled(ids, other, 0)  # the group's tokens, other pixels
    engine = fused_engine(vlm)
    rows, tiles = spy(engine)
    out = run(engine, group + [stranger])
    # first: the group's first prompt and the stranger in full, each with its tiles; then
    # the last token of each of the 3 other samples, past the shared prompt
    assert rows[:2] == [2 * len(ids), 3] and tiles == [images.n_items] * 2
    for req in group + [stranger]:
        single = alone(vlm, req)
        assert out[req.rid].output_ids == single.output_ids
        assert out[req.rid].output_logprobs == single.output_logprobs
    # the stranger's pixels change its log-probs: sharing the group's cache would show
    assert alone(vlm, sampled(ids, images, 0)).output_logprobs != \
        out[stranger.rid].output_logprobs


def test_an_image_prompt_admitted_mid_decode_reuses_a_running_one_bit_for_bit(vlm):
    ids, images = prompt(vlm)
    first, second = sampled(ids, images, 1), sampled(ids, copy(images), 2)
    engine, out = fused_engine(vlm), {}
    rows, tiles = spy(engine)
    engine.submit(first, lambda r: out.__setitem__(first.rid, r))
    for _ in range(3):
        engine.step()
    engine.submit(second, lambda r: out.__setitem__(second.rid, r))
    engine.step()
    assert rows[3] == 1 + 1 and tiles == [images.n_items]  # a decode row + the last token
    while len(out) < 2:
        engine.step()
    for req in (first, second):
        assert out[req.rid].output_logprobs == alone(vlm, req).output_logprobs


def test_a_text_prompt_shares_only_the_text_before_an_image(vlm):
    ids, images = prompt(vlm)
    image_id = new_engine(vlm).vision.image_token_id
    start = ids.index(image_id)
    keys, end = _prompt_keys(ids, image_id, images)
    text = ids[:start] + [5] * 12  # the image prompt's opening, then text
    donor, shared = _shared_prefixes([keys, text, keys, ids[:start] + ids[end:]],
                                     [max(2, end), 2, max(2, end), 2])
    # the text prompt takes the opening from the image prompt; the second image prompt all
    # but its last token; the text without the image only the opening
    assert donor == [-1, 0, 0, 0] and shared == [0, start, len(ids) - 1, start]


def test_kv_recompute_after_an_update_shares_a_group_of_image_prompts(vlm, vlm_v1,
                                                                      monkeypatch):
    ids, images = prompt(vlm)
    runs = []
    for min_shared in (8, 10**9):  # shared prefixes, then none
        monkeypatch.setattr("asyncrl.inference.server.engine.MIN_SHARED_PREFIX", min_shared)
        engine = fused_engine(vlm, recompute_kv_on_update=True)
        reqs = [sampled(ids, copy(images), seed) for seed in range(3)]
        out: dict = {}
        for r in reqs:
            engine.submit(r, lambda resp, rid=r.rid: out.__setitem__(rid, resp))
        for _ in range(3):
            engine.step()
        rows, tiles = spy(engine)
        engine.update_weights(vlm_v1, version=1)  # 3 sequences recomputed under version 1
        recompute = (list(rows), list(tiles))
        while len(out) < 3:
            engine.step()
        runs.append(([out[r.rid].output_logprobs for r in reqs], recompute))
    # 3 generated tokens each, 2 of them in the cache; samples 1 and 2 take from sample 0
    # all they share with it (the prompt, and any equal first token)
    n = len(ids) + 2
    firsts = [out[r.rid].output_ids[:2] for r in reqs]
    past = [2 - (a[0] == firsts[0][0]) - (a[:2] == firsts[0]) for a in firsts[1:]]
    assert runs[0][1] == ([n, sum(past)], [images.n_items])
    assert runs[1][1] == ([3 * n], [images.n_items] * 3)
    assert runs[0][0] == runs[1][0]
