"""The GPU paths' numbers on `test_device` ($ASYNCRL_TEST_DEVICE, default cpu) against
references computed independently in fp32 on the CPU (plain log_softmax and gather, HF
transformers' forward and autograd).

CPU CI runs them on the CPU; `ASYNCRL_TEST_DEVICE=cuda pytest -m device` runs the same
tests on a GPU. Shapes are tiny: a few seconds each.
"""

from __future__ import annotations

import pytest
import torch
from batches import random_batch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from asyncrl.api.types import Batch, GenerationRequest, SamplingParams, Trajectory
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import LocalEngineConfig, MicroBatchSpec, OptimizerConfig
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.models.tiny import make_tiny_model
from asyncrl.models.tiny_qwen_vl import make_tiny_qwen_vl
from asyncrl.openai.images import load_image_prompts
from asyncrl.trainer import engine as engine_module
from asyncrl.trainer.cpu import logprob_head
from asyncrl.trainer.cpu.logprob_head import token_logprobs
from asyncrl.trainer.engine import FSDPTrainEngine
from asyncrl.trainer.value import FSDPValueEngine

pytestmark = [pytest.mark.device, pytest.mark.usefixtures("process_group")]
VOCAB = 320  # the tiny model's
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="qwen3")


@pytest.fixture
def recomputed_chunks(monkeypatch):
    """3 rows per chunk of the log-prob head, templates kept for the first 3 rows only: the
    later chunks recompute their projection in backward (in either dtype)."""
    monkeypatch.setattr(logprob_head, "LOGIT_CHUNK_ELEMENTS", 3 * VOCAB)
    monkeypatch.setattr(logprob_head, "SAVED_TEMPLATE_BYTES", 3 * VOCAB * 2)


def engine_on(cls, path: str, device: torch.device, **spec) -> FSDPTrainEngine:
    """An initialised engine of `cls` on `device` (one rank)."""
    spec.setdefault("optimizer", OptimizerConfig(lr=1e-3, gradient_clipping=0.0))
    engine = cls(TrainEngineSpec(path=path, **spec), total_steps=10)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "local_device", lambda *args, **kwargs: device)
        engine.initialize()
    return engine


