"""The RLVR workflow against a fake engine: prompts, alignment, rewards, group ids, errors."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from asyncrl.api.protocols import Workflow
from asyncrl.api.types import GenerationRequest, GenerationResponse, StopReason
from asyncrl.config.schema import GenerationConfig
from asyncrl.controller.workflows import RLVRWorkflow
from asyncrl.data import build_messages, encode_chat
from asyncrl.models.tiny import make_tiny_tokenizer
from asyncrl.models.tiny_vlm import make_tiny_vlm
from asyncrl.openai.images import load_image_prompts
from asyncrl.rewards import RewardError, RewardRunner, gsm8k_reward

ITEM = {"id": "gsm8k-1", "question": "What is 9 * 2?", "answer": "18", "task": "gsm8k"}
SYSTEM = "End with #### N."
FEW_SHOT = [{"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"}]


class FakeEngine:
    """Answers the i-th request with the i-th canned completion, then the engine's EOS."""

    def __init__(self, tokenizer, completions: list[str], version: int = 3):
        self.tokenizer = tokenizer
        self.completions = completions
        self.version = version
        self.requests: list[GenerationRequest] = []

    async def agenerate(self, req: GenerationRequest) -> GenerationResponse:
        text = self.completions[len(self.requests) % len(self.completions)]
        self.requests.append(req)
        await asyncio.sleep(0)  # let the other samples of the group interleave
        out = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        # Distinct, hand-checkable numbers: token k of the completion has log-prob -(k+1)/10.
        return GenerationResponse(
            rid=req.rid, input_ids=list(req.input_ids), output_ids=out,
            output_logprobs=[-(k + 1) / 10 for k in range(len(out))],
            output_versions=[self.version] * len(out), stop_reason=StopReason.STOP,
        )

    async def pause(self) -> None: ...
    async def resume(self) -> None: ...
    async def update_weights_from_disk(self, path: str, version: int) -> None: ...
    async def close(self) -> None: ...


class BrokenEngine(FakeEngine):
    async def agenerate(self, req: GenerationRequest) -> GenerationResponse:
        raise ConnectionError("server 0 went away")


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def make_workflow(tok, *, n_samples: int = 3, reward_fn=gsm8k_reward, **gconfig) -> RLVRWorkflow:
    gconfig = GenerationConfig(n_samples=n_samples, max_new_tokens=16, **gconfig)
    runner = RewardRunner(reward_fn, timeout=10.0, processes=False)
    return RLVRWorkflow(tok, gconfig, runner, system_prompt=SYSTEM, few_shot=FEW_SHOT)


def test_rlvr_workflow_is_a_workflow(tok):
    assert isinstance(make_workflow(tok), Workflow)


def test_one_scored_trajectory_per_sample(tok):
    completions = ["9 * 2 = 18\n#### 18", "#### 17", "no idea"]
    engine = FakeEngine(tok, completions)
    trajs = asyncio.run(make_workflow(tok).run(engine, ITEM))
    assert len(trajs) == 3
    assert [t.meta["completion"] for t in trajs] == completions  # EOS skipped when decoding
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.0]
    assert [t.meta["sample_index"] for t in trajs] == [0, 1, 2]
    assert all(t.meta["task_id"] == "gsm8k-1" and t.meta["gold_answer"] == "18" for t in trajs)


def test_tokens_masks_logprobs_and_versions_line_up(tok):
    engine = FakeEngine(tok, ["#### 18"], version=7)
    traj = asyncio.run(make_workflow(tok, n_samples=1).run(engine, ITEM))[0]
    prompt = encode_chat(tok, build_messages(ITEM["question"], system_prompt=SYSTEM,
                                             few_shot=FEW_SHOT))
    output = tok.encode("#### 18", add_special_tokens=False) + [tok.eos_token_id]
    assert len(output) == 8  # byte-level: 7 characters + EOS
    p = len(prompt)
    assert traj.input_ids == prompt + output
    assert traj.loss_mask == [0] * p + [1] * 8
    assert traj.behavior_logprobs == [0.0] * p + [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7, -0.8]
    assert traj.versions == [-1] * p + [7] * 8
    assert traj.stop_reason is StopReason.STOP


