"""Training Qwen2.5-VL (tiny, random): image patches and their grids ride with the rows, the
trainer's three-dimensional positions are HF's and vLLM's, and a GRPO step's log-probs,
loss and gradients equal HF's whole model's, row by row."""

import pytest
import torch
from batches import image_trajectory
from PIL import Image
from transformers import AutoModelForImageTextToText

from asyncrl.api.types import Batch, ImageInputs, Trajectory
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import OptimizerConfig
from asyncrl.models.tiny_qwen_vl import make_tiny_qwen_vl
from asyncrl.openai.images import load_image_prompts
from asyncrl.trainer import FSDPTrainEngine
from asyncrl.trainer.service import decode_batch, encode_batch
from asyncrl.trainer.vision import mrope_positions, prompt_image_mask

pytestmark = pytest.mark.usefixtures("process_group")

# Per row: its images' sizes (width, height) and its reward. The tiny processor keeps
# sizes that are multiples of 8 pixels within 16 x 16 .. 48 x 48, in patches of 4 pixels:
# 40 x 24 -> a grid of (1, 6, 10) patches, 15 image tokens; 16 x 32 -> (1, 8, 4), 8 tokens.
ROWS = [([(40, 24)], 1.0), ([(16, 32), (40, 24)], 0.0), ([], 0.5), ([(16, 32)], 0.25)]
OUTPUT = [[70, 71, 72, 73], [80, 81, 82], [90, 91, 92, 93, 94], [100, 101]]


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory) -> str:
    return make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen_vl") / "m")


def trajectories(path: str) -> list[Trajectory]:
    prompts = load_image_prompts(path)
    return [image_trajectory(
        prompts, [{"role": "user", "content": prompts.image_text * len(sizes) + f"row {i}"}],
        [Image.new("RGB", s, (40 * i + 30 * k, 200 - 30 * i, 90)) for k, s in enumerate(sizes)],
        output, reward=reward, group_id=f"g{i // 2}")
        for i, ((sizes, reward), output) in enumerate(zip(ROWS, OUTPUT))]


def test_processor_places_each_images_merged_patches_between_the_vision_markers(qwen_vl):
    traj = trajectories(qwen_vl)
    tok = load_image_prompts(qwen_vl).processor.tokenizer
    tokens = tok.convert_ids_to_tokens(traj[1].input_ids)
    start = tokens.index("<|vision_start|>")
    assert tokens[start:start + 11] == ["<|vision_start|>"] + ["<|image_pad|>"] * 8 + [
        "<|vision_end|>", "<|vision_start|>"]
    assert tokens.count("<|image_pad|>") == 8 + 15
    assert traj[1].images.image_grid_thw.tolist() == [[1, 8, 4], [1, 6, 10]]
    # 2 frames x 3 channels x 4 x 4 pixels per patch; 32 + 60 patches
    assert list(traj[1].images.pixel_values.shape) == [32 + 60, 96]


def test_batch_carries_each_rows_patches_and_grids_and_selecting_rows_keeps_theirs(qwen_vl):
    batch = Batch(trajectories(qwen_vl)).to_tensors()
    assert batch.image_rows.tolist() == [0, 1, 1, 3]
    assert batch.image_grid_thw.tolist() == [[1, 6, 10], [1, 8, 4], [1, 6, 10], [1, 8, 4]]
    assert batch.pixel_attention_mask is None
    picked = batch.select([3, 0])
    assert picked.image_rows.tolist() == [0, 1]
    assert picked.image_grid_thw.tolist() == [[1, 8, 4], [1, 6, 10]]
    # row 3's 32 patches come after rows 0 and 1's 60 + 32 + 60, then row 0's 60
    assert torch.equal(picked.pixel_values,
                       torch.cat([batch.pixel_values[152:184], batch.pixel_values[:60]]))
    sent = decode_batch(encode_batch(batch))
    for name in ("pixel_values", "image_rows", "image_grid_thw"):
        assert torch.equal(getattr(sent, name), getattr(batch, name))


def test_mrope_positions_by_hand():
    # a b [image: 1 x 2 x 2 tokens] c <image token sampled later> d, then padding
    img = 9
    ids = torch.tensor([[1, 2, img, img, img, img, 3, img, 4, 0]])
    mask = torch.tensor([[1] * 9 + [0]])
    image_mask = prompt_image_mask(ids, img, torch.tensor([4]))
    pos = mrope_positions(mask, image_mask, torch.tensor([0]), torch.tensor([[1, 2, 2]]))
    # text 0, 1; the image's (t, h, w) from 2; c at 2 + max(1, 2, 2) = 4; the sampled image
    # token is text: 5; d 6; padding 0
    assert pos[0, 0].tolist() == [0, 1, 2, 2, 2, 2, 4, 5, 6, 0]
    assert pos[1, 0].tolist() == [0, 1, 2, 2, 3, 3, 4, 5, 6, 0]
    assert pos[2, 0].tolist() == [0, 1, 2, 3, 2, 3, 4, 5, 6, 0]


