"""The composition root's slices of the run's config: one small spec per process.

Each process reads only its spec (trainer ranks `TrainerSpec`, the agent proxy
`AgentServiceSpec`, the weight-update service `WeightUpdateSpec`); launch writes each one
it starts to `<run>/specs/<role>.json` (`config/specfile.py`). The router and the inference
servers take their few settings as command-line flags (`controller/launch.py`).
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.agents.service import AgentServiceSpec
from asyncrl.config import ExperimentConfig
from asyncrl.controller.placement import Placement, resolve_placement
from asyncrl.controller.weight_update import WeightUpdateSpec
from asyncrl.observe.paths import RunPaths
from asyncrl.trainer.worker import TrainerSpec


def run_paths(cfg: ExperimentConfig) -> RunPaths:
    """The run's folder, <cluster.fileroot>/<experiment_name>/<trial_name>/ (made if missing)."""
    return RunPaths.from_names(cfg.cluster.fileroot, cfg.experiment_name, cfg.trial_name)


def build_placement(cfg: ExperimentConfig) -> Placement:
    """Where each role runs (scheduler.trainer/router/agent/weight_update, `auto` resolved)."""
    return resolve_placement(cfg.scheduler, trainer_world_size=cfg.trainer_world_size,
                             agent_workflow=cfg.workflow.type == "agent")


def build_trainer_spec(cfg: ExperimentConfig) -> TrainerSpec:
    """What a trainer rank reads, inline or in the training service."""
    colocated_gpu = cfg.colocated and cfg.cluster.device == "cuda"
    return TrainerSpec(
        actor=cfg.actor, ref=cfg.ref, teacher=cfg.teacher, critic=cfg.critic, seed=cfg.seed,
        device=cfg.cluster.device, tokenizer_path=cfg.tokenizer_path,
        # The colocated server takes rollout.gpu_memory_fraction of the GPU; the rank the rest.
        gpu_memory_fraction=1 - cfg.rollout.gpu_memory_fraction if colocated_gpu else None,
        fileroot=cfg.cluster.fileroot)


def build_agent_spec(cfg: ExperimentConfig) -> AgentServiceSpec:
    """What the agent proxy reads, inline or in the agent service."""
    r = cfg.rollout
    return AgentServiceSpec(
        agent=cfg.agent, gconfig=cfg.gconfig, model_name=cfg.actor.path,
        tokenizer_path=cfg.tokenizer_path, max_model_len=cfg.local_engine.max_seq_len,
        max_session_version_lag=r.max_session_version_lag, backend=r.backend,
        request_timeout=r.request_timeout, request_retries=r.request_retries)


def build_weight_update_spec(cfg: ExperimentConfig, weights_dir: str | Path) -> WeightUpdateSpec:
    """What the weight-update service reads; `weights_dir` is the run's <run>/weights."""
    return WeightUpdateSpec(
        mode=cfg.actor.weight_update_mode, backend=cfg.rollout.backend,
        cuda=cfg.cluster.n_gpus_per_node > 0, weights_dir=str(weights_dir),
        dtype=cfg.local_engine.dtype, bucket_mb=cfg.actor.weight_update_bucket_mb,
        update_weights_timeout=cfg.rollout.update_weights_timeout,
        trainer_timeout=cfg.scheduler.trainer_timeout)
