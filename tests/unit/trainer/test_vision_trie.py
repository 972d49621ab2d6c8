"""A vision-language batch as a prefix trie (`actor.shared_prefix`): the samples of a group
share their prompt, image tokens included, only where their pixels are equal; log-probs and
a step's gradients equal the row-by-row path's, for tiles (Idefics3) and patches with
three-dimensional positions (Qwen2.5-VL)."""

import pytest
import torch
from batches import image_trajectory
from PIL import Image

from asyncrl.api.types import Batch
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import OptimizerConfig
from asyncrl.models.tiny_qwen_vl import make_tiny_qwen_vl
from asyncrl.models.tiny_vlm import make_tiny_vlm
from asyncrl.openai.images import load_image_prompts
from asyncrl.trainer import FSDPTrainEngine
from asyncrl.trainer.engine import TokenLogprobModel
from asyncrl.trainer.prefix import MIN_SHARED_TOKENS, pack_prefixes
from asyncrl.trainer.vision import image_keys

pytestmark = pytest.mark.usefixtures("process_group")

# Rows 0-2: one prompt and image, three answers (a GRPO group). Row 3: the same text and
# image size (so the same token ids), other pixels, row 0's answer. Row 4: text only.
COLOURS = [(200, 30, 30)] * 3 + [(30, 60, 220), None]
OUTPUT = [[70, 71, 72], [70, 75], [80, 81, 82, 83], [70, 71, 72], [90, 91]]
# Long enough for the text before the image to be worth sharing (MIN_SHARED_TOKENS).
SYSTEM = "Look at the image and answer with one word or number."
WEIGHTS = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.5])[:, None]


@pytest.fixture(scope="module", params=["idefics3", "qwen2_5_vl"])
def model_path(request, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp(request.param) / "m"
    return make_tiny_vlm(folder) if request.param == "idefics3" else make_tiny_qwen_vl(folder)


def make_batch(path: str) -> Batch:
    prompts = load_image_prompts(path)
    return Batch([image_trajectory(
        prompts, [{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": (prompts.image_text if colour else "")
                   + "How many shapes are there?"}],
        [Image.new("RGB", (32, 32), colour)] if colour else [], output, group_id=f"g{i}")
        for i, (colour, output) in enumerate(zip(COLOURS, OUTPUT))])


def step(path: str, shared_prefix: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Log-probs before, and every gradient of, one step of -sum(w * logp) / n_tokens."""
    engine = FSDPTrainEngine(TrainEngineSpec(path=path, dtype="float32",
                                             shared_prefix=shared_prefix,
                                             optimizer=OptimizerConfig(lr=1e-3)), total_steps=1)
    engine.initialize()
    batch = make_batch(path).to_tensors()
    logprobs = engine.compute_logprobs(batch)
    batch.advantages = WEIGHTS * batch.loss_mask
    grads = {}
    clip = engine._clip_gradients

    def keep_gradients():
        grads.update({n: p.grad.clone() for n, p in engine.model.named_parameters()
                      if p.grad is not None})
        return clip()

    engine._clip_gradients = keep_gradients
    engine.train_batch(batch, lambda lp, mb, n_tokens, n_seqs: (
        -(mb.advantages * lp * mb.loss_mask).sum() / n_tokens, {}))
    engine.destroy()
    return logprobs * batch.loss_mask, grads


def test_rows_share_image_tokens_only_where_their_pixels_are_equal(model_path):
    batch = make_batch(model_path).to_tensors()
    prompts = load_image_prompts(model_path)
    image_token = prompts.processor.tokenizer.convert_tokens_to_ids(prompts.placeholder)
    keys = image_keys(batch.input_ids, image_token, batch.images, batch.image_rows)
    pack = pack_prefixes(batch.input_ids, batch.attention_mask, keys=keys)
    is_image = batch.input_ids == image_token
    first = int(is_image[0].nonzero()[0])
    lengths = batch.attention_mask.sum(-1).tolist()
    prompt = lengths[0] - len(OUTPUT[0])
    assert first >= MIN_SHARED_TOKENS
    # rows 0 and 3: the same token ids, other pixels
    assert torch.equal(batch.input_ids[0, :prompt], batch.input_ids[3, :prompt])
    # the group shares its whole prompt, images included
    for row in (1, 2):
        assert torch.equal(pack.node_of[row, :prompt], pack.node_of[0, :prompt])
    # row 3 shares the text before the image, then has nodes of its own
    assert torch.equal(pack.node_of[3, :first], pack.node_of[0, :first])
    assert not (pack.node_of[3, first:prompt, None] == pack.node_of[0, None, :]).any()
    # the keys stand for the pixels: without them the image tokens of rows 0 and 3 would tie
    plain = pack_prefixes(batch.input_ids, batch.attention_mask)
    assert torch.equal(plain.node_of[3, :prompt], plain.node_of[0, :prompt])
    # one node per distinct prefix of keys (the rows make one tree: capacity 2 x longest)
    distinct = {tuple(keys[b, :t + 1].tolist()) for b, n in enumerate(lengths) for t in range(n)}
    assert pack.n_nodes == len(distinct) < sum(lengths)


def test_logprobs_and_gradients_equal_the_row_by_row_path(model_path, monkeypatch):
    rows, row_grads = step(model_path, shared_prefix=False)
    calls = []
    trie_logprobs = TokenLogprobModel._trie_logprobs
    monkeypatch.setattr(TokenLogprobModel, "_trie_logprobs",
                        lambda self, *a, **k: calls.append(1) or trie_logprobs(self, *a, **k))
    trie, trie_grads = step(model_path, shared_prefix=True)
    assert len(calls) == 2  # compute_logprobs and the step ran on the trie
    # the pixels matter: rows 0 and 3 differ in them alone, and their answer's log-probs
    assert float((rows[0] - rows[3]).abs().max()) > 1e-3
    torch.testing.assert_close(trie, rows, atol=1e-5, rtol=0)
    assert trie_grads.keys() == row_grads.keys()
    vision = [n for n in row_grads if "vision" in n or "visual" in n]
    assert vision and all(row_grads[n].abs().max() > 0 for n in vision)
    for name, grad in row_grads.items():
        torch.testing.assert_close(trie_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)
