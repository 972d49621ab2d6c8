"""The offline training loop shared by SFT, DPO and reward-model training: fixed rows, no rollouts.

Epochs over a list of examples (reshuffled each epoch from (seed, epoch)), `batch_size`
examples per optimiser step, held-out evaluation before training, every N steps and after,
stats.jsonl and a progress bar like the RL trainer, and the final model as an HF folder.
A trainer tokenises its examples, picks its loss (and its engine: the policy's
`FSDPTrainEngine` by default, `FSDPRewardEngine` for reward models) and calls
`OfflineTrainer.fit`.

Several ranks (torchrun's, or allocation_mode's, which `asyncrl sft|dpo|rm` starts: see
`offline_launch.py`) each read the whole batch; the engine plans its micro-batches across
the ranks and sums their gradients, so a step is the one-rank step. Rank 0 writes the record.

Evaluation runs the same loss function on the engine's no-grad outputs, the whole
held-out set treated as one batch (normalisers over all of it), so `eval/loss` is the
held-out value of exactly the training objective, and the loss's stats its held-out means.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.api.protocols import LossFn
from asyncrl.config import ConfigError, to_yaml
from asyncrl.config.offline import OfflineConfig
from asyncrl.config.schema import StatsLoggerConfig
from asyncrl.data.offline import Example, collate
from asyncrl.models.hub import resolve_model_path
from asyncrl.observe import ProgressBar, StatsLogger, StepTimer
from asyncrl.observe.paths import RunPaths, setup_logging
from asyncrl.observe.periodic import Periodic
from asyncrl.trainer import FSDPTrainEngine
from asyncrl.trainer.dist import init_process_group
from asyncrl.trainer.engine import reduce_stats

logger = logging.getLogger(__name__)


def epoch_batches(n: int, batch_size: int, *, shuffle: bool, seed: int) -> Iterator[list[int]]:
    """Endless batches of indices into `n` examples; each epoch is one pass, reshuffled."""
    epoch = 0
    while True:
        order = list(range(n))
        if shuffle:  # a private generator keyed by (seed, epoch), as in ItemStream
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        for start in range(0, n, batch_size):
            yield order[start:start + batch_size]
        epoch += 1


def chunks(examples: list[Example], size: int) -> Iterator[list[Example]]:
    """`examples` in consecutive groups of at most `size`."""
    for start in range(0, len(examples), size):
        yield examples[start:start + size]


def evaluate(engine: Any, examples: list[Example], loss_fn: LossFn, *, batch_size: int,
             pad_token_id: int) -> dict[str, float]:
    """The loss and its stats over `examples` as one batch, from no-grad forwards."""
    rows = [r for ex in examples for r in ex]
    n_tokens = sum(sum(1 for m in r.loss_mask if m) for r in rows)
    per_chunk = []
    for chunk in chunks(examples, batch_size):
        batch = collate([r for ex in chunk for r in ex], pad_token_id)
        loss, stats = loss_fn(engine.compute_outputs(batch), batch, n_tokens=n_tokens,
                              n_seqs=len(rows))
        per_chunk.append({"loss": float(loss), **stats})
    return reduce_stats(per_chunk)


class OfflineTrainer:
    """Run directory, tokenizer and process group of an offline run; `fit` is the loop."""

    def __init__(self, cfg: OfflineConfig) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        # Engines come and go (DPO's reference, then the policy): the group outlives them.
        self._owns_group = init_process_group(cfg.cluster.device)
        self._check_world_size()
        # Under torchrun or allocation_mode's ranks, only rank 0 writes the record.
        self.is_main = dist.get_rank() == 0
        self.paths = RunPaths.from_names(cfg.cluster.fileroot, cfg.experiment_name,
                                         cfg.trial_name)
        setup_logging(self.paths.root)
        if self.is_main:
            (self.paths.root / "config.yaml").write_text(to_yaml(cfg))
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.tokenizer_path))
        self.pad_token_id = self.tokenizer.pad_token_id or 0
        self._threads = torch.get_num_threads()
        if cfg.scheduler.trainer_threads:
            torch.set_num_threads(cfg.scheduler.trainer_threads)
        self.summary: dict[str, Any] = {"run_dir": str(self.paths.root)}

    def _check_world_size(self) -> None:
        """A set allocation_mode and the process group agree on the number of ranks."""
        world, want = dist.get_world_size(), self.cfg.trainer_world_size
        if self.cfg.allocation_mode is None or world == want:
            return
        if self._owns_group:
            dist.destroy_process_group()
        raise ConfigError(
            f"allocation_mode={self.cfg.allocation_mode!r} asks for {want} trainer ranks but "
            f"this process group has {world}; start the run with `asyncrl sft|dpo|rm` (which "
            f"starts the ranks itself), or set allocation_mode=fsdp:d{world} (or drop it) "
            f"to match torchrun's --nproc-per-node")

    def __enter__(self) -> OfflineTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Leave the process group (if this trainer made it) and restore the thread count."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False
        torch.set_num_threads(self._threads)

    def fit(self, train: list[Example], valid: list[Example], loss_fn: LossFn, *,
            show: Sequence[str] = ("train/loss",),
            engine_cls: Callable[..., FSDPTrainEngine] = FSDPTrainEngine) -> dict[str, Any]:
        """Train on `train`, evaluate on `valid`, save; returns the summary.

        `show`: the progress bar's stats. `engine_cls`: the engine class (or a callable
        taking its arguments) built on `model`'s section; its outputs are what `loss_fn` reads.
        """
        cfg = self.cfg
        self._check_batches_split(train, cfg.train_dataset.batch_size, "train_dataset")
        self._check_batches_split(valid, self._eval_batch_size(), "valid_dataset")
        steps_per_epoch = math.ceil(len(train) / cfg.train_dataset.batch_size)
        total = min(cfg.total_train_epochs * steps_per_epoch, cfg.total_train_steps or 10**12)
        engine = engine_cls(cfg.model.engine_spec(device=cfg.cluster.device), total_steps=total,
                            seed=cfg.seed)
        engine.initialize()
        log_cfg = cfg.stats_logger if self.is_main else StatsLoggerConfig(
            jsonl=False, tensorboard=False, progress_bar=False)
        stats = StatsLogger(self.paths.root, log_cfg, run_config=cfg)
        try:
            self._loop(engine, stats, train, valid, loss_fn, steps_per_epoch, total, show)
        finally:
            stats.close()
            engine.destroy()
        self.summary.update(steps=total, stats=str(stats.path))
        return self.summary

    def _loop(self, engine: FSDPTrainEngine, stats: StatsLogger, train: list[Example],
              valid: list[Example], loss_fn: LossFn, steps_per_epoch: int, total: int,
              show: Sequence[str]) -> None:
        """Evaluate, then `total` optimiser steps (with periodic eval and saves), then finish."""
        cfg = self.cfg
        saver, evaluator = Periodic(cfg.saver, steps_per_epoch), Periodic(cfg.evaluator,
                                                                          steps_per_epoch)

        def eval_(step: int, name: str) -> None:
            self._evaluate(engine, stats, valid, loss_fn, step, name)

        if valid and cfg.evaluator.before_training:
            eval_(0, "eval_before")
        batches = epoch_batches(len(train), cfg.train_dataset.batch_size,
                                shuffle=cfg.train_dataset.shuffle, seed=cfg.seed)
        bar = ProgressBar(total, enabled=cfg.stats_logger.progress_bar and self.is_main,
                          fields=show)
        for step in range(1, total + 1):
            timer = StepTimer()
            rows = [r for i in next(batches) for r in train[i]]
            with timer("train_s"):
                step_stats = engine.train_batch(collate(rows, self.pad_token_id), loss_fn)
            step_stats = {f"train/{k}": v for k, v in step_stats.items()}
            step_stats |= {"train/epoch": (step - 1) // steps_per_epoch, **timer.stats()}
            stats.log(step, step_stats)
            bar.update(step_stats)
            self.summary.setdefault("train_loss_first", step_stats["train/loss"])
            self.summary["train_loss_last"] = step_stats["train/loss"]
            now = time.monotonic()
            if saver.due(step, now) and step < total:
                engine.save_hf(str(self.paths.checkpoints / f"step{step}"))
            if valid and evaluator.due(step, now) and step < total:
                eval_(step, f"eval_step{step}")
        bar.close()
        if valid and cfg.evaluator.after_training:
            eval_(total, "eval_after")
        model_dir = self.paths.checkpoints / f"step{total}"
        engine.save_hf(str(model_dir))
        self.summary["model_dir"] = str(model_dir)

    def _evaluate(self, engine: FSDPTrainEngine, stats: StatsLogger, valid: list[Example],
                  loss_fn: LossFn, step: int, name: str) -> None:
        result = evaluate(engine, valid, loss_fn, batch_size=self._eval_batch_size(),
                          pad_token_id=self.pad_token_id)
        stats.log(step, {f"eval/{k}": v for k, v in result.items()}, kind="eval")
        self.summary[name] = result
        logger.info("%s (step %d, %d held-out examples): %s", name, step, len(valid),
                    ", ".join(f"{k}={v:.4f}" for k, v in result.items()))

    @staticmethod
    def _check_batches_split(examples: list[Example], batch_size: int, name: str) -> None:
        """Every batch, the last (smaller) one too, has an example for each rank.

        Checked before training: otherwise the run fails only at the end of an epoch.
        """
        world = dist.get_world_size()
        last = len(examples) % batch_size or batch_size
        if examples and min(last, len(examples)) < world:
            raise ConfigError(
                f"{name}: {len(examples)} examples in batches of {batch_size} leave a last "
                f"batch of {min(last, len(examples))}, fewer than the {world} ranks, and every "
                f"rank needs an example of each batch; change {name}.batch_size or "
                f"{name}.size")

    def _eval_batch_size(self) -> int:
        valid = self.cfg.valid_dataset
        return valid.batch_size if valid is not None else self.cfg.train_dataset.batch_size