def hf_logprobs(model, batch, temperature: float = 1.0) -> torch.Tensor:
    """[B, T]: log p(token t | tokens < t) by HF's forward, log_softmax and gather; 0 at
    t = 0 and on padding."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    picked = (logits[:, :-1].float() / temperature).log_softmax(-1).gather(
        -1, batch.input_ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(picked * batch.attention_mask[:, 1:], (1, 0))


def nll_loss(logprobs, mb, *, n_tokens, n_seqs):
    return -(logprobs * mb.loss_mask).sum() / n_tokens, {}


# ---- the log-prob head ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_log_prob_head_equals_log_softmax_and_gather(test_device, recomputed_chunks, dtype):
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(11, 64, generator=gen), torch.randn(VOCAB, 64, generator=gen)
    tokens = torch.randint(0, VOCAB, (11,), generator=gen)
    upstream = torch.randn(11, generator=gen)
    h, w = (t.to(test_device, dtype).requires_grad_() for t in (hidden, weight))
    logprobs, entropy = token_logprobs(h, w, tokens.to(test_device), TEMPERATURE, True)
    (logprobs * upstream.to(test_device)).sum().backward()
    # The reference from the same (rounded) inputs, in fp32 on the CPU.
    h_ref, w_ref = (t.detach().cpu().float().requires_grad_() for t in (h, w))
    logp = ((h_ref @ w_ref.t()) / TEMPERATURE).log_softmax(-1)
    expected = logp.gather(-1, tokens[:, None])[:, 0]
    (expected * upstream).sum().backward()
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    assert logprobs.device == entropy.device == h.grad.device == w.grad.device == h.device
    torch.testing.assert_close(logprobs.cpu(), expected.detach(), **tol)
    torch.testing.assert_close(entropy.cpu(), -(logp.exp() * logp).sum(-1).detach(), **tol)
    torch.testing.assert_close(h.grad.cpu().float(), h_ref.grad, **tol)
    torch.testing.assert_close(w.grad.cpu().float(), w_ref.grad, **tol)


# ---- a train step ---------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [
    {"dtype": "float32"}, {"dtype": "float32", "shared_prefix": True},
    {"dtype": "bfloat16", "mb_spec": MicroBatchSpec(max_tokens_per_mb=24)}],
    ids=["fp32", "fp32_shared_prefix", "bf16_micro_batches"])
def test_a_train_steps_loss_and_gradients_equal_hf_autograd_on_the_cpu(
        tiny_model, test_device, recomputed_chunks, spec):
    engine = engine_on(FSDPTrainEngine, tiny_model, test_device, temperature=TEMPERATURE,
                       **spec)
    grads = {}

    def keep_grads(optimizer, args, kwargs):
        for name, p in engine.model.named_parameters():
            assert p.grad.device == p.device == test_device, name
            grads[name.removeprefix("hf.")] = p.grad.detach().cpu().clone()

    engine.optimizer.register_step_pre_hook(keep_grads)
    batch = random_batch()
    stats = engine.train_batch(batch, nll_loss)
    engine.destroy()

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    expected, _ = nll_loss(hf_logprobs(hf, batch, TEMPERATURE), batch,
                           n_tokens=int(batch.loss_mask.sum()), n_seqs=len(batch))
    expected.backward()
    bf16 = spec["dtype"] == "bfloat16"
    assert stats["loss"] == pytest.approx(float(expected.detach()), rel=0.01 if bf16 else 1e-5)
    params = dict(hf.named_parameters())
    assert grads.keys() == params.keys()
    for name, grad in grads.items():
        ref = params[name].grad
        if bf16:  # bf16 compute: the error's norm a few per cent of the gradient's (<3% here)
            assert float((grad - ref).norm() / ref.norm()) < 0.08, name
        else:
            torch.testing.assert_close(grad, ref, atol=1e-4, rtol=1e-4)


def test_qwen_vl_logprobs_on_the_device_equal_hfs_on_the_cpu(test_device, tmp_path):
    """Qwen2.5-VL's image features and three-dimensional positions placed by the trainer on
    the device: HF's whole model on each row alone, in fp32 on the CPU, is the reference."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    path = make_tiny_qwen_vl(tmp_path / "qwen_vl")
    prompts = load_image_prompts(path)
    tok = prompts.processor.tokenizer
    trajs = []
    for i, sizes in enumerate([[(40, 24)], [(16, 32), (24, 24)], []]):
        text = tok.apply_chat_template([{"role": "user", "content": prompts.image_text * len(
            sizes) + f"q{i}"}], add_generation_prompt=True, tokenize=False)
        if sizes:
            ids, images = prompts.encode(text, [Image.new("RGB", s, (60 * i, 90, 200 - 40 * k))
                                                for k, s in enumerate(sizes)])
        else:
            ids, images = tok.encode(text, add_special_tokens=False), None
        out = [70 + i, 71, 72]
        trajs.append(Trajectory(input_ids=ids + out, loss_mask=[0] * len(ids) + [1] * 3,
                                behavior_logprobs=[0.0] * (len(ids) + 3),
                                versions=[-1] * len(ids) + [0] * 3, reward=0.0, group_id="g",
                                images=images))
    batch = Batch(trajs).to_tensors()
    engine = engine_on(FSDPTrainEngine, path, test_device, dtype="float32", shared_prefix=False)
    ours = engine.compute_logprobs(batch).cpu()
    engine.destroy()

    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    rope_args = hf.model.get_rope_index.__code__.co_varnames
    for r, t in enumerate(trajs):
        ids = torch.tensor([t.input_ids])
        kwargs = {}
        if t.images is not None:
            kwargs = {"pixel_values": t.images.pixel_values,
                      "image_grid_thw": t.images.image_grid_thw}
            if "mm_token_type_ids" in rope_args:  # transformers 5
                kwargs["mm_token_type_ids"] = (ids == hf.config.image_token_id).int()
        with torch.no_grad():
            logits = hf(input_ids=ids, **kwargs).logits[0]
        ref = logits[:-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        torch.testing.assert_close(ours[r, 1:len(t.input_ids)], ref, atol=1e-4, rtol=0)


# ---- the critic -----------------------------------------------------------------------------

def test_critic_values_equal_hf_token_classification_on_the_cpu(tiny_model, test_device):
    engine = engine_on(FSDPValueEngine, tiny_model, test_device, dtype="float32")
    batch = random_batch()
    values = engine.compute_values(batch)
    weights = engine.hf_state_dict()
    config = engine.model.hf.config
    engine.destroy()
    hf = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
    hf.load_state_dict(weights)  # the engine's (seeded) head, read back on the CPU
    with torch.no_grad():
        scores = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[..., 0]
    # V of the state before token t: the head on hidden state t - 1, where t is real.
    expected = torch.nn.functional.pad(scores[:, :-1], (1, 0)) * batch.attention_mask
    expected[:, 0] = 0
    assert values.device.type == "cpu"
    torch.testing.assert_close(values, expected, atol=1e-5, rtol=1e-5)


# ---- checkpoints ----------------------------------------------------------------------------

def test_a_checkpoint_saved_on_the_device_resumes_exactly_and_loads_in_transformers(
        tiny_model, test_device, tmp_path):
    first = engine_on(FSDPTrainEngine, tiny_model, test_device, dtype="float32")
    first.train_batch(random_batch(), nll_loss)
    first.save_state(tmp_path / "state")
    first.save_hf(str(tmp_path / "hf"))
    batch = random_batch(seed=1)
    logprobs = first.compute_logprobs(batch)
    second = engine_on(FSDPTrainEngine, tiny_model, test_device, dtype="float32")
    second.load_state(tmp_path / "state")
    saved = first.hf_state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in second.hf_state_dict().items())
    after = [e.train_batch(random_batch(seed=2), nll_loss) for e in (first, second)]
    assert after[0]["loss"] == after[1]["loss"]  # the optimiser's moments came back too
    assert all(torch.equal(v, after_first) for (k, v), after_first in zip(
        second.hf_state_dict().items(), first.hf_state_dict().values()))
    first.destroy()
    second.destroy()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(logprobs, hf_logprobs(hf, batch), atol=1e-4, rtol=1e-4)


# ---- the local engine -----------------------------------------------------------------------

def test_greedy_decoding_equals_hfs_argmax_on_the_same_model(tiny_model, test_device):
    engine = LocalEngine(tiny_model, LocalEngineConfig(dtype="float32", max_batch_size=2,
                                                       max_seq_len=64), device=str(test_device))
    prompts = [[10, 11, 12, 13, 14], [200, 150, 100]]  # of two lengths: padded prefill
    reqs = [GenerationRequest(input_ids=p, sampling=SamplingParams(
        temperature=0.0, max_new_tokens=8, ignore_eos=True)) for p in prompts]
    out: dict = {}
    for req in reqs:
        engine.submit(req, lambda resp: out.__setitem__(resp.rid, resp))
    while len(out) < len(reqs):
        engine.step()
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for req, prompt in zip(reqs, prompts):
        ids, logprobs = list(prompt), []
        with torch.no_grad():
            for _ in range(8):  # a full forward per token: no cache on HF's side
                logp = hf(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
                ids.append(int(logp.argmax()))
                logprobs.append(float(logp[ids[-1]]))
        assert out[req.rid].output_ids == ids[len(prompt):]
        assert out[req.rid].output_logprobs == pytest.approx(logprobs, abs=1e-4)
