"""Asynchronous RL (the PPO family): the training loop.

The rollout thread generates continuously under the staleness bound; this loop takes a
batch, recomputes the proximal log-probs, computes advantages, takes an optimiser step,
publishes the new weights to the servers (which switch mid-generation) and logs.
`RLTrainer.train` is the whole loop; everything it calls is built in `__init__`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.agents.service import AgentClient
from asyncrl.api import Batch, Trainer, faults
from asyncrl.config import ExperimentConfig, to_yaml
from asyncrl.controller import recover
from asyncrl.controller.agents import AgentRuntime
from asyncrl.controller.health import HealthMonitor, step_signals
from asyncrl.controller.launch import launch
from asyncrl.controller.rollout import (
    RolloutController,
    RolloutError,
    evaluate,
    make_episode_filter,
)
from asyncrl.controller.rollout.evaluate import EvalResult
from asyncrl.controller.specs import build_agent_spec, build_trainer_spec, run_paths
from asyncrl.controller.supervise import ROLES, Supervisor
from asyncrl.controller.versions import VersionSync
from asyncrl.controller.weight_update import WeightUpdateClient
from asyncrl.controller.workflows import RLVRWorkflow
from asyncrl.data import ItemStream, filter_by_length, held_out, load_dataset, load_datasets
from asyncrl.inference.client.backends import client_class
from asyncrl.inference.router import RouterClient, fetch_state
from asyncrl.launch import make_scheduler
from asyncrl.launch.base import Scheduler
from asyncrl.models.hub import resolve_model_path
from asyncrl.observe import (
    ProgressBar,
    StatsLogger,
    StepTimer,
    plot_reward_curve,
    write_samples,
)
from asyncrl.observe.paths import RunPaths, setup_logging
from asyncrl.observe.periodic import Periodic
from asyncrl.observe.stats import by_task
from asyncrl.observe.timeline import Timeline, plot_timeline
from asyncrl.openai.images import load_image_prompts
from asyncrl.trainer.service import TrainingServiceError
from asyncrl.trainer.worker import RLWorker
from asyncrl.weights import WeightPublisher, make_publisher, transfer_backend

logger = logging.getLogger(__name__)
# Seconds between health checks of the servers while the trainer waits for a batch.
SERVER_CHECK_S = 5.0
# How often an evaluation waiting for a weight version checks whether the servers hold it.
VERSION_POLL_S = 0.01
# The step's sections drawn on the trainer's lane of timeline.png.
STEP_KINDS = {"wait_batch_s": "wait", "train_s": "train", "publish_s": "publish"}


def train(cfg: ExperimentConfig) -> dict[str, Any]:
    """Run asynchronous RL as `cfg` says; returns the summary (evaluations, run dir)."""
    paths = run_paths(cfg)
    setup_logging(paths.root)
    (paths.root / "config.yaml").write_text(to_yaml(cfg))  # the resolved config, as run
    with make_scheduler(cfg.scheduler, cfg.cluster, paths.root, ray_cfg=cfg.ray,
                        slurm_cfg=cfg.slurm) as scheduler:
        services = launch(cfg, paths, scheduler)
        trainer = RLTrainer(cfg, paths, services.inference, services.trainer,
                            scheduler=scheduler, inference_key=services.inference_key,
                            agent_service=services.agent, router=services.router,
                            weight_update=services.weight_update,
                            cores_shared=services.cores_shared)
        services.ready()  # the local servers started while the trainer loaded
        trainer.summary["services"] = [
            {"role": w.role, "index": w.index, "address": w.address, "node_id": w.node_id}
            for role in ROLES for w in scheduler.get_workers(role)]
        try:
            return trainer.train()
        except (RolloutError, TrainingServiceError):
            trainer.supervisor.raise_if_dead()  # a dead process explains it best
            raise
        finally:
            trainer.close()


class RLTrainer:
    """The controller of an RL run: the loop (`train`) and the collaborators it calls: the
    rollout, the trainer ranks, `versions` (weight publication) and `supervisor` (restarts
    of dead processes)."""

    def __init__(self, cfg: ExperimentConfig, paths: RunPaths, addresses: list[str],
                 trainer: Trainer | None = None, scheduler: Scheduler | None = None,
                 inference_key: str | None = None,
                 agent_service: AgentClient | None = None, router: str | None = None,
                 weight_update: WeightUpdateClient | None = None,
                 cores_shared: bool = False) -> None:
        from transformers import AutoTokenizer

        self.cfg, self.paths = cfg, paths
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.tokenizer_path))
        self.timeline = Timeline(paths.root / "timeline.jsonl")
        self.engine = _inference_client(cfg, addresses, router, inference_key, self.timeline)
        self.agents = None  # workflow.type=agent: the proxy and the agent
        if cfg.workflow.type == "agent":
            self.agents = AgentRuntime(build_agent_spec(cfg), self.tokenizer, self.engine,
                                       version=lambda: self.rollout.version,
                                       service=agent_service)
            self.workflow = self.agents.workflow
        else:
            self.workflow = RLVRWorkflow.from_config(
                self.tokenizer, cfg.gconfig, cfg.workflow,
                images=load_image_prompts(resolve_model_path(cfg.tokenizer_path)))
        train_items, stream = self._train_items()
        B = cfg.rollout.consumer_batch_size
        steps_per_epoch = len(train_items) // B if stream is not None else cfg.total_train_steps
        if steps_per_epoch == 0:
            raise ValueError(f"train_dataset has {len(train_items)} items, fewer than one batch "
                             f"(rollout.consumer_batch_size={B})")
        self.total_steps = min(cfg.total_train_epochs * steps_per_epoch,
                               cfg.total_train_steps or 10**12)
        self.rollout = RolloutController(
            self.engine, self.workflow, stream,
            consumer_batch_size=B, max_head_offpolicyness=cfg.rollout.max_head_offpolicyness,
            max_concurrent_rollouts=cfg.rollout.concurrency,
            max_failed_episodes=cfg.rollout.max_failed_episodes,
            episode_retries=cfg.rollout.episode_retries,
            seed=cfg.seed if cfg.rollout.seeded_sampling else None,
            should_accept=make_episode_filter(cfg.rollout.dynamic_sampling,
                                              cfg.rollout.dynamic_filter_fn),
            admission=cfg.rollout.admission,
            # On shared cores a trainer's wait is no idle time (the servers take its cores),
            # and more episodes in flight only take cores from it: one version ahead.
            grow_ahead=not cores_shared)
        if self.agents is not None:
            self.agents.attach(self.rollout)
        self.valid_items = (held_out(load_datasets(cfg.valid_datasets), train_items)
            if cfg.valid_datasets else [])
        self.eval_workflow = self.workflow.for_eval(cfg.evaluator.max_new_tokens)
        # The trainer ranks: this process (inline) or the training service's processes.
        self.trainer = trainer if trainer is not None else RLWorker(build_trainer_spec(cfg))
        self.trainer.initialize(self.total_steps)
        self.supervisor = Supervisor(scheduler, self.engine, self.rollout, self.agents,
                                     routed=router is not None, backend=cfg.rollout.backend)
        # the weight-update service pairs ranks and servers; else this process carries them
        publisher = weight_update if weight_update is not None else self._make_publisher()
        self.versions = VersionSync(
            publisher, self.trainer, self.rollout, self.supervisor, self.agents,
            overlap=cfg.actor.weight_update_overlap and isinstance(publisher, WeightPublisher))
        resuming = cfg.recover.mode != "disabled" and recover.has_checkpoint(paths.recover)
        if resuming:
            _drop_records_after_checkpoint(paths)
        self.stats = StatsLogger(paths.root, cfg.stats_logger, run_config=cfg, resume=resuming)
        self.saver = Periodic(cfg.saver, steps_per_epoch)
        self.checkpointer = Periodic(cfg.recover, steps_per_epoch)
        self.evaluator = Periodic(cfg.evaluator, steps_per_epoch)
        norm = cfg.actor.reward_norm
        # Flat groups give no gradient when each reward is centred on its group's mean and no
        # critic adds advantages of its own.
        group_baseline = norm is not None and norm.mean_level == "group" and cfg.critic is None
        self.health = (HealthMonitor(cfg.health.steps, max_new_tokens=cfg.gconfig.max_new_tokens,
                                     group_baseline=group_baseline)
                       if cfg.health.enabled else None)
        self.summary: dict[str, Any] = {"run_dir": str(paths.root)}
        self._running_evals: list[_Evaluation] = []  # started, not logged yet; oldest first

    def _make_publisher(self) -> Any:
        """This process carries the versions: from its inline rank or the ranks' service."""
        cfg = self.cfg
        sender, master = None, "127.0.0.1"
        if cfg.actor.weight_update_mode == "broadcast":
            sender, master = self.trainer.weight_sender(
                transfer_backend(cfg.rollout.backend, cuda=cfg.cluster.n_gpus_per_node > 0),
                cfg.local_engine.dtype)
        return make_publisher(
            cfg.actor.weight_update_mode, self.engine, root=self.paths.weights,
            dtype=cfg.local_engine.dtype, bucket_mb=cfg.actor.weight_update_bucket_mb,
            timeout=cfg.rollout.update_weights_timeout, master_address=master, sender=sender,
            run=self.rollout.run_coroutine)

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
        step = self._start()
        self._evaluate_beside(step, first=True)
        bar = ProgressBar(self.total_steps, initial=step,
                          enabled=self.cfg.stats_logger.progress_bar)
        while step < self.total_steps:
            timer = StepTimer(self.timeline, kinds=STEP_KINDS)
            faults.point("generate", step + 1)
            with timer("wait_batch_s"):
                batch, stats = self._next_batch()
            with timer("train_s"):
                stats |= self._train_step(batch)
            with timer("eval_wait_s"):
                reading = self._evaluations_before_publish()
            with timer("publish_s"):
                stats |= self.versions.settle()  # the previous version's load, if still on
                stats |= self.versions.publish(step + 1, after=reading)
            step += 1
            self.supervisor.restart_dead()
            stats |= _throughput(batch, timer.stats()) | self.supervisor.stats()
            stats |= self._agent_stats()
            _record_batch(self.paths.root / "batches.jsonl", step, batch)
            failures = self.rollout.take_failures()
            _record_failures(self.paths.root / "failures.jsonl", step, failures)
            self._check_health(step, batch, failures)
            self.stats.log(step, stats)
            bar.update(stats)
            self._periodic(step)
            self._evaluate_beside(step)
        bar.close()
        return self._finish(step)

    def _start(self) -> int:
        """Restore the checkpoint (if resuming), start the rollout and the agent proxy, give
        the servers the resumed weights; the step to start from."""
        step = self.versions.version = self._restore()
        self.rollout.start(paused=True)
        if self.agents is not None:
            url = self.rollout.run_coroutine(self.agents.start())
            self.summary["agent_base_url"] = url
            logger.info("agent proxy: %s (%s mode)", url, self.cfg.agent.mode)
        if step > 0:  # the servers start from the base model: give them the resumed weights
            self.versions.publish(step, overlap=False)
        self.rollout.resume()
        return step

    def _evaluate_beside(self, step: int, *, first: bool = False) -> None:
        """Start the evaluation due after `step` (`first`: the one before training), beside
        the training. It reads the weights of `step`: it starts once the servers hold them
        and they keep them until it ends; the trainer goes on meanwhile (see
        `_evaluations_before_publish`). The last step is `evaluator.after_training`'s."""
        if not self.valid_items:
            return
        if first:
            if step > 0 or not self.cfg.evaluator.before_training:
                return
            name = "eval_before"
        elif step < self.total_steps and self.evaluator.due(step, time.monotonic()):
            name = f"eval_step{step}"
        else:
            return
        self._running_evals.append(self._start_evaluate(
            step, name, version=step, concurrency=eval_in_flight(self.cfg, beside_training=True)))

    def _evaluations_before_publish(self) -> concurrent.futures.Future | None:
        """Log the evaluations that the coming settle or publish would change the weights of
        (waiting for them); the one the coming publish's load must wait for, if any.

        With overlapped loads an evaluation of version v holds back the load of v + 1 (the
        trainer trains on) and is waited for only when that load is settled, one step later:
        it has two training steps to run beside. Otherwise the publish of v + 1 waits for it."""
        keep = []
        for evaluation in self._running_evals:
            if evaluation.holds_load or not self.versions.overlap:
                evaluation.finish()
            else:
                evaluation.holds_load = True
                keep.append(evaluation)
        self._running_evals = keep
        return keep[0].future if keep else None

    def _check_health(self, step: int, batch: Batch, failures: list[dict[str, Any]]) -> None:
        """Warn when the batch says the run cannot learn (controller/health.py)."""
        if self.health is not None:
            decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
            self.health.observe(step_signals(step, list(batch), failures, decode))

    def _train_step(self, batch: Batch) -> dict[str, float]:
        return self.trainer.train(batch.to_tensors(self.tokenizer.pad_token_id or 0))

    def _agent_stats(self) -> dict[str, float]:
        if self.agents is None:
            return {}
        self.rollout.run_coroutine(self.agents.refresh_stats())
        return self.agents.stats()

    def _next_batch(self) -> tuple[Batch, dict[str, float]]:
        """The rollout's next batch, for the trainer's weights (the servers may still be
        loading them). While it waits, servers that died are restarted (with every server
        dead no episode can finish, and the wait would never end), and a weight load that
        failed meanwhile is dealt with (without it no episode of the new version starts)."""
        while True:
            try:
                return self.rollout.next_batch(timeout=SERVER_CHECK_S,
                                               version=self.versions.version)
            except TimeoutError:
                self.versions.poll()
                self.supervisor.restart_dead()

    def _periodic(self, step: int) -> None:
        now = time.monotonic()
        if self.saver.due(step, now) or (step == self.total_steps and self.saver.enabled):
            self.trainer.save_hf(str(self.paths.checkpoints / f"step{step}"), with_critic=True)
        if self.cfg.recover.mode != "disabled" and self.checkpointer.due(step, now):
            self.versions.wait_loaded()  # the rollout's state at `step`
            recover.save_checkpoint(self.paths.recover, trainer=self.trainer,
                                    rollout=self.rollout, trainer_state={"step": step})

    def _evaluate(self, step: int, name: str) -> None:
        self._start_evaluate(step, name).finish()

    def _start_evaluate(self, step: int, name: str, concurrency: int | None = None,
                        version: int | None = None) -> _Evaluation:
        """Start evaluating on the rollout loop; `finish` on the result waits and logs it.
        `concurrency`: items in flight (default: `eval_in_flight` alone).
        `version`: start once the servers hold it (a load of it may still run)."""
        async def timed() -> EvalResult:
            while version is not None and self.rollout.version < version:
                await asyncio.sleep(VERSION_POLL_S)
            with self.timeline.span("evaluator", "eval"):
                return await evaluate(
                    self.engine, self.eval_workflow, self.valid_items,
                    concurrency=concurrency or eval_in_flight(self.cfg, beside_training=False))

        future = self.rollout.submit_coroutine(timed())

        def finish() -> None:
            self._log_evaluation(step, name, future.result())

        return _Evaluation(future, finish)

    def _log_evaluation(self, step: int, name: str, result: EvalResult) -> None:
        stats, trajectories = result.stats, result.trajectories
        self.stats.log(step, stats, kind="eval")
        write_samples(self.paths.root / "eval" / f"step{step}.jsonl", trajectories)
        self.summary[name] = stats["eval/reward"]
        tasks = by_task(stats)
        if tasks:
            self.summary[f"{name}_by_task"] = {t: s["reward"] for t, s in tasks.items()}
        logger.info("%s: held-out reward %.4f over %d items (step %d)%s",
                    name, stats["eval/reward"], int(stats["eval/n"]), step,
                    "".join(f"; {t} {s['reward']:.4f} ({int(s['n'])})"
                            for t, s in tasks.items()))

    def _restore(self) -> int:
        mode, root = self.cfg.recover.mode, self.paths.recover
        if mode == "disabled" or (mode == "auto" and not recover.has_checkpoint(root)):
            return 0
        state = recover.load_checkpoint(self.paths.recover, trainer=self.trainer,
                                        rollout=self.rollout)
        step = state["step"]
        logger.info("resumed from %s at step %d", self.paths.recover, step)
        return step

    def _finish(self, step: int) -> dict[str, Any]:
        """Wait for what still runs, evaluate the final weights, draw the pictures."""
        for evaluation in self._running_evals:
            evaluation.finish()
        self._running_evals = []
        self.versions.settle()
        self.rollout.pause()
        if self.cfg.evaluator.after_training and self.valid_items:
            self._evaluate(step, "eval_after")
        self.stats.close()
        root, title = self.paths.root, f"{self.cfg.experiment_name}/{self.cfg.trial_name}"
        if self.cfg.stats_logger.plot and self.cfg.stats_logger.jsonl:
            png = plot_reward_curve(root / "stats.jsonl", root / "reward_curve.png", title=title)
            self.summary["reward_curve"] = str(png)
            if self.timeline.path.exists():
                png = plot_timeline(self.timeline.path, root / "timeline.png", title=title)
                self.summary["timeline"] = str(png)
        self.summary["stats"] = str(root / "stats.jsonl")
        if self.health is not None:
            self.summary["health"] = [str(f) for f in self.health.findings]
        return self.summary

    def close(self) -> None:
        if self.agents is not None and self.rollout.running:
            self.rollout.run_coroutine(self.agents.stop(), timeout=30)
        self.rollout.stop()
        self.workflow.close()
        self.stats.close()
        self.versions.close()
        self.trainer.destroy()


