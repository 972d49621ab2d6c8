"""RLVR: one prompt, n sampled answers, each scored by a verifiable reward.

An item may hold `images` (PIL images, or data URLs) for a vision-language model: they go
first in the question's user turn, and the model's processor makes the prompt's image
tokens and the pixel tensors that the request and its trajectories carry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from asyncrl.api.protocols import InferenceEngine
from asyncrl.api.types import (
    SAMPLING_SEED_KEY,
    GenerationRequest,
    GenerationResponse,
    ImageInputs,
    SamplingParams,
    Trajectory,
    mix_seed,
)
from asyncrl.config.schema import GenerationConfig, WorkflowConfig
from asyncrl.data.prompts import build_messages, encode_chat
from asyncrl.openai.images import ImagePrompts
from asyncrl.rewards.registry import resolve_reward_fn
from asyncrl.rewards.runner import RewardRunner

T = TypeVar("T")


def sampling_params(gconfig: GenerationConfig, *,
                    eos_token_id: int | None = None) -> SamplingParams:
    """SamplingParams from `gconfig`, stopping at the tokenizer's EOS as well."""
    stop_ids = list(gconfig.stop_token_ids)
    if eos_token_id is not None and eos_token_id not in stop_ids:
        stop_ids.append(eos_token_id)
    return SamplingParams(
        max_new_tokens=gconfig.max_new_tokens,
        temperature=gconfig.effective_temperature,
        top_p=gconfig.top_p,
        top_k=gconfig.top_k,
        stop_token_ids=stop_ids,
        stop=list(gconfig.stop),
    )


