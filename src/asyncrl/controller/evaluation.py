"""`asyncrl eval`: a checkpoint on a dataset with the task's reward, greedy or pass@k.

It builds the trainer's RLVR workflow (prompt, reward) with the sampling asked for, runs
the one evaluator (`rollout/evaluate.py`, also the trainer's in-run evaluation) on a
server it starts (ours, vLLM or SGLang, as `asyncrl serve` does) or on running servers
(`base_urls`), and writes under `out`:

    items.jsonl    per item: question, gold answer, scores, each sample's text, reward, answer
    summary.json   the spec and the `eval/...` means over items
    pass_at_k.png  pass@k, maj@k and mean@k against k
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.config.schema import DatasetConfig, GenerationConfig, LocalEngineConfig
from asyncrl.controller.rollout.evaluate import EvalResult, ItemScore, evaluate
from asyncrl.controller.workflows import RLVRWorkflow
from asyncrl.data import load_datasets
from asyncrl.launch.commands import BACKENDS
from asyncrl.observe import ProgressBar
from asyncrl.observe.stats import by_task
from asyncrl.openai.images import load_image_prompts
from asyncrl.rewards.registry import BUILTIN_ANSWER_FNS, resolve_answer_fn, resolve_reward_fn
from asyncrl.rewards.runner import RewardRunner

# KV-cache slots of the server started here: the samples in flight, up to this many.
MAX_SERVER_BATCH = 64


class EvalSpecError(ValueError):
    """An `asyncrl eval` option that cannot work; the message names it and what to change."""


@dataclass(kw_only=True)
class EvalSpec:
    """What `asyncrl eval` evaluates and how."""

    # HF folder, a run's published version folder, LoRA adapter folder, or named model. With
    # base_urls: the tokenizer of the model those servers serve.
    model: str
    dataset: DatasetConfig
    # more sets, scored with `dataset` as one (and task by task where their tasks differ)
    extra_datasets: list[DatasetConfig] = field(default_factory=list)
    out: Path
    base: str | None = None  # an adapter's base model (default: the adapter's own record)
    base_urls: list[str] = field(default_factory=list)  # running servers; none: start one
    backend: str = "local"
    reward_fn: str = "gsm8k"
    # What maj@k votes over: a built-in reward's extractor (default for gsm8k and
    # reasoning_gym) or "package.module:function"; None with another reward: no maj@k.
    answer_fn: str | None = None
    system_prompt: str | None = None
    few_shot: list[dict[str, str]] = field(default_factory=list)
    chat_template: bool = True
    n: int = 1  # samples per item
    ks: list[int] = field(default_factory=lambda: [1])
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)  # stop strings, as gconfig.stop
    concurrency: int = 32
    limit: int | None = None  # the first `limit` items of each dataset
    pass_threshold: float = 1.0  # a sample with reward >= this counts as correct
    reward_timeout: float = 30.0
    seed: int = 0
    # the server started here
    device: str = "cpu"
    dtype: str = "bfloat16"
    max_seq_len: int = 2048
    threads: int = 0  # 0: every core
    progress: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise EvalSpecError(f"--backend {self.backend!r} is not one of {list(BACKENDS)}")
        if self.n < 1:
            raise EvalSpecError(f"--n {self.n}: draw at least one sample per item")
        if not self.ks or min(self.ks) < 1:
            raise EvalSpecError(f"--k {self.ks}: give positive integers, e.g. --k 1,4,8")
        if max(self.ks) > self.n:
            raise EvalSpecError(f"--k {','.join(map(str, self.ks))} needs at least "
                                f"{max(self.ks)} samples per item; set --n >= {max(self.ks)}")
        if self.temperature == 0 and self.n > 1:
            raise EvalSpecError(f"--n {self.n} greedy samples would all be the same answer; "
                                "give --temperature > 0 to sample, or --n 1")
        if self.limit is not None and self.limit < 1:
            raise EvalSpecError(f"--limit {self.limit}: evaluate at least one item")
        if self.concurrency < 1:
            raise EvalSpecError(f"--concurrency {self.concurrency} must be >= 1")

    def gconfig(self) -> GenerationConfig:
        return GenerationConfig(n_samples=self.n, max_new_tokens=self.max_tokens,
                                greedy=self.temperature == 0, temperature=self.temperature,
                                top_p=self.top_p, stop=list(self.stop))

    def answer_function(self) -> Any:
        name = self.answer_fn or (self.reward_fn if self.reward_fn in BUILTIN_ANSWER_FNS
                                  else None)
        return resolve_answer_fn(name) if name else None


def run(spec: EvalSpec) -> dict[str, Any]:
    """Evaluate as `spec` says, write its outputs, print the table; the summary."""
    from transformers import AutoTokenizer

    spec.out.mkdir(parents=True, exist_ok=True)
    items = load_datasets([spec.dataset, *spec.extra_datasets], limit=spec.limit)
    with _served_model(spec) as (model_path, urls):
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        reward = RewardRunner(resolve_reward_fn(spec.reward_fn), spec.reward_timeout)
        try:
            workflow = RLVRWorkflow(tokenizer, spec.gconfig(), reward,
                                    system_prompt=spec.system_prompt, few_shot=spec.few_shot,
                                    chat_template=spec.chat_template,
                                    images=load_image_prompts(model_path))
            result = asyncio.run(_evaluate(spec, urls, workflow, items))
        finally:
            reward.close()
    return write_outputs(spec, result, decode=tokenizer.decode)


async def _evaluate(spec: EvalSpec, urls: list[str], workflow: RLVRWorkflow,
                    items: list[dict[str, Any]]) -> EvalResult:
    from asyncrl.inference.client.backends import client_class

    engine = client_class(spec.backend)(urls)
    k = spec.ks[0]
    bar = ProgressBar(len(items), enabled=spec.progress, fields=[f"pass@{k}"], desc="eval",
                      unit="item")
    scores: list[float] = []

    def on_item(score: ItemScore | None) -> None:  # the running mean of pass@k, k the first
        if score is not None and score.scores:
            scores.append(score.scores[f"pass@{k}"])
        bar.update({f"pass@{k}": sum(scores) / len(scores) if scores else float("nan")})

    try:
        return await evaluate(engine, workflow, items, concurrency=spec.concurrency,
                              ks=spec.ks, extract_answer=spec.answer_function(),
                              pass_threshold=spec.pass_threshold, on_item=on_item)
    finally:
        bar.close()
        await engine.close()


@contextmanager
def _served_model(spec: EvalSpec) -> Iterator[tuple[str, list[str]]]:
    """(a local folder of the model, the server addresses): `base_urls`, or a server started
    here on the model (an adapter merged into its base first)."""
    from asyncrl.models.hub import resolve_model_path
    from asyncrl.models.lora import export_merged, is_adapter_folder

    scratch = tempfile.mkdtemp(prefix="asyncrl-eval-")
    try:
        path = resolve_model_path(spec.model)
        if is_adapter_folder(path):
            merged = os.path.join(scratch, "merged")
            export_merged(path, merged, base=spec.base)
            path = merged
        elif spec.base is not None:
            raise EvalSpecError(f"--base {spec.base!r} is for adapter folders, but {spec.model!r} "
                                "has no adapter_config.json; drop --base")
        if spec.base_urls:
            yield path, list(spec.base_urls)
            return
        from asyncrl.config.schema import SchedulerConfig
        from asyncrl.launch.local import LocalScheduler

        cores = len(os.sched_getaffinity(0))
        sched_cfg = SchedulerConfig(inference_threads=spec.threads or cores, trainer_threads=0)
        engine_cfg = LocalEngineConfig(dtype=spec.dtype, max_seq_len=spec.max_seq_len,
                                       max_batch_size=min(spec.concurrency * spec.n,
                                                          MAX_SERVER_BATCH))
        with LocalScheduler(sched_cfg, scratch) as scheduler:
            yield path, scheduler.launch_inference_servers(
                path, engine_cfg, n_servers=1, seed=spec.seed, backend=spec.backend,
                device=spec.device)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_outputs(spec: EvalSpec, result: EvalResult,
                  decode: Callable[[list[int]], str] | None = None) -> dict[str, Any]:
    """items.jsonl, summary.json and pass_at_k.png under `spec.out`; prints the table.
    `decode` (the tokenizer's) writes each item's prompt as the model saw it."""
    with open(spec.out / "items.jsonl", "w") as f:
        for score in result.items:
            f.write(json.dumps(score.record(decode)) + "\n")
    summary = {"spec": _jsonable(spec), "stats": result.stats,
               "items": str(spec.out / "items.jsonl")}
    summary["plot"] = str(plot_at_k(result.stats, spec.ks, spec.out / "pass_at_k.png",
                                    title=f"{spec.model} on " + ", ".join(
                                        d.path for d in [spec.dataset, *spec.extra_datasets])))
    (spec.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(table(result.stats, spec.ks))
    return summary


def table(stats: dict[str, float], ks: list[int]) -> str:
    """The scores as a text table, one row per k."""
    metrics = [m for m in ("pass", "maj", "mean") if f"eval/{m}@{ks[0]}" in stats]
    lines = [f"{'k':>4} " + " ".join(f"{m + '@k':>8}" for m in metrics)]
    for k in ks:
        lines.append(f"{k:>4} " + " ".join(f"{stats[f'eval/{m}@{k}']:>8.4f}" for m in metrics))
    lines.append(f"items {int(stats['eval/n'])}, failed {int(stats['eval/failed'])}, "
                 f"mean reward {stats['eval/reward']:.4f}, "
                 f"mean output tokens {stats['eval/output_tokens_mean']:.1f}")
    for task, task_stats in by_task(stats).items():
        lines.append(f"  {task}: items {int(task_stats['n'])}, mean reward "
                     f"{task_stats['reward']:.4f}"
                     + "".join(f", {m}@{k} {task_stats[f'{m}@{k}']:.4f}"
                               for k in ks for m in metrics))
    return "\n".join(lines)


def plot_at_k(stats: dict[str, float], ks: list[int], out_path: Path, *, title: str) -> Path:
    """pass@k, maj@k and mean@k against k (log-2 axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for metric, style in (("pass", "o-"), ("maj", "s--"), ("mean", "^:")):
        if f"eval/{metric}@{ks[0]}" in stats:
            ax.plot(ks, [stats[f"eval/{metric}@{k}"] for k in ks], style, label=f"{metric}@k")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("k (samples per item)")
    ax.set_ylabel("score")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


def _jsonable(spec: EvalSpec) -> dict[str, Any]:
    out = dataclasses.asdict(spec)
    out["out"] = str(spec.out)
    return out