def eval_concurrency(server_batch: int, batch_samples: int) -> int:
    """Items an evaluation beside training keeps in flight: the servers' batch less one
    training batch's samples (the rollout keeps its slots), and never under half the batch.
    The trainer waits for an evaluation after two steps and the rollout then stops, so an
    evaluation squeezed to a few slots would leave the servers idle while everyone waits."""
    return max(server_batch // 2, server_batch - batch_samples, 1)


def eval_in_flight(cfg: ExperimentConfig, *, beside_training: bool) -> int:
    """Items an evaluation keeps in flight: a server's batch, or beside training
    `eval_concurrency`; at most evaluator.max_concurrent."""
    server_batch = cfg.local_engine.max_batch_size
    n = server_batch
    if beside_training:
        n = eval_concurrency(server_batch, cfg.rollout.consumer_batch_size * cfg.gconfig.n_samples)
    limit = cfg.evaluator.max_concurrent
    return n if limit is None else min(n, limit)


@dataclass
class _Evaluation:
    """An evaluation running on the rollout loop; `finish` waits for it and logs it."""

    future: concurrent.futures.Future
    finish: Callable[[], None]
    holds_load: bool = False  # the servers' next load waits for it


def _inference_client(cfg: ExperimentConfig, addresses: list[str], router: str | None,
                      api_key: str | None, timeline: Timeline) -> Any:
    """The controller's client of the inference servers: through the router service when
    there is one, else its own routing over `addresses` (drawing the servers' lanes)."""
    if router is not None:
        return RouterClient(router, api_key=api_key, request_timeout=cfg.rollout.request_timeout,
                            update_weights_timeout=cfg.rollout.update_weights_timeout,
                            state=fetch_state(router, api_key))
    routes = {}
    if cfg.rollout.backend == "sglang" and cfg.actor.routing_replay:
        from asyncrl.inference.client.sglang import moe_route_shape

        config = Path(resolve_model_path(cfg.actor.path)) / "config.json"
        routes = {"moe_routes": moe_route_shape(json.loads(config.read_text()))}
    client = client_class(cfg.rollout.backend)(
        addresses, request_timeout=cfg.rollout.request_timeout,
        request_retries=cfg.rollout.request_retries,
        update_weights_timeout=cfg.rollout.update_weights_timeout,
        health_check_interval=cfg.rollout.health_check_interval, api_key=api_key,
        server_wait_timeout=cfg.rollout.server_wait_timeout, **routes)
    client.timeline = timeline
    return client


def _drop_records_after_checkpoint(paths: RunPaths) -> None:
    """A resumed run rewrites the steps after its checkpoint: the interrupted run's rows of
    them leave stats.jsonl, batches.jsonl and failures.jsonl."""
    step = recover.checkpoint_step(paths.recover)
    dropped = recover.drop_records_after(step, paths.root / "stats.jsonl",
                                         paths.root / "batches.jsonl",
                                         paths.root / "failures.jsonl")
    if any(dropped.values()):
        logger.warning("resuming at step %d: dropped the interrupted run's rows after it (%s)",
                       step, ", ".join(f"{n} in {name}" for name, n in dropped.items()))


def _record_batch(path: Path, step: int, batch: Batch) -> None:
    """One line per step in <run>/batches.jsonl: which items and episodes it trained, and
    each trajectory's reward."""
    line = {"step": step, "task_ids": [t.meta.get("task_id") for t in batch],
            "group_ids": [t.group_id for t in batch],
            "rewards": [t.meta.get("raw_reward", t.reward) for t in batch]}
    if any("session_id" in t.meta for t in batch):  # agent sessions
        line["session_ids"] = [t.meta.get("session_id") for t in batch]
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def _record_failures(path: Path, step: int, reports: list[dict[str, Any]]) -> None:
    """The failed episode runs since the last step, one line each in <run>/failures.jsonl."""
    if reports:
        with open(path, "a") as f:
            f.writelines(json.dumps({"step": step, **r}) + "\n" for r in reports)


def _throughput(batch: Batch, perf: dict[str, float]) -> dict[str, float]:
    """Trained tokens (prompt and completion) per second of the whole step, waiting included."""
    tokens = sum(t.n_tokens for t in batch)
    return {**perf, "perf/trained_tokens": float(tokens),
            "perf/trained_tokens_per_s": tokens / max(perf["perf/step_s"], 1e-9)}