def test_mrope_positions_equal_hfs_rope_index(qwen_vl):
    hf = AutoModelForImageTextToText.from_pretrained(qwen_vl, dtype=torch.float32)
    batch = Batch(trajectories(qwen_vl)).to_tensors()
    image_id, merge = hf.config.image_token_id, hf.config.vision_config.spatial_merge_size
    grids = batch.image_grid_thw.clone()
    grids[:, 1:] //= merge
    per_row = torch.zeros(len(batch), dtype=torch.long).index_add_(0, batch.image_rows,
                                                                    grids.prod(-1))
    ours = mrope_positions(batch.attention_mask,
                           prompt_image_mask(batch.input_ids, image_id, per_row),
                           batch.image_rows, grids)
    theirs, _ = hf.model.get_rope_index(
        batch.input_ids, mm_token_type_ids=(batch.input_ids == image_id).int(),
        image_grid_thw=batch.image_grid_thw, attention_mask=batch.attention_mask)
    assert torch.equal(ours * batch.attention_mask, theirs * batch.attention_mask)


def hf_logprobs(model, trajs: list[Trajectory], width: int) -> torch.Tensor:
    """HF's whole model on each row alone (its own image placement and positions):
    token-aligned log-probs [B, width]."""
    out = torch.zeros(len(trajs), width)
    for r, t in enumerate(trajs):
        ids = torch.tensor([t.input_ids])
        kwargs = {}
        if t.images is not None:
            kwargs = {"pixel_values": t.images.pixel_values,
                      "image_grid_thw": t.images.image_grid_thw,
                      "mm_token_type_ids": (ids == model.config.image_token_id).int()}
        logits = model(input_ids=ids, **kwargs).logits[0]
        picked = logits[:-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        out[r, 1:len(t.input_ids)] = picked
    return out


def test_logprobs_and_a_grpo_steps_loss_and_gradients_match_hf_row_by_row(qwen_vl, monkeypatch):
    trajs = trajectories(qwen_vl)
    hf = AutoModelForImageTextToText.from_pretrained(qwen_vl, dtype=torch.float32)
    batch = Batch(trajs).to_tensors()
    width = batch.input_ids.shape[1]
    with torch.no_grad():
        reference = hf_logprobs(hf.eval(), trajs, width)
    engine = FSDPTrainEngine(TrainEngineSpec(path=qwen_vl, dtype="float32", shared_prefix=False,
                                             optimizer=OptimizerConfig(lr=1e-3)), total_steps=2)
    engine.initialize()
    ours = engine.compute_logprobs(batch)
    torch.testing.assert_close(ours * batch.attention_mask, reference, atol=1e-5, rtol=0)
    # the pixels matter: other pixels give row 0's answer other log-probs
    other = Batch(trajs).to_tensors()
    other.pixel_values = other.pixel_values + 1.0
    changed = (engine.compute_logprobs(other) - ours).abs() * batch.loss_mask
    assert float(changed[0].max()) > 1e-3 and float(changed[2].max()) == 0.0

    # A plain policy-gradient loss with fixed per-row weights: -sum(w * logp) / n_tokens
    weights = torch.tensor([1.0, -0.5, 0.25, -1.0])[:, None]
    batch.advantages = weights * batch.loss_mask
    grads = {}
    clip = engine._clip_gradients

    def keep_gradients():
        grads.update({n.removeprefix("hf."): p.grad.clone()
                      for n, p in engine.model.named_parameters() if p.grad is not None})
        return clip()

    monkeypatch.setattr(engine, "_clip_gradients", keep_gradients)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    stats = engine.train_batch(batch, lambda lp, mb, n_tokens, n_seqs: (
        -(mb.advantages * lp * mb.loss_mask).sum() / n_tokens, {}))

    hf.train()
    logp = hf_logprobs(hf, trajs, width)
    loss = -(weights * logp * batch.loss_mask).sum() / batch.loss_mask.sum()
    loss.backward()
    assert stats["loss"] == pytest.approx(float(loss.detach()), abs=1e-6)
    for name in ("model.visual.patch_embed.proj.weight", "model.visual.merger.mlp.0.weight",
                 "model.language_model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
        ref = dict(hf.named_parameters())[name].grad
        assert ref.abs().max() > 0, name
        torch.testing.assert_close(grads[name], ref, atol=1e-6, rtol=1e-4)
    unchanged = [n for n, p in engine.model.named_parameters() if torch.equal(p, before[n])]
    assert unchanged == []  # the vision encoder and merger trained too


def test_saved_checkpoint_keeps_the_processor(qwen_vl, tmp_path):
    engine = FSDPTrainEngine(TrainEngineSpec(path=qwen_vl, dtype="float32", shared_prefix=False,
                                             optimizer=OptimizerConfig(lr=1e-3)), total_steps=1)
    engine.initialize()
    engine.save_hf(str(tmp_path / "v1"))
    saved = load_image_prompts(str(tmp_path / "v1"))
    assert saved is not None and saved.image_text == "<|vision_start|><|image_pad|><|vision_end|>"
    image = Image.new("RGB", (40, 24), (1, 2, 3))
    text = "<|vision_start|><|image_pad|><|vision_end|>x"
    ids, images = saved.encode(text, [image])
    ref_ids, ref_images = load_image_prompts(qwen_vl).encode(text, [image])
    assert ids == ref_ids and torch.equal(images.pixel_values, ref_images.pixel_values)
    assert isinstance(images, ImageInputs) and images.image_grid_thw.tolist() == [[1, 6, 10]]
