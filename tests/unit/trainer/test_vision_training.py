"""Training a vision-language model (tiny Idefics3): the trajectories' images reach HF's
vision encoder, and a GRPO step's loss and gradients equal HF's whole model's by hand."""

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from asyncrl.algorithms.advantages import compute_advantages_and_returns
from asyncrl.algorithms.ppo import make_ppo_loss_fn
from asyncrl.api.types import Batch, ImageInputs, Trajectory
from asyncrl.config.algorithm import ActorConfig, NormConfig
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import LocalEngineConfig, OptimizerConfig
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.models.tiny_vlm import make_tiny_vlm
from asyncrl.openai.images import load_image_prompts
from asyncrl.trainer import FSDPTrainEngine
from asyncrl.trainer.service import decode_batch, encode_batch

pytestmark = pytest.mark.usefixtures("process_group")

# (image size or None for a text-only row, reward): two GRPO groups of two
ROWS = [((40, 40), 1.0), ((64, 16), 0.0), ((10, 40), 0.2), (None, 0.6)]
OUTPUT = [[70, 71, 72, 73], [80, 81, 82], [90, 91, 92, 93, 94], [100, 101]]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> str:
    return make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "m")


def trajectories(path: str) -> list[Trajectory]:
    """Prompt (with its image, if any) + a fixed output per row; behaviour log-probs are
    filled in by the test."""
    processor = AutoProcessor.from_pretrained(path)
    out = []
    for i, ((size, reward), output) in enumerate(zip(ROWS, OUTPUT)):
        content = [{"type": "text", "text": f"row {i}"}]
        if size is not None:
            content.insert(0, {"type": "image"})
        text = processor.apply_chat_template([{"role": "user", "content": content}],
                                             add_generation_prompt=True)
        images = [Image.new("RGB", size, (40 * i, 200 - 30 * i, 90))] if size else None
        features = processor(text=text, images=images, add_special_tokens=False,
                             return_tensors="pt")
        prompt = features["input_ids"][0].tolist()
        n = len(prompt) + len(output)
        out.append(Trajectory(
            input_ids=prompt + output, loss_mask=[0] * len(prompt) + [1] * len(output),
            behavior_logprobs=[0.0] * n, versions=[-1] * len(prompt) + [0] * len(output),
            reward=reward, group_id=f"g{i // 2}",
            images=ImageInputs.from_processor(features) if size else None))
    return out


def hf_logprobs(model, batch) -> torch.Tensor:
    """HF's whole model on the batch in its own layout (images padded per row with all-zero
    tiles, which it drops): token-aligned log-probs [B, T]."""
    rows = batch.image_rows.tolist()
    most = max(rows.count(r) for r in set(rows))
    b, (c, h, w) = len(batch), batch.pixel_values.shape[1:]
    pixels = torch.zeros(b, most, c, h, w)
    mask = torch.zeros(b, most, h, w, dtype=torch.bool)
    for r in set(rows):
        tiles = [i for i, row in enumerate(rows) if row == r]
        pixels[r, :len(tiles)] = batch.pixel_values[tiles]
        mask[r, :len(tiles)] = batch.pixel_attention_mask[tiles]
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   pixel_values=pixels, pixel_attention_mask=mask).logits
    picked = logits[:, :-1].log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(picked * batch.attention_mask[:, 1:], (1, 0))


def test_batch_carries_each_rows_tiles_and_selecting_rows_keeps_theirs(vlm):
    batch = Batch(trajectories(vlm)).to_tensors()
    # 2 x 2 tiles + the whole image; 1 x 2 + 1; 2 x 1 + 1; none for the text row
    assert batch.image_rows.tolist() == [0] * 5 + [1] * 3 + [2] * 3
    picked = batch.select([2, 3, 0])
    assert picked.image_rows.tolist() == [0] * 3 + [2] * 5
    assert torch.equal(picked.pixel_values, batch.pixel_values[[8, 9, 10, 0, 1, 2, 3, 4]])
    # the bytes the controller sends trainer ranks hold them unchanged
    sent = decode_batch(encode_batch(batch))
    for name in ("pixel_values", "pixel_attention_mask", "image_rows"):
        assert torch.equal(getattr(sent, name), getattr(batch, name))