def test_without_the_chat_template_the_prompt_is_the_plain_text(tok):
    gconfig = GenerationConfig(n_samples=1, max_new_tokens=16)
    workflow = RLVRWorkflow(tok, gconfig, RewardRunner(gsm8k_reward, timeout=10.0,
                                                       processes=False),
                            system_prompt=SYSTEM, chat_template=False)
    plain = tok.encode(f"{SYSTEM}\n\n{ITEM['question']}")
    assert workflow.prompt_ids(ITEM) == plain
    traj = asyncio.run(workflow.run(FakeEngine(tok, ["#### 18"]), ITEM))[0]
    assert traj.input_ids[:len(plain)] == plain and traj.reward == 1.0


def test_requests_carry_the_gconfig_sampling(tok):
    engine = FakeEngine(tok, ["#### 18"])
    workflow = make_workflow(tok, n_samples=2, greedy=True, top_p=0.9, top_k=5,
                             stop_token_ids=[7], stop=["\n\n"])
    asyncio.run(workflow.run(engine, ITEM))
    assert len(engine.requests) == 2 and engine.requests[0].rid != engine.requests[1].rid
    s = engine.requests[0].sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens) == (0.0, 0.9, 5, 16)
    assert s.stop_token_ids == [7, tok.eos_token_id] and s.stop == ["\n\n"]


def test_group_id_is_shared_within_a_call_and_new_for_each_call(tok):
    engine = FakeEngine(tok, ["#### 18"])
    workflow = make_workflow(tok)
    first = asyncio.run(workflow.run(engine, ITEM))
    second = asyncio.run(workflow.run(engine, ITEM))  # the same item, next epoch
    assert len({t.group_id for t in first}) == 1 and len({t.group_id for t in second}) == 1
    assert first[0].group_id != second[0].group_id
    assert first[0].group_id.startswith("gsm8k-1")


def test_engine_errors_propagate(tok):
    with pytest.raises(ConnectionError, match="server 0 went away"):
        asyncio.run(make_workflow(tok).run(BrokenEngine(tok, ["x"]), ITEM))


def failing_reward(completion: str, item: dict) -> float:
    raise KeyError("metadata")


def test_reward_errors_propagate_naming_the_item(tok):
    workflow = make_workflow(tok, reward_fn=failing_reward)
    with pytest.raises(RewardError, match="'gsm8k-1'"):
        asyncio.run(workflow.run(FakeEngine(tok, ["#### 18"]), ITEM))


def _length_with_info(completion, item):
    """A reward that says how it scored: the completion's length, and that length as info."""
    return float(len(completion)), {"chars": len(completion)}


def test_a_reward_with_info_keeps_its_info_in_each_trajectorys_meta(tok):
    completions = ["ab", "abcde"]
    trajs = asyncio.run(make_workflow(tok, n_samples=2, reward_fn=_length_with_info)
                        .run(FakeEngine(tok, completions), ITEM))
    assert [t.reward for t in trajs] == [2.0, 5.0]
    assert [t.meta["reward_info"] for t in trajs] == [{"chars": 2}, {"chars": 5}]
    plain = asyncio.run(make_workflow(tok).run(FakeEngine(tok, ["#### 18"]), ITEM))
    assert all("reward_info" not in t.meta for t in plain)


def test_a_reward_pair_whose_value_is_not_a_number_is_an_error(tok):
    workflow = make_workflow(tok, n_samples=1, reward_fn=lambda c, i: ("1", {"why": "text"}))
    with pytest.raises(RewardError, match="expected a finite number or a"):
        asyncio.run(workflow.run(FakeEngine(tok, ["x"]), ITEM))


