"""Starting an RL run's processes under its scheduler: servers, trainer ranks, agent proxy.

The same roles under every scheduler (under ray and slurm each binds its node's address
and takes an API key made for the run):
- `inference`: `rollout.n_servers` servers of `rollout.backend` (allocation_mode's d<N>);
- `trainer`: `fsdp:d<M>` training-service ranks (`services/training.py`), unless the one
  rank runs inline in the controller (`scheduler.trainer`: auto is inline for one rank
  under the local scheduler);
- `agent` (workflow.type=agent): the agent proxy as its own process (`services/agent.py`),
  unless it runs on the controller's rollout loop (`scheduler.agent`: auto is inline
  under the local scheduler).
On GPUs every server and every rank takes one GPU (local: ranks 0..M-1, servers after).
On a CPU machine the local scheduler splits the cores between the servers and the trainer
(`scheduler.inference_threads` / `trainer_threads`, totals); under Ray and Slurm those two
keys are the cores of each server and of each rank.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from dataclasses import dataclass

from asyncrl.api import Trainer
from asyncrl.config import ExperimentConfig
from asyncrl.models.hub import resolve_model_path
from asyncrl.scheduler.base import Scheduler, WorkerSpec
from asyncrl.scheduler.commands import inference_spec
from asyncrl.scheduler.local import LocalScheduler, split_cores
from asyncrl.services.agent import AgentClient
from asyncrl.services.training import TrainingClient
from asyncrl.trainers.paths import RunPaths

logger = logging.getLogger(__name__)


@dataclass
class Services:
    inference: list[str]  # the servers' addresses
    trainer: Trainer | None  # the training service's client; None: the trainer runs inline
    inference_key: str | None = None  # the servers' API key (set when they bind a node IP)
    agent: AgentClient | None = None  # the agent service's client; None: the proxy is inline


def agent_in_service(cfg: ExperimentConfig) -> bool:
    if cfg.workflow.type != "agent":
        return False
    if cfg.scheduler.agent == "auto":
        return cfg.scheduler.type != "local"
    return cfg.scheduler.agent == "service"


def agent_spec(cfg: ExperimentConfig, config_path: str, servers: list[str], *,
               admin_key: str, inference_key: str | None, local: bool) -> WorkerSpec:
    """The agent service (services/agent.py): the run's proxy in front of `servers`.

    Under the local scheduler it binds `agent.host`; elsewhere its node's address. A set
    `agent.port` is kept (clients of online training are told it), else one is picked."""
    env = {"ASYNCRL_ADMIN_KEY": admin_key, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    if inference_key is not None:
        env["ASYNCRL_API_KEY"] = inference_key
    return WorkerSpec(
        role="agent", count=1,
        command=[sys.executable, "-m", "asyncrl.services.agent", "--config", config_path,
                 "--servers", ",".join(servers), "--host",
                 cfg.agent.host if local else "{host}", "--port", "{port}"],
        env=env, cpus=1, port=cfg.agent.port or None, cores=[[]] if local else None)


def trainer_in_service(cfg: ExperimentConfig) -> bool:
    if cfg.scheduler.trainer == "auto":
        return not (cfg.scheduler.type == "local" and cfg.trainer_world_size == 1)
    return cfg.scheduler.trainer == "service"


def trainer_spec(cfg: ExperimentConfig, config_path: str, *, api_key: str) -> WorkerSpec:
    """`fsdp:d<M>` training-service ranks reading the run's resolved config."""
    return WorkerSpec(
        role="trainer", count=cfg.trainer_world_size,
        command=[sys.executable, "-m", "asyncrl.services.training", "--config", config_path,
                 "--host", "{host}", "--port", "{port}", "--threads", "{cpus}"],
        env={"ASYNCRL_API_KEY": api_key, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"},
        cpus=cfg.scheduler.trainer_threads or 1,
        gpus=1 if cfg.cluster.n_gpus_per_node else 0, torch_distributed=True)


def rank_cores(cores: list[int], world_size: int) -> list[list[int]]:
    """The trainer's cores in `world_size` contiguous parts (one core each when too few)."""
    if len(cores) < world_size:
        return [[cores[r % len(cores)]] for r in range(world_size)]
    per = len(cores) // world_size
    return [cores[r * per:(r + 1) * per] for r in range(world_size)]


def launch(cfg: ExperimentConfig, paths: RunPaths, scheduler: Scheduler) -> Services:
    """Start the servers and (service mode) the trainer ranks; return once all are healthy."""
    world, n_servers = cfg.trainer_world_size, cfg.rollout.n_servers
    device = "cuda" if cfg.cluster.n_gpus_per_node else "cpu"
    local = isinstance(scheduler, LocalScheduler)
    service = trainer_in_service(cfg)
    extra = list(cfg.rollout.server_args)
    if cfg.rollout.backend == "vllm" and cfg.actor.weight_update_mode == "broadcast":
        extra += ["--weight-transfer-config", '{"backend": "nccl"}']  # vLLM's receive side
    # Off the local machine the servers bind their node's address: they take a key.
    inference_key = None if local else secrets.token_hex(16)
    if inference_key is not None and cfg.rollout.backend != "local":
        extra += ["--api-key", inference_key]
    servers = inference_spec(
        cfg.rollout.backend, resolve_model_path(cfg.actor.path), cfg.local_engine,
        n_servers=n_servers, seed=cfg.seed, device=device,
        cpus=cfg.scheduler.inference_threads or 1, extra_args=extra,
        cache_dir=str(paths.logs / "vllm-cache"))
    trainer_cores: list[int] = []
    if local:
        if device == "cpu":
            servers.cores, trainer_cores = split_cores(
                sorted(os.sched_getaffinity(0)), cfg.scheduler.inference_threads,
                cfg.scheduler.trainer_threads, n_servers)
        else:  # GPUs 0..M-1 train (inline: GPU 0), the servers take the next ones
            servers.cores = [[] for _ in range(n_servers)]
            servers.gpu_ids = [[world + i] for i in range(n_servers)]
    if inference_key is not None and cfg.rollout.backend == "local":
        servers.env["ASYNCRL_API_KEY"] = inference_key
    addresses = [w.address for w in scheduler.create_workers(servers)]
    agent = None
    if agent_in_service(cfg):
        admin_key = cfg.agent.admin_key or secrets.token_hex(16)
        [worker] = scheduler.create_workers(agent_spec(
            cfg, str(paths.root / "config.yaml"), addresses, admin_key=admin_key,
            inference_key=inference_key, local=local))
        agent = AgentClient(worker.address, admin_key)
        logger.info("agent service: %s", worker.address)
    if not service:
        if local:
            threads = scheduler.pin_trainer(trainer_cores)
            logger.info("trainer: inline, %d thread(s)", threads)
        return Services(addresses, None, inference_key, agent)
    key = secrets.token_hex(16)
    spec = trainer_spec(cfg, str(paths.root / "config.yaml"), api_key=key)
    if local:
        spec.cores = (rank_cores(trainer_cores, world) if device == "cpu"
                      else [[] for _ in range(world)])
        spec.gpu_ids = [[r] for r in range(world)] if device == "cuda" else None
    ranks = scheduler.create_workers(spec)
    logger.info("trainer: %d rank(s) at %s", world, ", ".join(w.address for w in ranks))
    return Services(addresses, TrainingClient([w.address for w in ranks], api_key=key,
                                              timeout=cfg.scheduler.trainer_timeout),
                    inference_key, agent)
