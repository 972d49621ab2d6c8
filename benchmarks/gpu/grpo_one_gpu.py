"""Async GRPO with the trainer and our engine's server side by side on one device.

    python benchmarks/gpu/grpo_one_gpu.py --model /path/to/hf/folder --sync ipc disk
    python benchmarks/gpu/grpo_one_gpu.py --device cpu --model /path/to/tiny --steps 2

`run(device, model_dir, out_dir, steps, sync)` runs `steps` steps of the real RL loop
(controller/rl.py) with `allocation_mode=local:d1|fsdp:d1`: on "cuda" one GPU holds the
inline trainer and the server (each with its share of memory, rollout.gpu_memory_fraction),
weights moved by CUDA IPC (`sync="ipc"`) or through versioned folders (`"disk"`); on "cpu"
both share the cores, and only "disk" exists (a CPU has no CUDA IPC: a config error).

It returns one row: steps done, seconds per step (median), publish seconds (median), and the
largest |trainer log-prob - server log-prob| at equal weights: after the last step's publish
(servers and trainer both at the final version) the server samples the last batch's prompts
again and the trainer recomputes the log-probs of those tokens. (With
rollout.max_head_offpolicyness=1 the last batch's own tokens come mostly from the version
before the trainer's, whose weights are gone by then.) Both sides compute in bf16.

The reward (`text_hash_reward`) differs between almost any two completions, so the weights
change every step even for a random-weight model, and a publish that did not land would
show as a gap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from asyncrl.api import Batch, GenerationRequest, Trajectory
from asyncrl.config import load_config, to_yaml
from asyncrl.controller.launch import launch
from asyncrl.controller.rl import RLTrainer
from asyncrl.controller.specs import run_paths
from asyncrl.launch import make_scheduler
from asyncrl.observe import read_stats
from asyncrl.observe.paths import setup_logging

HERE = Path(__file__).resolve().parent

# Per device: the run's shape (a tiny model on the CPU; a real one on a GPU).
SHAPES = {
    "cpu": ["cluster.n_gpus_per_node=0", "scheduler.inference_threads=1",
            "scheduler.trainer_threads=1", "gconfig.n_samples=2", "gconfig.max_new_tokens=12",
            "train_dataset.batch_size=2", "rollout.consumer_batch_size=2",
            "local_engine.max_batch_size=16", "local_engine.max_seq_len=256"],
    "cuda": ["cluster.n_gpus_per_node=1", "rollout.gpu_memory_fraction=0.4",
             "gconfig.n_samples=8", "gconfig.max_new_tokens=128", "train_dataset.batch_size=8",
             "rollout.consumer_batch_size=8", "local_engine.max_batch_size=64",
             "local_engine.max_seq_len=1024"],
}


def text_hash_reward(completion: str, item: dict) -> float:
    """A deterministic reward in [0, 1) that differs between almost any two completions."""
    return (zlib.crc32(completion.encode()) % 1000) / 1000


def addition_items(size: int, seed: int) -> list[dict]:
    """Two-digit additions (no data files or task packages on the machine that runs this)."""
    rng = random.Random(seed)
    items = []
    for i in range(size):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        items.append({"id": f"add-{i}", "question": f"What is {a} + {b}?", "answer": str(a + b)})
    return items


class _GapTrainer(RLTrainer):
    """The RL loop, then the trainer's recomputation of tokens the servers sample with the
    weights of its last publish."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.last_batch: Batch | None = None
        self.gap: dict[str, Any] = {}

    def _train_step(self, batch: Batch) -> dict[str, float]:
        self.last_batch = batch
        return super()._train_step(batch)

    def train(self) -> dict[str, Any]:
        summary = super().train()  # returns with every server holding the final version
        if self.last_batch is not None:
            self.gap = self.logprob_gap(self.last_batch)
        return summary

    def logprob_gap(self, batch: Batch) -> dict[str, Any]:
        """Max |trainer - server| log-prob of tokens sampled now for `batch`'s prompts."""
        prompts = [t.input_ids[:t.loss_mask.index(1)] for t in batch if 1 in t.loss_mask]

        async def sample() -> list[Any]:
            return await asyncio.gather(*(self.engine.agenerate(GenerationRequest(
                input_ids=p, sampling=self.workflow.sampling)) for p in prompts))

        responses = self.rollout.run_coroutine(sample())
        tb = Batch([Trajectory.from_response(r, reward=0.0, group_id=str(i))
                    for i, r in enumerate(responses)]).to_tensors(self.tokenizer.pad_token_id or 0)
        same = tb.loss_mask.bool() & (tb.versions == self.versions.version)
        n = int(same.sum())
        mine = self.trainer.compute_logprobs(tb)
        gap = float((mine[same] - tb.behavior_logprobs[same]).abs().max()) if n else None
        return {"logprob_gap_max": gap, "logprob_gap_tokens": n,
                "logprob_gap_version": self.versions.version}