async def gather_or_cancel(*aws: Awaitable[T]) -> list[T]:
    """Like asyncio.gather, but the first failure cancels the others before it propagates."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # let cancellations finish
        raise


class RLVRWorkflow:
    """Sample `gconfig.n_samples` answers to an item's question and score each one.

    `reward` None: the answers are not scored and carry reward 0.0. Only pure on-policy
    distillation, which learns from a teacher instead of rewards, runs this way (the config
    refuses `workflow.reward_fn: null` elsewhere).
    """

    def __init__(self, tokenizer: Any, gconfig: GenerationConfig, reward: RewardRunner | None, *,
                 system_prompt: str | None = None, few_shot: Sequence[dict[str, str]] = (),
                 chat_template: bool = True, images: ImagePrompts | None = None):
        """`images`: the processor of a model that reads images (items' `images`)."""
        self.tokenizer = tokenizer
        self.images = images
        self.gconfig = gconfig
        self.reward = reward
        self.system_prompt = system_prompt
        self.few_shot = list(few_shot)
        self.chat_template = chat_template
        self.sampling = sampling_params(gconfig, eos_token_id=tokenizer.eos_token_id)
        build_messages("", system_prompt=system_prompt, few_shot=self.few_shot)  # fail early

    @classmethod
    def from_config(cls, tokenizer: Any, gconfig: GenerationConfig, wconfig: WorkflowConfig, *,
                    reward_workers: int = 2, images: ImagePrompts | None = None) -> RLVRWorkflow:
        """The workflow `wconfig` describes; the caller calls `workflow.close()` at the end."""
        runner = None
        if wconfig.reward_fn is not None:
            reward_fn = resolve_reward_fn(wconfig.reward_fn,
                                          reward_model_path=wconfig.reward_model_path)
            runner = RewardRunner(reward_fn, wconfig.reward_timeout, workers=reward_workers)
        return cls(tokenizer, gconfig, runner, system_prompt=wconfig.system_prompt,
                   few_shot=wconfig.few_shot, images=images)

    def for_eval(self, max_new_tokens: int | None = None) -> RLVRWorkflow:
        """A greedy, one-sample copy for evaluation, sharing the prompt and reward runner."""
        gconfig = dataclasses.replace(self.gconfig, n_samples=1, greedy=True,
                                      max_new_tokens=max_new_tokens or self.gconfig.max_new_tokens)
        return self.with_sampling(gconfig)

    def with_sampling(self, gconfig: GenerationConfig) -> RLVRWorkflow:
        """A copy that samples as `gconfig` says, sharing the prompt and reward runner."""
        return RLVRWorkflow(self.tokenizer, gconfig, self.reward, system_prompt=self.system_prompt,
                            few_shot=self.few_shot, chat_template=self.chat_template,
                            images=self.images)

    def close(self) -> None:
        """Stop the reward workers (shared with `for_eval` copies)."""
        if self.reward is not None:
            self.reward.close()

    def prompt_ids(self, item: dict[str, Any]) -> list[int]:
        """The prompt of `item` as token ids: its chat prompt, or with `chat_template` off the
        plain text (system prompt, each example's question and answer, the question)."""
        return self.prompt(item)[0]

    def prompt(self, item: dict[str, Any]) -> tuple[list[int], ImageInputs | None]:
        """`prompt_ids`, and the images of an item that has some (their tokens in place)."""
        if item.get("images"):
            return self._image_prompt(item)
        if not self.chat_template:
            return self.tokenizer.encode(self.plain_prompt(item["question"])), None
        messages = build_messages(item["question"], system_prompt=self.system_prompt,
                                  few_shot=self.few_shot)
        return encode_chat(self.tokenizer, messages), None

    def _image_prompt(self, item: dict[str, Any]) -> tuple[list[int], ImageInputs]:
        if self.images is None or not self.chat_template:
            raise ValueError(f"item {item.get('id')!r} has images, but the model reads text "
                             "only (its folder has no image processor) or the chat template "
                             "is off; drop the items' images or serve a vision-language model")
        images = [self.images.decode_url(im, f"item {item.get('id')!r} images[{i}]")
                  if isinstance(im, str) else im.convert("RGB")
                  for i, im in enumerate(item["images"])]
        messages = build_messages(self.images.image_text * len(images) + item["question"],
                                  system_prompt=self.system_prompt, few_shot=self.few_shot)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        return self.images.encode(text, images)

    def plain_prompt(self, question: str) -> str:
        """The prompt without a chat template: parts joined by blank lines, the question
        last and verbatim (a base model continues it, e.g. a HumanEval function)."""
        parts = [self.system_prompt] if self.system_prompt else []
        parts += [f"{ex['question']}\n{ex['answer']}" for ex in self.few_shot]
        return "\n\n".join([*parts, question])

    async def run(self, engine: InferenceEngine, item: dict[str, Any]) -> list[Trajectory]:
        """One trajectory per sample; samples are generated and scored concurrently."""
        prompt_ids, images = self.prompt(item)
        # Unique per call: the same item seen again (next epoch) is a new group.
        group_id = f"{item['id']}@{uuid.uuid4().hex[:12]}"
        return await gather_or_cancel(*(
            self._sample(engine, item, prompt_ids, group_id, index, images)
            for index in range(self.gconfig.n_samples)
        ))

    async def _sample(self, engine: InferenceEngine, item: dict[str, Any], prompt_ids: list[int],
                      group_id: str, index: int, images: ImageInputs | None = None) -> Trajectory:
        """Generate one answer, then score it (scoring overlaps the group's other generations)."""
        t0 = time.perf_counter()
        sampling = self.sampling
        if item.get(SAMPLING_SEED_KEY) is not None:  # the rollout seeds each item's samples
            sampling = dataclasses.replace(sampling, seed=mix_seed(item[SAMPLING_SEED_KEY], index))
        resp = await engine.agenerate(GenerationRequest(input_ids=list(prompt_ids),
                                                        sampling=sampling, images=images))
        t1 = time.perf_counter()
        completion = self.tokenizer.decode(resp.output_ids, skip_special_tokens=True)
        reward, info = 0.0, None
        if self.reward is not None:
            reward, info = await self.reward.score_with_info(completion, item)
        t2 = time.perf_counter()
        meta = self._meta(item, resp, completion, index, gen_s=t1 - t0, reward_s=t2 - t1)
        if info is not None:  # e.g. the code reward's sandbox limits and isolation
            meta["reward_info"] = info
        return Trajectory.from_response(resp, reward=reward, group_id=group_id, meta=meta,
                                        images=images)

    def _meta(self, item: dict[str, Any], resp: GenerationResponse, completion: str, index: int,
              *, gen_s: float, reward_s: float) -> dict[str, Any]:
        return {
            "task_id": item["id"],
            "task": item.get("task", ""),
            "question": item["question"],
            "sample_index": index,
            "completion": completion,
            "gold_answer": item.get("answer"),
            "reward_fn": None if self.reward is None else self.reward.name,
            "gen_s": gen_s,
            "reward_s": reward_s,
            "engine_latency_s": resp.latency_s,
        }