def test_eval_copy_is_greedy_with_one_sample(tok):
    engine = FakeEngine(tok, ["#### 18"])
    trajs = asyncio.run(make_workflow(tok).for_eval(max_new_tokens=8).run(engine, ITEM))
    assert len(trajs) == 1 and trajs[0].reward == 1.0
    assert engine.requests[0].sampling.temperature == 0.0
    assert engine.requests[0].sampling.max_new_tokens == 8


def test_quickstart_recipe_is_a_valid_config_whose_gold_answers_score_one():
    from importlib import resources

    from asyncrl.config.loader import load_config
    from asyncrl.data import held_out, load_dataset
    from asyncrl.rewards import resolve_reward_fn

    cfg = load_config(resources.files("asyncrl.recipes") / "quickstart.yaml")
    assert cfg.workflow.few_shot == [{"question": "Calculate 23 + 45.",
                                      "answer": "23 + 45 = 68. <answer>68</answer>"}]
    items = load_dataset(cfg.valid_dataset)
    train = load_dataset(cfg.train_dataset)
    assert len(items) == 128 and all("+" in i["question"] for i in items)
    # two-digit sums are few: some held-out questions occur in training and are dropped
    kept = held_out(items, train)
    assert 100 <= len(kept) < 128
    assert not {i["question"] for i in kept} & {i["question"] for i in train}
    reward = resolve_reward_fn(cfg.workflow.reward_fn)
    assert all(reward(f"<answer>{i['answer']}</answer>", i) == 1.0 for i in items)


def test_a_seeded_item_gives_each_sample_its_own_seed(tok):
    from asyncrl.api.types import SAMPLING_SEED_KEY, mix_seed

    engine = FakeEngine(tok, ["#### 18"])
    workflow = make_workflow(tok)
    asyncio.run(workflow.run(engine, {**ITEM, SAMPLING_SEED_KEY: 77}))
    asyncio.run(workflow.run(engine, ITEM))
    assert sorted(r.sampling.seed for r in engine.requests[:3]) == \
        sorted(mix_seed(77, i) for i in range(3))
    assert len({r.sampling.seed for r in engine.requests[:3]}) == 3
    assert [r.sampling.seed for r in engine.requests[3:]] == [None] * 3


def test_an_items_images_go_first_in_its_turn_and_reach_the_request_and_trajectories(tmp_path):
    path = make_tiny_vlm(tmp_path / "vlm")
    processor = AutoProcessor.from_pretrained(path)
    red, blue = Image.new("RGB", (40, 40), (200, 10, 30)), Image.new("RGB", (64, 16), (0, 0, 90))
    buf = io.BytesIO()
    blue.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
    item = {**ITEM, "images": [red, url]}
    tok = processor.tokenizer
    workflow = RLVRWorkflow(tok, GenerationConfig(n_samples=2, max_new_tokens=16),
                            RewardRunner(gsm8k_reward, 5.0), system_prompt=SYSTEM,
                            images=load_image_prompts(path))
    engine = FakeEngine(tok, ["#### 18"])
    trajs = asyncio.run(workflow.run(engine, item))
    workflow.close()
    # independently: the processor on the same turn, images first in the user message
    text = processor.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": [
            {"type": "image"}, {"type": "image"}, {"type": "text", "text": ITEM["question"]}]}],
        add_generation_prompt=True)
    expected = processor(text=text, images=[red, blue], add_special_tokens=False,
                         return_tensors="pt")
    ids = expected["input_ids"][0].tolist()
    assert [r.input_ids for r in engine.requests] == [ids, ids]
    for req, traj in zip(engine.requests, trajs, strict=True):
        assert torch.equal(req.images.pixel_values, expected["pixel_values"][0])
        assert traj.images is req.images and traj.input_ids[:len(ids)] == ids
        assert traj.reward == 1.0
    with pytest.raises(ValueError, match="has images, but the model reads text only"):
        make_workflow(make_tiny_tokenizer()).prompt_ids(item)
