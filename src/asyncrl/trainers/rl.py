"""Asynchronous RL (the PPO family): the training loop.

The rollout thread generates continuously under the staleness bound; this loop takes a
batch, recomputes the proximal log-probs, computes advantages, takes an optimiser step,
publishes the new weights to the servers (which switch mid-generation) and logs.
`RLTrainer.train` is the whole loop; everything it calls is built in `__init__`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from asyncrl.algorithms import (
    compute_advantages_and_returns,
    make_ppo_loss_fn,
    mean_token_kl,
    with_distillation,
)
from asyncrl.algorithms.advantages import in_reward_kl_logprobs
from asyncrl.api import Batch
from asyncrl.config import ExperimentConfig, to_yaml
from asyncrl.data import ItemStream, filter_by_length, held_out, load_dataset
from asyncrl.inference.backends import client_class
from asyncrl.models.hub import resolve_model_path
from asyncrl.observe import ProgressBar, StatsLogger, StepTimer, plot_reward_curve, write_samples
from asyncrl.rollout import RolloutController, RolloutError, evaluate, make_episode_filter
from asyncrl.scheduler import LocalScheduler
from asyncrl.trainers import recover
from asyncrl.trainers.agents import AgentRuntime
from asyncrl.trainers.critic import Critic
from asyncrl.trainers.paths import RunPaths, setup_logging
from asyncrl.trainers.periodic import Periodic
from asyncrl.training import FSDPTrainEngine
from asyncrl.training.frozen import check_teacher_vocab, make_ref_engine, make_teacher_engine
from asyncrl.training.updates import train_epochs
from asyncrl.weights import WeightPublisher
from asyncrl.workflows import RLVRWorkflow

logger = logging.getLogger(__name__)


def train(cfg: ExperimentConfig) -> dict[str, Any]:
    """Run asynchronous RL as `cfg` says; returns the summary (evaluations, run dir)."""
    paths = RunPaths.from_config(cfg)
    setup_logging(paths.root)
    (paths.root / "config.yaml").write_text(to_yaml(cfg))
    with LocalScheduler(cfg.scheduler, paths.logs) as scheduler:
        _check_world_size(cfg)
        model_path = resolve_model_path(cfg.actor.path)
        addresses = scheduler.launch_inference_servers(
            model_path, cfg.local_engine, n_servers=cfg.rollout.n_servers, seed=cfg.seed,
            backend=cfg.rollout.backend, device="cuda" if cfg.cluster.n_gpus_per_node else "cpu",
            first_gpu=cfg.trainer_world_size, extra_args=cfg.rollout.server_args)
        scheduler.pin_trainer()
        trainer = RLTrainer(cfg, paths, addresses)
        try:
            return trainer.train()
        except RolloutError:
            scheduler.check_alive()  # a dead server explains it best, with its log's tail
            raise
        finally:
            trainer.close()


def _check_world_size(cfg: ExperimentConfig) -> None:
    """allocation_mode's fsdp:d<M> must be the world this process was launched in."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != cfg.trainer_world_size:
        raise ValueError(f"allocation_mode={cfg.allocation_mode!r} asks for "
                         f"{cfg.trainer_world_size} trainer ranks but this process runs in a "
                         f"world of {world}; launch with torchrun --nproc-per-node "
                         f"{cfg.trainer_world_size} or change allocation_mode")


