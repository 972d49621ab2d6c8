"""SFT of a vision-language model (tiny Idefics3) on rows with images: the answer alone is
learned, the loss is HF's whole model's by hand, and a few steps lower it."""

import json

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from asyncrl.algorithms import make_sft_loss_fn
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.offline import OfflineDatasetConfig
from asyncrl.config.schema import GenerationConfig, OptimizerConfig
from asyncrl.controller.workflows import RLVRWorkflow
from asyncrl.data.loading import DatasetError
from asyncrl.data.offline import collate, load_sft_examples
from asyncrl.data.visual_tasks import train_tasks
from asyncrl.models.tiny_vlm import make_tiny_vlm
from asyncrl.offline.loop import evaluate
from asyncrl.openai.images import load_image_prompts
from asyncrl.trainer import FSDPTrainEngine

pytestmark = pytest.mark.usefixtures("process_group")
SYSTEM = "Answer with one word or number."


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> str:
    return make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "m")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> OfflineDatasetConfig:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    with open(path, "w") as f:
        for item in train_tasks(size=6, seed=0):
            f.write(json.dumps({k: item[k] for k in ("question", "answer", "images")}) + "\n")
    return OfflineDatasetConfig(path=str(path), format="gsm8k", bad_rows="error")


def load(vlm, data):
    processor = AutoProcessor.from_pretrained(vlm)
    return load_sft_examples(data, processor.tokenizer, SYSTEM, processor=processor)


def test_only_the_answer_is_learned_and_the_image_tokens_match_the_tiles(vlm, data):
    examples = load(vlm, data)
    processor = AutoProcessor.from_pretrained(vlm)
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    for (row,), item in zip(examples, train_tasks(size=6, seed=0)):
        learned = [t for t, m in zip(row.input_ids, row.loss_mask) if m]
        assert processor.tokenizer.decode(learned) == item["answer"] + "<|im_end|>\n"
        # a 64 px image: 2 x 2 tiles of 32 px plus the whole image shrunk to one; each tile
        # is (32 / 8 / 2)^2 = 4 image tokens
        assert row.images.pixel_values.shape == (5, 3, 32, 32)
        assert row.input_ids.count(image_id) == 5 * 4


def test_an_sft_row_starts_with_the_prompt_rlvr_serves_for_the_same_item(vlm, data):
    """GRPO after SFT samples from the prompt (tokens and pixels) SFT trained on."""
    processor = AutoProcessor.from_pretrained(vlm)
    workflow = RLVRWorkflow(processor.tokenizer, GenerationConfig(), None, system_prompt=SYSTEM,
                            images=load_image_prompts(vlm))
    for (row,), item in zip(load(vlm, data), train_tasks(size=6, seed=0)):
        ids, images = workflow.prompt(item)
        assert row.input_ids[:len(ids)] == ids and row.loss_mask.index(1) == len(ids)
        assert torch.equal(row.images.pixel_values, images.pixel_values)


def hf_sft_loss(model, batch) -> float:
    """Token-mean NLL of the answer tokens under HF's whole model (every row one image of
    the same size, so the tiles stack row by row)."""
    b = len(batch)
    pixels = batch.pixel_values.reshape(b, -1, *batch.pixel_values.shape[1:])
    mask = batch.pixel_attention_mask.reshape(b, -1, *batch.pixel_attention_mask.shape[1:])
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   pixel_values=pixels, pixel_attention_mask=mask).logits
    target_mask = batch.loss_mask[:, 1:] > 0
    nll = torch.nn.functional.cross_entropy(logits[:, :-1][target_mask],
                                            batch.input_ids[:, 1:][target_mask])
    return float(nll)


def test_sft_loss_is_hf_whole_models_and_steps_lower_it(vlm, data):
    examples = load(vlm, data)
    pad = AutoTokenizer.from_pretrained(vlm).pad_token_id
    batch = collate([r for ex in examples for r in ex], pad)
    assert batch.image_rows.tolist() == [r for r in range(6) for _ in range(5)]
    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32)
    with torch.no_grad():
        expected = hf_sft_loss(model, batch)
    spec = TrainEngineSpec(path=vlm, dtype="float32",
                           optimizer=OptimizerConfig(lr=3e-3, gradient_clipping=0.0))
    engine = FSDPTrainEngine(spec, total_steps=10)
    engine.initialize()
    try:
        loss_fn = make_sft_loss_fn()
        before = evaluate(engine, examples, loss_fn, batch_size=4, pad_token_id=pad)["loss"]
        assert before == pytest.approx(expected, rel=1e-5)
        losses = [engine.train_batch(batch, loss_fn)["loss"] for _ in range(4)]
        assert losses[0] == pytest.approx(expected, rel=1e-5)
        after = evaluate(engine, examples, loss_fn, batch_size=4, pad_token_id=pad)["loss"]
        assert after < 0.7 * before
    finally:
        engine.destroy()


def test_image_rows_need_an_image_processor_and_readable_images(vlm, data, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(vlm)
    with pytest.raises(DatasetError, match="the row has 'images' but the model reads text only"):
        load_sft_examples(data, tokenizer, SYSTEM)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "a",
                               "images": ["data:image/png;base64,AAAA"]}) + "\n")
    processor = AutoProcessor.from_pretrained(vlm)
    cfg = OfflineDatasetConfig(path=str(bad), format="gsm8k", bad_rows="error")
    with pytest.raises(DatasetError, match=r"bad.jsonl:1: images\[0\] holds no image"):
        load_sft_examples(cfg, tokenizer, SYSTEM, processor=processor)
    bad.write_text(json.dumps({"question": "q", "answer": "a",
                               "images": [str(tmp_path / "none.png")]}) + "\n")
    with pytest.raises(DatasetError, match="none.png' is neither a data URL"):
        load_sft_examples(cfg, tokenizer, SYSTEM, processor=processor)
    bad.write_text(json.dumps({"question": "<image> q", "answer": "a",
                               "images": [train_tasks(size=1, seed=0)[0]["images"][0]]}) + "\n")
    with pytest.raises(DatasetError, match="image placeholders '<image>' of their own"):
        load_sft_examples(cfg, tokenizer, SYSTEM, processor=processor)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_frozen_modules_stay_fixed_while_the_vision_side_learns(vlm, data, dtype):
    examples = load(vlm, data)
    pad = AutoTokenizer.from_pretrained(vlm).pad_token_id
    batch = collate([r for ex in examples for r in ex], pad)
    spec = TrainEngineSpec(path=vlm, dtype=dtype, frozen_modules=("model.text_model", "lm_head"),
                           optimizer=OptimizerConfig(lr=3e-3, gradient_clipping=0.0))
    engine = FSDPTrainEngine(spec, total_steps=10)
    engine.initialize()
    try:
        before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        losses = [engine.train_batch(batch, make_sft_loss_fn())["loss"] for _ in range(3)]
        after = dict(engine.model.named_parameters())
    finally:
        engine.destroy()
    assert losses[-1] < losses[0]
    for name, p in before.items():
        text = ".text_model." in name or name.endswith("lm_head.weight")
        assert torch.equal(p, after[name].detach()) == text, name


def test_a_frozen_prefix_that_names_nothing_is_refused(vlm):
    spec = TrainEngineSpec(path=vlm, dtype="float32", frozen_modules=("model.vision",))
    engine = FSDPTrainEngine(spec, total_steps=1)
    with pytest.raises(ValueError, match="frozen_modules: 'model.vision' names no parameter"):
        engine.initialize()
    engine.destroy()