def test_logprobs_and_a_grpo_steps_loss_and_gradients_match_hf_by_hand(vlm, monkeypatch):
    trajs = trajectories(vlm)
    hf = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32)
    batch = Batch(trajs).to_tensors()
    with torch.no_grad():
        reference = hf_logprobs(hf.eval(), batch)
    engine = FSDPTrainEngine(TrainEngineSpec(path=vlm, dtype="float32",
                                             optimizer=OptimizerConfig(lr=1e-3)), total_steps=2)
    engine.initialize()
    torch.testing.assert_close(engine.compute_logprobs(batch), reference, atol=1e-5, rtol=0)

    # Behaviour log-probs a little off the current ones: ratios e^0.05 (inside the clip).
    batch.behavior_logprobs = (reference - 0.05) * batch.loss_mask
    cfg = ActorConfig(path=vlm, use_decoupled_loss=False, recompute_logprob=False,
                      reward_norm=NormConfig(group_size=2))
    batch.advantages, batch.returns = compute_advantages_and_returns(batch, cfg)
    # GRPO by hand: per group of two, (r - mean) / (std + 1e-5), std = |r1 - r2| / 2
    adv = [(1 - 0.5) / (0.5 + 1e-5), (0 - 0.5) / (0.5 + 1e-5),
           (0.2 - 0.4) / (0.2 + 1e-5), (0.6 - 0.4) / (0.2 + 1e-5)]
    torch.testing.assert_close(batch.advantages, torch.tensor(adv)[:, None] * batch.loss_mask)

    grads = {}
    clip = engine._clip_gradients

    def keep_gradients():
        grads.update({n.removeprefix("hf."): p.grad.clone()
                      for n, p in engine.model.named_parameters() if p.grad is not None})
        return clip()

    monkeypatch.setattr(engine, "_clip_gradients", keep_gradients)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    stats = engine.train_batch(batch, make_ppo_loss_fn(cfg))

    # The same loss on HF's model: -sum(A * exp(logp - behav)) over the output tokens / n
    hf.train()
    logp = hf_logprobs(hf, batch)
    ratio = torch.exp(logp - batch.behavior_logprobs)
    loss = -(batch.advantages * ratio * batch.loss_mask).sum() / batch.loss_mask.sum()
    loss.backward()
    assert stats["loss"] == pytest.approx(float(loss.detach()), abs=1e-6)
    for name in ("model.vision_model.embeddings.patch_embedding.weight",
                 "model.connector.modality_projection.proj.weight",
                 "model.text_model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
        ref = dict(hf.named_parameters())[name].grad
        assert ref.abs().max() > 0, name
        torch.testing.assert_close(grads[name], ref, atol=1e-6, rtol=1e-4)
    unchanged = [n for n, p in engine.model.named_parameters() if torch.equal(p, before[n])]
    assert unchanged == []  # the vision encoder and connector trained too


def test_trained_weights_published_to_our_engine_give_the_trainers_logprobs(vlm, tmp_path):
    batch = Batch(trajectories(vlm)).to_tensors()
    trainer = FSDPTrainEngine(TrainEngineSpec(path=vlm, dtype="float32",
                                              optimizer=OptimizerConfig(lr=1e-2)), total_steps=2)
    trainer.initialize()
    trainer.train_batch(batch, lambda lp, mb, n_tokens, n_seqs: (
        -(lp * mb.loss_mask).sum() / n_tokens, {}))
    trained = trainer.compute_logprobs(batch)
    trainer.save_hf(str(tmp_path / "v1"))
    assert load_image_prompts(str(tmp_path / "v1")) is not None  # the processor came along

    engine = LocalEngine(vlm, LocalEngineConfig(dtype="float32", max_batch_size=2,
                                                max_seq_len=256))
    engine.update_weights(str(tmp_path / "v1"), version=1)
    n = int(batch.attention_mask[0].sum())
    ids = batch.input_ids[:1, :n]
    images = ImageInputs(pixel_values=batch.pixel_values[:5],
                         pixel_attention_mask=batch.pixel_attention_mask[:5])
    mask = ids == engine.vision.image_token_id
    logits = engine.model.prefill(ids, torch.tensor([n]), engine.cache, 0, all_logits=True,
                                  embeds=(mask, engine.vision.embed(images)))[0]
    served = logits[:-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(served, trained[0, 1:n], atol=1e-4, rtol=0)
    before = hf_logprobs(AutoModelForImageTextToText.from_pretrained(vlm).eval(), batch)
    assert (trained - before).abs().max() > 1e-2  # the step changed them


def test_actor_frozen_modules_keep_the_language_model_fixed_in_a_grpo_step(vlm):
    """`actor.frozen_modules` reaches the RL trainer's engine: a GRPO step moves the vision
    encoder and connector and leaves every text-model tensor bit for bit."""
    cfg = ActorConfig(path=vlm, dtype="float32", frozen_modules=["model.text_model", "lm_head"],
                      optimizer=OptimizerConfig(lr=1e-2), use_decoupled_loss=False,
                      recompute_logprob=False, reward_norm=NormConfig(group_size=2))
    spec = TrainEngineSpec.of(cfg)
    assert spec.frozen_modules == ("model.text_model", "lm_head")
    engine = FSDPTrainEngine(spec, total_steps=2)
    engine.initialize()
    batch = Batch(trajectories(vlm)).to_tensors()
    batch.behavior_logprobs = engine.compute_logprobs(batch)
    batch.advantages, batch.returns = compute_advantages_and_returns(batch, cfg)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.train_batch(batch, make_ppo_loss_fn(cfg))
    changed = {n.removeprefix("hf.") for n, p in engine.model.named_parameters()
               if not torch.equal(p, before[n])}
    names = [n.removeprefix("hf.") for n in before]
    vision = {n for n in names if n.startswith(("model.vision_model.", "model.connector."))}
    # Every vision tensor with a gradient moved (LayerNorm biases of a ViT all do here).
    assert changed == vision, sorted(changed ^ vision)[:8]
    engine.destroy()


def test_actor_frozen_modules_with_lora_is_refused():
    with pytest.raises(ValueError, match="actor.frozen_modules with actor.use_lora"):
        ActorConfig(use_lora=True, frozen_modules=["model.vision_model"])
