"""Held-out evaluation: run a workflow over items, score each item's samples.

The one evaluator of the project: the trainer's evaluation during a run (greedy, one sample,
`eval/reward`) and `asyncrl eval` (greedy, or n samples per item scored as pass@k, maj@k and
mean@k) both call `evaluate`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.api import InferenceEngine, Trajectory, Workflow
from asyncrl.observe.stats import TASK_PREFIX
from asyncrl.rewards.estimators import maj_at_k, mean_at_k, pass_at_k

logger = logging.getLogger(__name__)

AnswerFn = Callable[[str], "str | None"]


@dataclass
class ItemScore:
    """One item's samples: rewards, extracted answers (None: none found), and its scores."""

    item: dict[str, Any]
    trajectories: list[Trajectory]
    rewards: list[float]
    answers: list[str | None]
    scores: dict[str, float] = field(default_factory=dict)

    def record(self, decode: Callable[[list[int]], str] | None = None) -> dict[str, Any]:
        """A JSON line: the id, task and question (and with `decode` the prompt as the model
        saw it), the gold answer, the scores, and each sample's text, reward and answer."""
        prompt = None
        if decode is not None and self.trajectories:
            first = self.trajectories[0]
            prompt = decode(first.input_ids[:first.loss_mask.index(1)] if 1 in first.loss_mask
                            else first.input_ids)
        return {
            "id": self.item.get("id"), "task": self.item.get("task"),
            "question": self.item.get("question"), "prompt": prompt,
            "gold": self.item.get("answer"), "scores": self.scores,
            "samples": [{"completion": t.meta.get("completion"), "reward": r, "answer": a,
                         "output_tokens": t.n_output_tokens, "stop_reason": t.stop_reason.value,
                         **({"reward_info": t.meta["reward_info"]}
                            if "reward_info" in t.meta else {})}
                        for t, r, a in zip(self.trajectories, self.rewards, self.answers)],
        }


@dataclass
class EvalResult:
    """The stats (`eval/...` keys), every trajectory, and each item's scores."""

    stats: dict[str, float]
    trajectories: list[Trajectory]
    items: list[ItemScore]


async def evaluate(engine: InferenceEngine, workflow: Workflow, items: list[dict[str, Any]], *,
                   concurrency: int, ks: Sequence[int] = (1,),
                   extract_answer: AnswerFn | None = None, pass_threshold: float = 1.0,
                   on_item: Callable[[ItemScore | None], None] | None = None) -> EvalResult:
    """Score `workflow`'s samples of each of `items`.

    Stats: `eval/reward` (the mean reward of all scored samples), `eval/n` (items scored),
    `eval/failed`, `eval/output_tokens_mean`, and for each k of `ks`: `eval/pass@k` (a sample
    is correct when its reward >= `pass_threshold`), `eval/mean@k`, and `eval/maj@k` when
    `extract_answer` reads answers from completions. When the items hold more than one
    `task`, each task's reward, item count and scores as well (`eval/task/<task>/reward`).
    Each k must be at most the samples per item. Failed items are counted, logged with their
    cause and left out of every mean.
    `on_item` is called as each item ends (None for a failed one).
    """
    sem = asyncio.Semaphore(concurrency)

    async def one(item: dict[str, Any]) -> ItemScore:
        async with sem:
            trajectories = await workflow.run(engine, item)
        score = _score(item, trajectories, ks, extract_answer, pass_threshold)
        if on_item is not None:
            on_item(score)
        return score

    async def guarded(item: dict[str, Any]) -> ItemScore:
        try:
            return await one(item)
        except Exception:
            if on_item is not None:
                on_item(None)
            raise

    results = await asyncio.gather(*(guarded(item) for item in items), return_exceptions=True)
    scored, trajectories, failures = [], [], 0
    for item, result in zip(items, results):
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):
                raise result  # cancellation, KeyboardInterrupt: not an item's failure
            failures += 1
            logger.error("evaluation of item %s failed: %r", item.get("id", "?"), result)
        elif result.trajectories:
            scored.append(result)
            trajectories.extend(result.trajectories)
    if not scored:
        raise RuntimeError(f"evaluation failed on all {len(items)} items; see the log for causes")
    return EvalResult(_stats(scored, trajectories, failures, ks), trajectories, scored)


def _score(item: dict[str, Any], trajectories: list[Trajectory], ks: Sequence[int],
           extract_answer: AnswerFn | None, pass_threshold: float) -> ItemScore:
    samples = one_per_session(trajectories or [])
    rewards = [t.reward for t in samples]
    answers = [extract_answer(t.meta["completion"])
               if extract_answer is not None and "completion" in t.meta else None
               for t in samples]
    score = ItemScore(item, list(trajectories or []), rewards, answers)
    if not samples:
        return score
    n, c = len(samples), sum(r >= pass_threshold for r in rewards)
    for k in ks:
        if k > n:
            raise ValueError(f"k={k} needs at least {k} samples per item, but item "
                             f"{item.get('id', '?')!r} has {n}; sample n >= max(k)")
        score.scores[f"pass@{k}"] = pass_at_k(n, c, k)
        score.scores[f"mean@{k}"] = mean_at_k(rewards, k)
        if extract_answer is not None:
            score.scores[f"maj@{k}"] = maj_at_k(answers, rewards, k)
    return score


def _stats(scored: list[ItemScore], trajectories: list[Trajectory], failures: int,
           ks: Sequence[int]) -> dict[str, float]:
    n_samples = sum(len(s.rewards) for s in scored)
    # the weight versions the answers were generated with (one, when the weights held still)
    versions = [v for t in trajectories for v in t.output_versions] or [-1]
    stats = {f"eval/{name}": value for name, value in _means(scored).items()} | {
        "eval/failed": float(failures),
        "eval/output_tokens_mean": sum(t.n_output_tokens for t in trajectories) / n_samples,
        "eval/version_min": float(min(versions)),
        "eval/version_max": float(max(versions)),
    }
    tasks: dict[str, list[ItemScore]] = {}
    for s in scored:
        tasks.setdefault(str(s.item.get("task", "")), []).append(s)
    if len(tasks) > 1:  # a mixed set: each task's means as well
        for task, group in sorted(tasks.items()):
            stats |= {f"{TASK_PREFIX}{task}/{name}": value
                      for name, value in _means(group).items()}
    return stats


def _means(scored: list[ItemScore]) -> dict[str, float]:
    """The mean reward of all samples, the item count, and each score's mean over items."""
    samples = [r for s in scored for r in s.rewards]
    return {"reward": sum(samples) / len(samples), "n": float(len(scored))} | {
        name: sum(s.scores[name] for s in scored) / len(scored) for name in scored[0].scores}



def one_per_session(trajectories: list[Trajectory]) -> list[Trajectory]:
    """Each agent session once: its first trajectory, whose reward is the return from its
    first turn (a session whose turns did not merge exports several). Others stay as they are."""
    seen: set[str] = set()
    out = []
    for t in trajectories:
        session = t.meta.get("session_id")
        if session is None or session not in seen:
            out.append(t)
            if session is not None:
                seen.add(session)
    return out
