"""Reward-model training (`asyncrl rm`, `python -m asyncrl.trainers.rm`): Bradley-Terry.

A compact offline loop: epochs over (chosen, rejected) pairs reshuffled from (seed, epoch),
`train_dataset.batch_size` pairs per optimiser step, held-out loss and accuracy before,
every `evaluator.freq_*` and after training, stats.jsonl / TensorBoard, and the final model
as an HF folder `checkpoints/step<N>/` (a one-label sequence classifier). It is written to
fold into the shared offline loop of the SFT/DPO trainers once both are in.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from asyncrl.algorithms.rm import bradley_terry_loss, make_bradley_terry_loss_fn
from asyncrl.config import ConfigError, load_config, to_yaml
from asyncrl.config.rm import RMConfig
from asyncrl.data.preference import Pair, collate_pairs, load_preference_pairs
from asyncrl.models.hub import resolve_model_path
from asyncrl.observe import StatsLogger, StepTimer
from asyncrl.trainers.paths import RunPaths, setup_logging
from asyncrl.trainers.periodic import Periodic
from asyncrl.training.reward import FSDPRewardEngine

logger = logging.getLogger(__name__)


def epoch_batches(n: int, batch_size: int, *, shuffle: bool, seed: int) -> Iterator[list[int]]:
    """Endless batches of indices into `n` pairs; each epoch is one pass, reshuffled."""
    epoch = 0
    while True:
        order = list(range(n))
        if shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        for start in range(0, n, batch_size):
            yield order[start:start + batch_size]
        epoch += 1


@torch.no_grad()
def evaluate(engine: FSDPRewardEngine, pairs: list[Pair], *, batch_size: int,
             pad_token_id: int) -> dict[str, float]:
    """Bradley-Terry loss, accuracy and margin over `pairs`, no gradient."""
    chosen, rejected = [], []
    for start in range(0, len(pairs), batch_size):
        rewards = engine.compute_rewards(collate_pairs(pairs[start:start + batch_size],
                                                       pad_token_id))
        chosen.append(rewards[0::2])
        rejected.append(rewards[1::2])
    loss, stats = bradley_terry_loss(torch.cat(chosen), torch.cat(rejected), n_pairs=len(pairs))
    return {"loss": float(loss), **stats}


def train(cfg: RMConfig) -> dict[str, Any]:
    """Train a reward model as `cfg` says; the summary has held-out figures and the model dir."""
    from transformers import AutoTokenizer

    paths = RunPaths.from_config(cfg)
    setup_logging(paths.root)
    (paths.root / "config.yaml").write_text(to_yaml(cfg))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.tokenizer_path))
    train_pairs = load_preference_pairs(cfg.train_dataset, tokenizer)
    valid_pairs = (load_preference_pairs(cfg.valid_dataset, tokenizer)
                   if cfg.valid_dataset else [])
    steps_per_epoch = math.ceil(len(train_pairs) / cfg.train_dataset.batch_size)
    total = min(cfg.total_train_epochs * steps_per_epoch, cfg.total_train_steps or 10**12)
    threads = torch.get_num_threads()
    if cfg.scheduler.trainer_threads:
        torch.set_num_threads(cfg.scheduler.trainer_threads)
    engine = FSDPRewardEngine(cfg.model, total_steps=total, seed=cfg.seed)
    stats = StatsLogger(paths.root, cfg.stats_logger)
    summary: dict[str, Any] = {"run_dir": str(paths.root), "stats": str(stats.path)}
    try:
        engine.initialize()
        _loop(cfg, engine, stats, train_pairs, valid_pairs, tokenizer.pad_token_id or 0,
              steps_per_epoch, total, summary)
        model_dir = paths.checkpoints / f"step{total}"
        engine.save_hf(str(model_dir))
        summary["model_dir"] = str(model_dir)
    finally:
        stats.close()
        engine.destroy()
        torch.set_num_threads(threads)
    return summary


def _loop(cfg: RMConfig, engine: FSDPRewardEngine, stats: StatsLogger, train_pairs: list[Pair],
          valid_pairs: list[Pair], pad: int, steps_per_epoch: int, total: int,
          summary: dict[str, Any]) -> None:
    """Evaluate, `total` optimiser steps with periodic evaluation, evaluate again."""
    eval_batch = (cfg.valid_dataset or cfg.train_dataset).batch_size

    def eval_(step: int, name: str) -> None:
        result = evaluate(engine, valid_pairs, batch_size=eval_batch, pad_token_id=pad)
        stats.log(step, {f"eval/{k}": v for k, v in result.items()}, kind="eval")
        summary[name] = result
        logger.info("%s (step %d, %d held-out pairs): loss %.4f, accuracy %.4f", name, step,
                    len(valid_pairs), result["loss"], result["accuracy"])

    loss_fn = make_bradley_terry_loss_fn()
    evaluator = Periodic(cfg.evaluator, steps_per_epoch)
    if valid_pairs and cfg.evaluator.before_training:
        eval_(0, "eval_before")
    batches = epoch_batches(len(train_pairs), cfg.train_dataset.batch_size,
                            shuffle=cfg.train_dataset.shuffle, seed=cfg.seed)
    for step in range(1, total + 1):
        timer = StepTimer()
        batch = collate_pairs([train_pairs[i] for i in next(batches)], pad)
        with timer("train_s"):
            step_stats = engine.train_batch(batch, loss_fn)
        stats.log(step, {f"train/{k}": v for k, v in step_stats.items()}
                  | {"train/epoch": (step - 1) // steps_per_epoch, **timer.stats()})
        if valid_pairs and evaluator.due(step, time.monotonic()) and step < total:
            eval_(step, f"eval_step{step}")
    if valid_pairs and cfg.evaluator.after_training:
        eval_(total, "eval_after")


def main(argv: list[str] | None = None) -> int:
    """`python -m asyncrl.trainers.rm --config rm.yaml key=value ...`."""
    parser = argparse.ArgumentParser(prog="asyncrl rm", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="YAML config file (else defaults)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model.path=x")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides, schema=RMConfig)
    except ConfigError as err:
        print(f"asyncrl rm: config error: {err}", file=sys.stderr)
        return 2
    summary = train(cfg)
    for key in ("run_dir", "model_dir"):
        print(f"{key:10s}: {summary[key]}")
    for name in ("eval_before", "eval_after"):
        if name in summary:
            print(f"{name}: loss {summary[name]['loss']:.4f}, "
                  f"accuracy {summary[name]['accuracy']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
