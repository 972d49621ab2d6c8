"""The vision-language paths that run on a GPU keep every tensor on the device.

As test_device_leaks.py does for text, each path runs on the simulated accelerator of
`device_check.py`, where a tensor made without `device=` stays on the CPU and an op that
meets it raises `DeviceLeak`, as CUDA would; the numbers are then checked against the same
path on the CPU. Training: a tiny Idefics3 (tiles, with and without shared prefixes) and a
tiny Qwen2.5-VL (patches, grids and three-dimensional positions), log-probs and a GRPO
step. Serving: our engine on Idefics3, an image prompt and a text one batched together.
"""

from __future__ import annotations

import pytest
import torch
from batches import image_trajectory
from device_check import simulated_device
from PIL import Image

from asyncrl.algorithms.advantages import compute_advantages_and_returns
from asyncrl.algorithms.ppo import make_ppo_loss_fn
from asyncrl.api.types import Batch, GenerationRequest, SamplingParams, Trajectory
from asyncrl.config.algorithm import ActorConfig, NormConfig
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import LocalEngineConfig, OptimizerConfig
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.models.tiny_qwen_vl import make_tiny_qwen_vl
from asyncrl.models.tiny_vlm import make_tiny_vlm
from asyncrl.openai.images import load_image_prompts
from asyncrl.trainer import engine as engine_module
from asyncrl.trainer.engine import FSDPTrainEngine

pytestmark = [pytest.mark.usefixtures("process_group"),
              pytest.mark.filterwarnings("ignore:.*non-meta parameter")]

# Per row: its images' sizes (none: a text row) and its reward; two GRPO groups of two. The
# two rows of the first group share their prompt, image included (a shared prefix).
IDEFICS_ROWS = [([(40, 40)], 1.0), ([(40, 40)], 0.0), ([(64, 16)], 0.2), ([], 0.6)]
QWEN_ROWS = [([(40, 24)], 1.0), ([(16, 32), (40, 24)], 0.0), ([], 0.5), ([(16, 32)], 0.25)]
OUTPUT = [[70, 71, 72, 73], [80, 81, 82], [90, 91, 92, 93, 94], [100, 101]]


@pytest.fixture(scope="module")
def idefics(tmp_path_factory) -> str:
    return make_tiny_vlm(tmp_path_factory.mktemp("idefics") / "m")


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory) -> str:
    return make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen_vl") / "m")


def trajectories(path: str, rows: list) -> list[Trajectory]:
    """A chat prompt per row with its images (the first two rows' prompts are equal when
    their sizes are) and a fixed output."""
    prompts = load_image_prompts(path)
    return [image_trajectory(
        prompts, [{"role": "user", "content": prompts.image_text * len(sizes) + f"row {i // 2}"}],
        [Image.new("RGB", s, (40 * (i // 2) + 30 * k, 150, 90)) for k, s in enumerate(sizes)],
        output, reward=reward, group_id=f"g{i // 2}")
        for i, ((sizes, reward), output) in enumerate(zip(rows, OUTPUT))]


def grpo_run(path: str, rows: list, device, **spec) -> tuple[torch.Tensor, float, float, dict]:
    """Log-probs, then one GRPO step: (log-probs, loss, grad norm, the weights after)."""
    engine = FSDPTrainEngine(TrainEngineSpec(path=path, dtype="float32",
                                             optimizer=OptimizerConfig(lr=1e-2, eps=1.0),
                                             **spec), total_steps=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "local_device", lambda *args, **kwargs: torch.device(device))
        engine.initialize()
    batch = Batch(trajectories(path, rows)).to_tensors()
    logprobs = engine.compute_logprobs(batch)
    cfg = ActorConfig(path=path, use_decoupled_loss=False, recompute_logprob=False,
                      reward_norm=NormConfig(group_size=2))
    batch.behavior_logprobs = (logprobs.cpu() - 0.05) * batch.loss_mask
    batch.advantages, batch.returns = compute_advantages_and_returns(batch, cfg)
    stats = engine.train_batch(batch, make_ppo_loss_fn(cfg))
    weights = engine.hf_state_dict()
    engine.destroy()
    return logprobs.cpu(), stats["loss"], stats["grad_norm"], weights


@pytest.mark.parametrize("model, rows, spec", [
    ("idefics", IDEFICS_ROWS, {}), ("idefics", IDEFICS_ROWS, {"shared_prefix": True}),
    ("qwen_vl", QWEN_ROWS, {})], ids=["idefics", "idefics_shared_prefix", "qwen2_5_vl"])
def test_a_vision_grpo_step_stays_on_the_device_and_computes_the_cpus_numbers(
        request, model, rows, spec):
    path = request.getfixturevalue(model)
    with simulated_device() as dev:
        ours = grpo_run(path, rows, dev, **spec)
    ref = grpo_run(path, rows, "cpu", **spec)
    torch.testing.assert_close(ours[0], ref[0], atol=1e-5, rtol=0)
    assert ours[0].abs().sum() > 0
    assert ours[1] == pytest.approx(ref[1], rel=1e-5, abs=1e-7)
    assert ours[2] == pytest.approx(ref[2], rel=1e-4) and ref[2] > 0
    vision = [n for n in ref[3] if "vision" in n or "visual" in n]
    assert vision  # the encoder's tensors are among those compared
    for name, value in ours[3].items():
        assert value.device.type == "cpu"  # what a publish writes
        torch.testing.assert_close(value, ref[3][name], atol=1e-5, rtol=0)


def serve(path: str, device) -> dict:
    """Greedy and seeded sampled answers to one image prompt, twice (a group sharing the
    prompt), and to a text prompt, batched together: tokens and log-probs of each."""
    engine = LocalEngine(path, LocalEngineConfig(dtype="float32", max_batch_size=4,
                                                 max_seq_len=256), device=device)
    [image_traj, _, _, text_traj] = trajectories(path, IDEFICS_ROWS)
    image_prompt = image_traj.input_ids[:image_traj.loss_mask.index(1)]
    text_prompt = text_traj.input_ids[:text_traj.loss_mask.index(1)]
    reqs = {"greedy": (image_prompt, image_traj.images, SamplingParams(temperature=0.0,
                                                                        max_new_tokens=6)),
            "sampled": (image_prompt, image_traj.images,
                        SamplingParams(temperature=0.9, max_new_tokens=6, seed=5)),
            "text": (text_prompt, None, SamplingParams(temperature=0.0, max_new_tokens=6))}
    out: dict = {}
    for name, (ids, images, params) in reqs.items():
        engine.submit(GenerationRequest(input_ids=ids, sampling=params, images=images),
                      lambda resp, name=name: out.__setitem__(name, resp))
    while len(out) < len(reqs):
        engine.step()
    return {k: (r.output_ids, r.output_logprobs) for k, r in out.items()}


def test_our_engine_serves_images_on_the_device_as_on_the_cpu(idefics):
    with simulated_device() as dev:
        ours = serve(idefics, dev)
    ref = serve(idefics, "cpu")
    for name in ref:
        assert ours[name][0] == ref[name][0], name
        assert len(ref[name][0]) == 6
        torch.testing.assert_close(torch.tensor(ours[name][1]), torch.tensor(ref[name][1]),
                                   atol=1e-4, rtol=0)
