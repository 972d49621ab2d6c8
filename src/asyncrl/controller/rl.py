"""Asynchronous RL (the PPO family): the training loop.

The rollout thread generates continuously under the staleness bound; this loop takes a
batch, recomputes the proximal log-probs, computes advantages, takes an optimiser step,
publishes the new weights to the servers (which switch mid-generation) and logs.
`RLTrainer.train` is the whole loop; everything it calls is built in `__init__`.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from asyncrl.agents.service import AgentClient, AgentServiceError
from asyncrl.api import Batch, Trainer, Trajectory, faults
from asyncrl.config import ExperimentConfig, to_yaml
from asyncrl.controller import recover
from asyncrl.controller.agents import AgentRuntime
from asyncrl.controller.launch import launch
from asyncrl.controller.rollout import (
    RolloutController,
    RolloutError,
    evaluate,
    make_episode_filter,
)
from asyncrl.controller.specs import build_agent_spec, build_trainer_spec, run_paths
from asyncrl.controller.weight_update import WeightUpdateClient
from asyncrl.controller.workflows import RLVRWorkflow
from asyncrl.data import ItemStream, filter_by_length, held_out, load_dataset
from asyncrl.inference.client.backends import client_class
from asyncrl.inference.client.base import WeightUpdateError
from asyncrl.inference.router import RouterClient, fetch_state
from asyncrl.launch import make_scheduler
from asyncrl.launch.base import (
    Scheduler,
    SchedulerError,
    WorkerDiedError,
    cause_line,
    log_size,
    log_tail,
)
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
from asyncrl.observe.timeline import Timeline, plot_timeline
from asyncrl.trainer.service import TrainingServiceError
from asyncrl.trainer.worker import RLWorker
from asyncrl.weights import WeightPublisher, make_publisher, transfer_backend

logger = logging.getLogger(__name__)
# Seconds between health checks of the servers while the trainer waits for a batch.
SERVER_CHECK_S = 5.0
# The step's sections drawn on the trainer's lane of timeline.png.
STEP_KINDS = {"wait_batch_s": "wait", "train_s": "train", "publish_s": "publish"}
ROLES = ("inference", "router", "trainer", "weight_update", "agent")  # the processes an RL run's scheduler starts


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
            # a dead process explains it best, with its log's tail
            _raise_if_dead(scheduler, trainer.inference_log_starts)
            raise
        finally:
            trainer.close()


def _raise_if_dead(scheduler: Scheduler, inference_log_starts: dict[int, int]) -> None:
    """SchedulerError for the first worker that is down, with the first error of its present
    life (a restarted server's log holds its earlier lives too: `inference_log_starts`)."""
    for role in ROLES:
        workers = scheduler.get_workers(role)
        for worker, ok in zip(workers, scheduler.check_health(role) if workers else []):
            if not ok:
                start = inference_log_starts.get(worker.index, 0) if role == "inference" else 0
                cause = cause_line(worker.log_path, start)
                raise SchedulerError(f"{role} {worker.index} ({worker.address}) is down"
                                     + (f": {cause}" if cause else "") + "; the end of "
                                     f"{worker.log_path}:\n{log_tail(worker.log_path)}")


class RLTrainer:
    def __init__(self, cfg: ExperimentConfig, paths: RunPaths, addresses: list[str],
                 trainer: Trainer | None = None, scheduler: Scheduler | None = None,
                 inference_key: str | None = None,
                 agent_service: AgentClient | None = None, router: str | None = None,
                 weight_update: WeightUpdateClient | None = None,
                 cores_shared: bool = False) -> None:
        from transformers import AutoTokenizer

        self.cfg, self.paths = cfg, paths
        self.scheduler = scheduler  # restarts dead inference servers (None: nobody does)
        self.server_restarts = 0
        self.agent_service_restarts = 0
        # server index (or "agent", the agent service) -> health checks failed in a row
        self._failed_checks: dict[int | str, int] = {}
        # server index -> the error that ended its last life, and where its log's part for
        # the present life begins (restarts append to the same file)
        self._death_causes: dict[int, str | None] = {}
        self.inference_log_starts: dict[int, int] = {}
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.tokenizer_path))
        self.routed = router is not None  # a router service routes for every client
        self.timeline = Timeline(paths.root / "timeline.jsonl")
        if router is not None:
            self.engine: Any = RouterClient(
                router, api_key=inference_key, request_timeout=cfg.rollout.request_timeout,
                update_weights_timeout=cfg.rollout.update_weights_timeout,
                state=fetch_state(router, inference_key))
        else:
            self.engine = client_class(cfg.rollout.backend)(
                addresses, request_timeout=cfg.rollout.request_timeout,
                request_retries=cfg.rollout.request_retries,
                update_weights_timeout=cfg.rollout.update_weights_timeout,
                health_check_interval=cfg.rollout.health_check_interval, api_key=inference_key,
                server_wait_timeout=cfg.rollout.server_wait_timeout)
            self.engine.timeline = self.timeline  # the servers' lanes, as routed from here
        self.agents = None  # workflow.type=agent: the proxy and the agent
        if cfg.workflow.type == "agent":
            self.agents = AgentRuntime(build_agent_spec(cfg), self.tokenizer, self.engine,
                                       version=lambda: self.rollout.version,
                                       service=agent_service)
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
        self.valid_items = (held_out(load_dataset(cfg.valid_dataset), train_items)
            if cfg.valid_dataset else [])
        self.eval_workflow = self.workflow.for_eval(cfg.evaluator.max_new_tokens)
        # The trainer ranks: this process (inline) or the training service's processes.
        self.trainer = trainer if trainer is not None else RLWorker(build_trainer_spec(cfg))
        self.trainer.initialize(self.total_steps)
        if weight_update is not None:  # the weight-update service pairs ranks and servers
            self.publisher: Any = weight_update
        else:
            self.publisher = self._make_publisher()
        # The servers load while the trainer trains (`_publish`): the version the trainer's
        # weights are at, the load still running (its version and future), its timing.
        self._overlap = (cfg.actor.weight_update_overlap
                         and isinstance(self.publisher, WeightPublisher))
        self._version = 0
        self._loading: tuple[int, concurrent.futures.Future] | None = None
        self._load_stats: dict[str, float] = {}
        resuming = cfg.recover.mode != "disabled" and recover.has_checkpoint(paths.recover)
        if resuming:
            step = recover.checkpoint_step(paths.recover)
            dropped = recover.drop_records_after(step, paths.root / "stats.jsonl",
                                                 paths.root / "batches.jsonl",
                                                 paths.root / "failures.jsonl")
            if any(dropped.values()):
                logger.warning("resuming at step %d: dropped the interrupted run's rows after "
                               "it (%s)", step, ", ".join(f"{n} in {name}"
                                                          for name, n in dropped.items()))
        self.stats = StatsLogger(paths.root, cfg.stats_logger, run_config=cfg, resume=resuming)
        self.saver = Periodic(cfg.saver, steps_per_epoch)
        self.checkpointer = Periodic(cfg.recover, steps_per_epoch)
        self.evaluator = Periodic(cfg.evaluator, steps_per_epoch)
        self.summary: dict[str, Any] = {"run_dir": str(paths.root)}

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
        step = self._version = self._restore()
        self.rollout.start(paused=True)
        if self.agents is not None:
            url = self.rollout.run_coroutine(self.agents.start())
            self.summary["agent_base_url"] = url
            logger.info("agent proxy: %s (%s mode)", url, self.cfg.agent.mode)
        if step > 0:  # the servers start from the base model: give them the resumed weights
            self._publish(step, overlap=False)
        self.rollout.resume()
        # The first evaluation runs beside the first batch's rollout and training step (both
        # read the initial weights), leaving the batch's samples their slots on the server;
        # the first publish waits for it.
        pending_eval = None
        if step == 0 and self.cfg.evaluator.before_training and self.valid_items:
            batch_samples = self.cfg.rollout.consumer_batch_size * self.cfg.gconfig.n_samples
            pending_eval = self._start_evaluate(step, "eval_before", concurrency=max(
                1, self.cfg.local_engine.max_batch_size - batch_samples))
        bar = ProgressBar(self.total_steps, initial=step, enabled=self.cfg.stats_logger.progress_bar)
        while step < self.total_steps:
            timer = StepTimer(self.timeline, kinds=STEP_KINDS)
            faults.point("generate", step + 1)
            with timer("wait_batch_s"):
                batch, stats = self._next_batch()
            with timer("train_s"):
                stats |= self._train_step(batch)
            if pending_eval is not None:
                pending_eval()
                pending_eval = None
            with timer("publish_s"):
                stats |= self._settle_publish()  # the previous version's load, if still on
                stats |= self._publish(step + 1)
            step += 1
            stats |= _throughput(batch, timer.stats())
            self._restart_dead_workers()
            stats["inference/server_restarts"] = float(self.server_restarts)
            if self.agents is not None and self.agents.service is not None:
                stats["agent/service_restarts"] = float(self.agent_service_restarts)
            self._record_batch(step, batch)
            self._record_failures(step)
            if self.agents is not None:
                self.rollout.run_coroutine(self.agents.refresh_stats())
                stats |= self.agents.stats()
            self.stats.log(step, stats)
            bar.update(stats)
            self._periodic(step)
        bar.close()
        if pending_eval is not None:  # no step ran (total_train_steps reached already)
            pending_eval()
        self._settle_publish()
        self.rollout.pause()
        if self.cfg.evaluator.after_training and self.valid_items:
            self._evaluate(step, "eval_after")
        self._finish()
        return self.summary

    def _train_step(self, batch: Batch) -> dict[str, float]:
        return self.trainer.train(batch.to_tensors(self.tokenizer.pad_token_id or 0))

    def _record_batch(self, step: int, batch: Batch) -> None:
        """One line per step in <run>/batches.jsonl: which items and episodes it trained,
        and each trajectory's reward."""
        line = {"step": step, "task_ids": [t.meta.get("task_id") for t in batch],
                "group_ids": [t.group_id for t in batch],
                "rewards": [t.meta.get("raw_reward", t.reward) for t in batch]}
        if any("session_id" in t.meta for t in batch):  # agent sessions
            line["session_ids"] = [t.meta.get("session_id") for t in batch]
        with open(self.paths.root / "batches.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    def _record_failures(self, step: int) -> None:
        """The failed episode runs since the last step, one line each in <run>/failures.jsonl."""
        reports = self.rollout.take_failures()
        if reports:
            with open(self.paths.root / "failures.jsonl", "a") as f:
                f.writelines(json.dumps({"step": step, **r}) + "\n" for r in reports)

    def _next_batch(self) -> tuple[Batch, dict[str, float]]:
        """The rollout's next batch, for the trainer's weights (the servers may still be
        loading them). While it waits, servers that died are restarted (with every server
        dead no episode can finish, and the wait would never end), and a weight load that
        failed meanwhile is dealt with (without it no episode of the new version starts)."""
        while True:
            try:
                return self.rollout.next_batch(timeout=SERVER_CHECK_S, version=self._version)
            except TimeoutError:
                if self._loading is not None and self._loading[1].done():
                    self._load_stats = self._settle_publish()
                self._restart_dead_workers()

    def _publish(self, version: int, overlap: bool | None = None) -> dict[str, float]:
        """Publish `version`: save it, have every server load it, announce it. With
        `actor.weight_update_overlap` (disk mode, the trainer inline) the load and the
        announcement run on the rollout loop while training goes on (`_settle_publish`
        waits for them); otherwise here. If the load failed because servers died, restart
        them and load once more (they come back at the previous version, then load this one)."""
        overlap = self._overlap if overlap is None else overlap
        self._version = version
        if not overlap:
            try:
                stats = self.publisher.publish(self.trainer, version=version)
            except WeightUpdateError as e:
                if not self._restart_dead_servers(checks=1):
                    raise
                logger.warning("weight update v%d failed (%s); restarted the dead servers, "
                               "publishing again", version, e)
                stats = self.publisher.publish(self.trainer, version=version)
            self._announce_version(version)
            return stats
        stats = self.publisher.save(self.trainer, version)

        async def load_and_announce() -> float:
            t0 = time.monotonic()
            await self.publisher.load(version)
            if self.agents is not None:
                await self.agents.set_version(version)
            self.rollout.set_version(version)
            return time.monotonic() - t0

        self._loading = (version, self.rollout.submit_coroutine(load_and_announce()))
        return stats

    def _settle_publish(self) -> dict[str, float]:
        """Wait for the load of the last published version (if it still runs) and announce
        it; its timing, from this call or from `_next_batch`'s (once per version). A failed
        load is handled as `_publish` handles one: dead servers restarted, loaded again."""
        stats, self._load_stats = self._load_stats, {}
        if self._loading is None:
            return stats
        (version, future), self._loading = self._loading, None
        t0 = time.monotonic()
        try:
            return stats | {"perf/weights_load_s": future.result()}
        except WeightUpdateError as e:
            if not self._restart_dead_servers(checks=1):
                raise
            logger.warning("weight update v%d failed (%s); restarted the dead servers, "
                           "loading again", version, e)
            self.rollout.run_coroutine(self.publisher.load(version))
        except AgentServiceError:  # the servers hold it; the agent service could not learn it
            if not self._restart_dead_agent_service(checks=1, version=version):
                raise
        self._announce_version(version)
        return stats | {"perf/weights_load_s": time.monotonic() - t0}

    def _restart_dead_servers(self, checks: int = 2) -> int:
        """Restart each inference server that failed its health check `checks` times in a
        row (its process dead, or alive but not answering); it rejoins routing once it
        holds the current weights (the client re-syncs it). Returns how many this call
        restarted (`server_restarts` counts the run's)."""
        if self.scheduler is None:
            return 0
        restarted = 0
        for idx, ok in enumerate(self.scheduler.check_health("inference")):
            self._failed_checks[idx] = 0 if ok else self._failed_checks.get(idx, 0) + 1
            if self._failed_checks[idx] < checks:
                continue
            self._check_new_death(idx)
            logger.warning("inference server %d failed %s; restarting it (%s)", idx,
                           {1: "a health check", 2: "two health checks"}.get(
                               checks, f"{checks} health checks"),
                           self._death_causes[idx] or "no error in its log")
            restarted += 1
            self.inference_log_starts[idx] = log_size(
                self.scheduler.get_workers("inference")[idx].log_path)
            worker = self.scheduler.restart_worker("inference", idx)
            if worker.address != self.engine.addresses[idx]:
                self.engine.replace_server(idx, worker.address)
            self._failed_checks[idx] = 0
            self.server_restarts += 1
            self.rollout.run_coroutine(self.engine.check_servers())
            if self.agents is not None and not self.routed:  # the agent service's own client
                self.rollout.run_coroutine(self.agents.replace_server(idx, worker.address))
        return restarted

    def _check_new_death(self, idx: int) -> None:
        """Record why inference server `idx` died (the first error in its log since it last
        started); WorkerDiedError if that is why it died the time before: a server that
        fails the same way on every start (a backend bug, a bad flag, a model it cannot
        load) stops the run with its cause instead of being restarted for ever."""
        worker = self.scheduler.get_workers("inference")[idx]
        cause = cause_line(worker.log_path, self.inference_log_starts.get(idx, 0))
        if cause is not None and cause == self._death_causes.get(idx):
            raise WorkerDiedError(
                f"inference server {idx} ({worker.address}, backend {self.cfg.rollout.backend}) "
                f"died again the way it died before: {cause}\n"
                f"Its log: {worker.log_path} (the error from its previous start is there too)")
        self._death_causes[idx] = cause

    def _restart_dead_workers(self) -> None:
        """The inference servers and the agent service that failed two health checks in a
        row, restarted."""
        self._restart_dead_servers()
        self._restart_dead_agent_service(checks=2)

    def _restart_dead_agent_service(self, checks: int, version: int | None = None) -> int:
        """Restart the agent service (scheduler.agent=service) once it failed `checks` health
        checks in a row. Its sessions in flight died with it: their agents' calls fail (the
        new process answers their keys 410 session_lost) and closing them fails, so each
        such episode fails, is reported in failures.jsonl and runs again
        (rollout.episode_retries); nothing of them is trained. The new process is told the
        served weight version (`version`, default the rollout's) and the servers' addresses
        before it opens a session."""
        if self.scheduler is None or self.agents is None or self.agents.service is None:
            return 0
        ok = all(self.scheduler.check_health("agent"))
        self._failed_checks["agent"] = 0 if ok else self._failed_checks.get("agent", 0) + 1
        if self._failed_checks["agent"] < checks:
            return 0
        logger.warning("the agent service failed %d health check(s); restarting it (its "
                       "sessions in flight are lost and their episodes run again)", checks)
        worker = self.scheduler.restart_worker("agent", 0)
        self._failed_checks["agent"] = 0
        self.agent_service_restarts += 1
        servers = [] if self.routed else list(enumerate(self.engine.addresses))
        self.rollout.run_coroutine(self.agents.service_restarted(
            worker.address, self.rollout.version if version is None else version, servers))
        return 1

    def _announce_version(self, version: int) -> None:
        """The servers hold `version` now: the agent service and the rollout learn it."""
        if self.agents is not None:
            try:
                self.rollout.run_coroutine(self.agents.set_version(version))
            except AgentServiceError:
                # a dead agent service learns the version when it is restarted
                if not self._restart_dead_agent_service(checks=1, version=version):
                    raise
        self.rollout.set_version(version)

    def _periodic(self, step: int) -> None:
        now = time.monotonic()
        if self.saver.due(step, now) or (step == self.total_steps and self.saver.enabled):
            self.trainer.save_hf(str(self.paths.checkpoints / f"step{step}"), with_critic=True)
        if self.cfg.recover.mode != "disabled" and self.checkpointer.due(step, now):
            self._load_stats |= self._settle_publish()  # the rollout's state at `step`
            recover.save_checkpoint(self.paths.recover, trainer=self.trainer,
                                    rollout=self.rollout, trainer_state={"step": step})
        if self.valid_items and self.evaluator.due(step, now) and step < self.total_steps:
            self._load_stats |= self._settle_publish()  # evaluate the weights of `step`
            self._evaluate(step, f"eval_step{step}")

    def _evaluate(self, step: int, name: str) -> None:
        self._start_evaluate(step, name)()

    def _start_evaluate(self, step: int, name: str,
                        concurrency: int | None = None) -> Callable[[], None]:
        """Start evaluating on the rollout loop; the returned call waits and logs it.
        `concurrency`: items in flight (default: a server's batch, local_engine's)."""
        async def timed() -> tuple[dict[str, float], list[Trajectory]]:
            with self.timeline.span("evaluator", "eval"):
                return await evaluate(
                    self.engine, self.eval_workflow, self.valid_items,
                    concurrency=concurrency or self.cfg.local_engine.max_batch_size)

        future = self.rollout.submit_coroutine(timed())
        return lambda: self._log_evaluation(step, name, *future.result())

    def _log_evaluation(self, step: int, name: str, stats: dict[str, float],
                        trajectories: list[Trajectory]) -> None:
        self.stats.log(step, stats, kind="eval")
        write_samples(self.paths.root / "eval" / f"step{step}.jsonl", trajectories)
        self.summary[name] = stats["eval/reward"]
        logger.info("%s: held-out reward %.4f over %d items (step %d)",
                       name, stats["eval/reward"], int(stats["eval/n"]), step)

    def _restore(self) -> int:
        mode = self.cfg.recover.mode
        if mode == "disabled" or (mode == "auto" and not recover.has_checkpoint(self.paths.recover)):
            return 0
        state = recover.load_checkpoint(self.paths.recover, trainer=self.trainer,
                                        rollout=self.rollout)
        step = state["step"]
        logger.info("resumed from %s at step %d", self.paths.recover, step)
        return step

    def _finish(self) -> None:
        self.stats.close()
        if self.cfg.stats_logger.plot and self.cfg.stats_logger.jsonl:
            png = plot_reward_curve(self.paths.root / "stats.jsonl",
                                    self.paths.root / "reward_curve.png",
                                    title=f"{self.cfg.experiment_name}/{self.cfg.trial_name}")
            self.summary["reward_curve"] = str(png)
            if self.timeline.path.exists():
                png = plot_timeline(self.timeline.path, self.paths.root / "timeline.png",
                                    title=f"{self.cfg.experiment_name}/{self.cfg.trial_name}")
                self.summary["timeline"] = str(png)
        self.summary["stats"] = str(self.paths.root / "stats.jsonl")

    def close(self) -> None:
        if self.agents is not None and self.rollout.running:
            self.rollout.run_coroutine(self.agents.stop(), timeout=30)
        self.rollout.stop()
        self.workflow.close()
        self.stats.close()
        self.publisher.close()
        self.trainer.destroy()


def _throughput(batch: Batch, perf: dict[str, float]) -> dict[str, float]:
    """Trained tokens (prompt and completion) per second of the whole step, waiting included."""
    tokens = sum(t.n_tokens for t in batch)
    return {**perf, "perf/trained_tokens": float(tokens),
            "perf/trained_tokens_per_s": tokens / max(perf["perf/step_s"], 1e-9)}