def _config(device: str, model_dir: str, out_dir: str, steps: int, sync: str,
            overrides: Sequence[str]) -> Any:
    if device not in SHAPES:
        raise ValueError(f"device must be one of {sorted(SHAPES)}, got {device!r}")
    if sync not in ("ipc", "disk"):
        raise ValueError(f"sync must be 'ipc' or 'disk', got {sync!r}")
    if str(HERE) not in sys.path:  # the reward, by module name (also in its workers)
        sys.path.insert(0, str(HERE))
    return load_config(None, [
        "experiment_name=grpo_one_gpu", f"trial_name={device}-{sync}-{time.time_ns()}",
        f"cluster.fileroot={out_dir}", f"actor.path={model_dir}", "seed=1",
        "allocation_mode=local:d1|fsdp:d1", f"actor.weight_update_mode={sync}",
        "actor.dtype=bfloat16", "local_engine.dtype=bfloat16", "actor.optimizer.lr=1e-4",
        "gconfig.temperature=1.0", "actor.temperature=1.0",
        "train_dataset.path=python:grpo_one_gpu:addition_items", "train_dataset.size=512",
        "rollout.max_head_offpolicyness=1", f"total_train_steps={steps}",
        "workflow.reward_fn=grpo_one_gpu:text_hash_reward",
        "stats_logger.progress_bar=false", "stats_logger.plot=false",
        "stats_logger.tensorboard=false", "evaluator.before_training=false",
        "evaluator.after_training=false", *SHAPES[device], *overrides])


def run(device: str, model_dir: str, out_dir: str, steps: int, sync: str, *,
        overrides: Sequence[str] = ()) -> dict[str, Any]:
    """`steps` steps of async GRPO on `device` ("cuda" or "cpu") with `sync` ("ipc" or
    "disk"); the row described in the module doc. `overrides`: more config keys."""
    cfg = _config(device, model_dir, out_dir, steps, sync, overrides)
    paths = run_paths(cfg)
    setup_logging(paths.root)
    (paths.root / "config.yaml").write_text(to_yaml(cfg))
    t0 = time.monotonic()
    with make_scheduler(cfg.scheduler, cfg.cluster, paths.root) as scheduler:
        services = launch(cfg, paths, scheduler)
        trainer = _GapTrainer(cfg, paths, services.inference, services.trainer,
                              scheduler=scheduler, inference_key=services.inference_key,
                              cores_shared=services.cores_shared)
        services.ready()
        try:
            trainer.train()
        finally:
            trainer.close()
    wall = time.monotonic() - t0
    rows = [r for r in read_stats(paths.root / "stats.jsonl") if r["kind"] == "train"]

    def median(key: str) -> float | None:
        return statistics.median(r[key] for r in rows) if rows else None

    return {"device": device, "sync": sync, "steps": len(rows), "step_s": median("perf/step_s"),
            "publish_s": median("perf/publish_s"), **trainer.gap, "wall_s": wall,
            "run_dir": str(paths.root)}


def main(argv: Sequence[str] | None = None) -> None:
    """Run each --sync in turn; one JSON row each (also appended to <out>/grpo_one_gpu.jsonl)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=sorted(SHAPES))
    p.add_argument("--model", required=True, help="a local HF folder (nothing is downloaded)")
    p.add_argument("--out", default="runs/grpo_one_gpu", help="the runs and the table go here")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--sync", nargs="+", default=None, choices=["ipc", "disk"],
                   help="default: ipc and disk on cuda, disk on cpu")
    p.add_argument("overrides", nargs="*", help="more config keys, key=value")
    args = p.parse_args(argv)
    syncs = args.sync or (["ipc", "disk"] if args.device == "cuda" else ["disk"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for sync in syncs:
        row = run(args.device, args.model, str(out), args.steps, sync,
                  overrides=args.overrides)
        print(json.dumps(row), flush=True)
        with open(out / "grpo_one_gpu.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