class RLTrainer:
    def __init__(self, cfg: ExperimentConfig, paths: RunPaths, addresses: list[str]) -> None:
        from transformers import AutoTokenizer

        self.cfg, self.paths = cfg, paths
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.tokenizer_path))
        self.engine = client_class(cfg.rollout.backend)(
            addresses, request_timeout=cfg.rollout.request_timeout,
            request_retries=cfg.rollout.request_retries,
            update_weights_timeout=cfg.rollout.update_weights_timeout,
            health_check_interval=cfg.rollout.health_check_interval)
        self.agents = None  # workflow.type=agent: the proxy and the agent
        if cfg.workflow.type == "agent":
            self.agents = AgentRuntime(cfg, self.tokenizer, self.engine,
                                       version=lambda: self.rollout.version)
            self.workflow = self.agents.workflow
        else:
            self.workflow = RLVRWorkflow.from_config(self.tokenizer, cfg.gconfig, cfg.workflow)
        train_items, stream = self._train_items()
        B = cfg.rollout.consumer_batch_size
        steps_per_epoch = len(train_items) // B if stream is not None else cfg.total_train_steps
        if steps_per_epoch == 0:
            raise ValueError(f"train_dataset has {len(train_items)} items, fewer than one batch "
                             f"(rollout.consumer_batch_size={B})")
        self.steps_per_epoch = steps_per_epoch
        self.total_steps = min(cfg.total_train_epochs * steps_per_epoch,
                               cfg.total_train_steps or 10**12)
        self.rollout = RolloutController(
            self.engine, self.workflow, stream,
            consumer_batch_size=B, max_head_offpolicyness=cfg.rollout.max_head_offpolicyness,
            max_concurrent_rollouts=cfg.rollout.concurrency,
            max_failed_episodes=cfg.rollout.max_failed_episodes,
            should_accept=make_episode_filter(cfg.rollout.dynamic_sampling,
                                              cfg.rollout.dynamic_filter_fn))
        if self.agents is not None:
            self.agents.attach(self.rollout)
        self.valid_items = (held_out(load_dataset(cfg.valid_dataset), train_items)
                            if cfg.valid_dataset else [])
        self.eval_workflow = self.workflow.for_eval(cfg.evaluator.max_new_tokens)
        # The lr schedule counts optimiser steps: several per batch with minibatches or epochs.
        self.actor = FSDPTrainEngine(cfg.actor, seed=cfg.seed,
                                     total_steps=self.total_steps * cfg.actor.updates_per_batch)
        self.actor.initialize()
        self.ref = make_ref_engine(cfg)
        if self.ref is not None:
            self.ref.initialize()
        self.teacher = make_teacher_engine(cfg)
        if self.teacher is not None:
            self.teacher.initialize()
            check_teacher_vocab(self.tokenizer, self.teacher)
        self.critic = Critic.from_config(cfg, self.total_steps)  # None: no value model
        # One optimiser step per batch: the proximal log-probs come from the training forward.
        self.prox_in_loss = cfg.actor.recompute_logprob and cfg.actor.updates_per_batch == 1
        self.loss_fn = with_distillation(
            make_ppo_loss_fn(cfg.actor, prox_is_current=self.prox_in_loss), cfg.actor)
        self.publisher = WeightPublisher(paths.weights, self.engine,
                                         dtype=cfg.local_engine.dtype, run=self.rollout.run_coroutine)
        self.stats = StatsLogger(paths.root, cfg.stats_logger,
                                 resume=recover.has_checkpoint(paths.recover))
        self.saver = Periodic(cfg.saver, steps_per_epoch)
        self.checkpointer = Periodic(cfg.recover, steps_per_epoch)
        self.evaluator = Periodic(cfg.evaluator, steps_per_epoch)
        self.summary: dict[str, Any] = {"run_dir": str(paths.root)}

    def _train_items(self) -> tuple[list[dict[str, Any]], ItemStream | None]:
        """The training items and their stream (none in online mode: clients bring them)."""
        cfg = self.cfg
        if cfg.online:
            return [], None
        items = load_dataset(cfg.train_dataset)
        if cfg.workflow.type == "rlvr":  # agents build their own prompts
            items = filter_by_length(items, self.workflow.prompt_ids, cfg.train_dataset.max_length)
        return items, ItemStream(items, shuffle=cfg.train_dataset.shuffle, seed=cfg.seed)

    def train(self) -> dict[str, Any]:
        """The loop: batch -> proximal log-probs -> advantages -> step -> publish -> log."""
        step = self._restore()
        self.rollout.start(paused=True)
        if self.agents is not None:
            a = self.cfg.agent
            url = self.rollout.run_coroutine(self.agents.proxy.start(a.host, a.port))
            self.summary["agent_base_url"] = url
            logger.info("agent proxy: %s (%s mode)", url, a.mode)
        if step > 0:  # the servers start from the base model: give them the resumed weights
            self.publisher.publish(self.actor, version=step)
        elif self.cfg.evaluator.before_training and self.valid_items:
            self._evaluate(step, "eval_before")
        self.rollout.resume()
        bar = ProgressBar(self.total_steps, initial=step, enabled=self.cfg.stats_logger.progress_bar)
        while step < self.total_steps:
            timer = StepTimer()
            with timer("wait_batch_s"):
                batch, stats = self.rollout.next_batch()
            with timer("train_s"):
                stats |= self._train_step(batch)
            with timer("publish_s"):
                stats |= self.publisher.publish(self.actor, version=step + 1)
            self.rollout.set_version(step + 1)
            step += 1
            stats |= _throughput(batch, timer.stats())
            if self.agents is not None:
                stats |= self.agents.stats()
            self.stats.log(step, stats)
            bar.update(stats)
            self._periodic(step)
        bar.close()
        self.rollout.pause()
        if self.cfg.evaluator.after_training and self.valid_items:
            self._evaluate(step, "eval_after")
        self._finish()
        return self.summary

    def _train_step(self, batch: Batch) -> dict[str, float]:
        tb = batch.to_tensors(self.tokenizer.pad_token_id or 0)
        if self.cfg.actor.recompute_logprob and not self.prox_in_loss:
            tb.prox_logprobs = self.actor.compute_logprobs(tb)
        actor = self.cfg.actor
        if self.ref is not None:
            tb.ref_logprobs = self.ref.compute_logprobs(tb)
        if self.teacher is not None:
            tb.teacher_logprobs = self.teacher.compute_logprobs(tb)
        if self.critic is not None:
            tb.values = self.critic.compute_values(tb)
        tb.advantages, tb.returns = compute_advantages_and_returns(tb, actor)
        stats = train_epochs(self.actor, tb, self.loss_fn, n_minibatches=actor.ppo_n_minibatches,
                             epochs=actor.ppo_epochs)
        if self.ref is not None and not actor.use_kl_loss:
            # The in-reward KL is not in the loss: report the one the advantages used.
            stats["kl_ref"] = mean_token_kl(tb, in_reward_kl_logprobs(tb), actor.kl_estimator)
        critic_stats = self.critic.train(tb) if self.critic is not None else {}
        return {f"train/{k}": v for k, v in stats.items()} | critic_stats

    def _periodic(self, step: int) -> None:
        now = time.monotonic()
        if self.saver.due(step, now) or (step == self.total_steps and self.saver.enabled):
            self.actor.save_hf(str(self.paths.checkpoints / f"step{step}"))
            if self.critic is not None:
                self.critic.engine.save_hf(str(self.paths.checkpoints / f"step{step}_critic"))
        if self.cfg.recover.mode != "disabled" and self.checkpointer.due(step, now):
            recover.save_checkpoint(self.paths.recover, actor=self.actor, rollout=self.rollout,
                                    trainer_state={"step": step}, critic=self._critic_engine)
        if self.valid_items and self.evaluator.due(step, now) and step < self.total_steps:
            self._evaluate(step, f"eval_step{step}")

    def _evaluate(self, step: int, name: str) -> None:
        stats, trajectories = self.rollout.run_coroutine(evaluate(
            self.engine, self.eval_workflow, self.valid_items,
            concurrency=self.cfg.local_engine.max_batch_size))
        self.stats.log(step, stats, kind="eval")
        write_samples(self.paths.root / "eval" / f"step{step}.jsonl", trajectories)
        self.summary[name] = stats["eval/reward"]
        logger.info("%s: held-out reward %.4f over %d items (step %d)",
                       name, stats["eval/reward"], int(stats["eval/n"]), step)

    def _restore(self) -> int:
        mode = self.cfg.recover.mode
        if mode == "disabled" or (mode == "auto" and not recover.has_checkpoint(self.paths.recover)):
            return 0
        state = recover.load_checkpoint(self.paths.recover, actor=self.actor, rollout=self.rollout,
                                        critic=self._critic_engine)
        step = state["step"]
        logger.info("resumed from %s at step %d", self.paths.recover, step)
        return step

    @property
    def _critic_engine(self) -> FSDPTrainEngine | None:
        return self.critic.engine if self.critic is not None else None

    def _finish(self) -> None:
        self.stats.close()
        if self.cfg.stats_logger.plot and self.cfg.stats_logger.jsonl:
            png = plot_reward_curve(self.paths.root / "stats.jsonl",
                                    self.paths.root / "reward_curve.png",
                                    title=f"{self.cfg.experiment_name}/{self.cfg.trial_name}")
            self.summary["reward_curve"] = str(png)
        self.summary["stats"] = str(self.paths.root / "stats.jsonl")

    def close(self) -> None:
        if self.agents is not None and self.rollout.running:
            self.rollout.run_coroutine(self.agents.proxy.stop(), timeout=30)
        self.rollout.stop()
        self.workflow.close()
        self.stats.close()
        for engine in (self.ref, self.teacher, self._critic_engine):
            if engine is not None:
                engine.destroy()  # before the actor, which owns the process group
        self.actor.destroy()


def _throughput(batch: Batch, perf: dict[str, float]) -> dict[str, float]:
    """Trained tokens (prompt and completion) per second of the whole step, waiting included."""
    tokens = sum(t.n_tokens for t in batch)
    return {**perf, "perf/trained_tokens": float(tokens),
            "perf/trained_tokens_per_s": tokens / max(perf["perf/step_s"], 1e-9)}
