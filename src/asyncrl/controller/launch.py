"""Starting an RL run's processes under its scheduler: servers, trainer ranks, agent proxy.

The same roles under every scheduler (under ray and slurm each binds its node's address
and takes an API key made for the run):
- `inference`: `rollout.n_servers` servers of `rollout.backend` (allocation_mode's d<N>);
- `trainer`: `fsdp:d<M>` training-service ranks (`trainer/service.py`), unless the one
  rank runs inline in the controller;
- `router`: the servers behind one address (`inference/router.py`), unless the controller's
  client routes itself;
- `agent` (workflow.type=agent): the agent proxy as its own process (`agents/service.py`),
  unless it runs on the controller's rollout loop;
- `weight_update`: the process that carries each version from the trainer ranks to the
  servers (`controller/weight_update.py`), unless the controller does.
Which of them run as services is the run's `Placement` (controller/placement.py). Each
service process reads its spec, written here to `<run>/specs/<role>.json`
(controller/specs.py); the router takes its settings as flags.
On GPUs every rank takes one GPU and every server T (its tensor size, allocation_mode's
`<backend>:d<N>t<T>`; local: ranks 0..M-1, servers after); colocated (allocation_mode with
'|') the servers take the ranks' GPUs, each with its share of the GPU's memory
(`rollout.gpu_memory_fraction`; the trainer keeps the rest).
On a CPU machine the local scheduler splits the cores between the servers and the trainer
(`scheduler.inference_threads` / `trainer_threads`, totals); under Ray and Slurm those two
keys are the cores of each server and of each rank.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

from asyncrl.agents.service import AgentClient
from asyncrl.api import Trainer
from asyncrl.api.cores import ENV as CORE_SHARE_ENV
from asyncrl.config import ExperimentConfig
from asyncrl.config.specfile import write_spec
from asyncrl.controller.placement import Placement
from asyncrl.controller.specs import (
    build_agent_spec,
    build_placement,
    build_trainer_spec,
    build_weight_update_spec,
)
from asyncrl.controller.weight_update import WeightUpdateClient
from asyncrl.launch.base import Scheduler, WorkerSpec
from asyncrl.launch.commands import LoraServing, inference_spec
from asyncrl.launch.local import LocalScheduler, rank_cores, split_cores
from asyncrl.models.hub import resolve_model_path
from asyncrl.observe.paths import RunPaths
from asyncrl.trainer.service import TrainingClient

logger = logging.getLogger(__name__)


def _ready() -> None:
    """The servers are healthy already."""


@dataclass
class Services:
    inference: list[str]  # the servers' addresses
    trainer: Trainer | None  # the training service's client; None: the trainer runs inline
    inference_key: str | None = None  # the servers' API key (set when they bind a node IP)
    agent: AgentClient | None = None  # the agent service's client; None: the proxy is inline
    router: str | None = None  # the router's address; None: clients route to `inference`
    weight_update: WeightUpdateClient | None = None  # None: the controller publishes
    # Waits until the inference servers are healthy (launch may return before they are).
    ready: Callable[[], None] = _ready
    # Trainer and servers lend each other this machine's cores (scheduler.share_cores).
    cores_shared: bool = False
    placement: Placement | None = None  # where each role runs (set by `launch`)


# The router, weight-update and agent services are light (HTTP, tokenising): they reserve no
# core (cpus=0: unpinned locally, a sliver of a CPU under Ray, one task's CPU under Slurm).


def weight_update_spec(spec_path: str, ranks: list[str], servers: list[str],
                       router: str | None, *, keys: dict[str, str | None],
                       local: bool) -> WorkerSpec:
    """The weight-update service (controller/weight_update.py) between `ranks` and the servers."""
    env = {name: key for name, key in keys.items() if key}
    return WorkerSpec(
        role="weight_update", count=1,
        command=[sys.executable, "-m", "asyncrl.controller.weight_update", "--spec",
                 spec_path, "--trainer", ",".join(ranks),
                 *(["--router", router] if router else ["--servers", ",".join(servers)]),
                 "--host", "{host}", "--port", "{port}"],
        env={**env, "PYTHONUNBUFFERED": "1"}, cpus=0, cores=[[]] if local else None)


def router_spec(cfg: ExperimentConfig, servers: list[str], *, inference_key: str | None,
                local: bool) -> WorkerSpec:
    """The router (inference/router.py) in front of `servers`, guarded by the servers' key."""
    r = cfg.rollout
    command = [sys.executable, "-m", "asyncrl.inference.router", "--backend", r.backend,
               "--servers", ",".join(servers), "--host", "{host}", "--port", "{port}",
               "--request-timeout", str(r.request_timeout),
               "--request-retries", str(r.request_retries),
               "--update-weights-timeout", str(r.update_weights_timeout)]
    if r.health_check_interval:
        command += ["--health-check-interval", str(r.health_check_interval)]
    return WorkerSpec(role="router", count=1, command=command,
                      env={"ASYNCRL_API_KEY": inference_key} if inference_key else {},
                      cpus=0, cores=[[]] if local else None)


def agent_spec(cfg: ExperimentConfig, spec_path: str, servers: list[str], *,
               admin_key: str, inference_key: str | None, local: bool,
               router: str | None = None) -> WorkerSpec:
    """The agent service (agents/service.py): the run's proxy in front of `servers` (or of
    the run's router, when there is one).

    Under the local scheduler it binds `agent.host`; elsewhere its node's address. A set
    `agent.port` is kept (clients of online training are told it), else one is picked."""
    env = {"ASYNCRL_ADMIN_KEY": admin_key, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    if inference_key is not None:
        env["ASYNCRL_API_KEY"] = inference_key
    return WorkerSpec(
        role="agent", count=1,
        command=[sys.executable, "-m", "asyncrl.agents.service", "--spec", spec_path,
                 *(["--router", router] if router else ["--servers", ",".join(servers)]),
                 "--host", cfg.agent.host if local else "{host}", "--port", "{port}"],
        env=env, cpus=0, port=cfg.agent.port or None, cores=[[]] if local else None)


def trainer_spec(cfg: ExperimentConfig, spec_path: str, *, api_key: str) -> WorkerSpec:
    """`fsdp:d<M>` training-service ranks reading their `TrainerSpec` file."""
    return WorkerSpec(
        role="trainer", count=cfg.trainer_world_size,
        command=[sys.executable, "-m", "asyncrl.trainer.service", "--spec", spec_path,
                 "--host", "{host}", "--port", "{port}", "--threads", "{cpus}"],
        env={"ASYNCRL_API_KEY": api_key, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"},
        cpus=cfg.scheduler.trainer_threads or 1,
        gpus=1 if cfg.cluster.n_gpus_per_node else 0, torch_distributed=True)


def launch(cfg: ExperimentConfig, paths: RunPaths, scheduler: Scheduler) -> Services:
    """Start the servers and (service mode) the trainer ranks; return once all are healthy."""
    world, n_servers = cfg.trainer_world_size, cfg.rollout.n_servers
    place = build_placement(cfg)  # checked before anything starts
    device = cfg.cluster.device
    local = isinstance(scheduler, LocalScheduler)
    service = place.trainer == "service"
    colocated = cfg.colocated
    extra = list(cfg.rollout.server_args)
    if cfg.rollout.backend == "vllm" and cfg.actor.weight_update_mode in ("broadcast", "ipc"):
        # vLLM's receive side: its NCCL group, or its CUDA IPC importer
        backend = {"broadcast": "nccl", "ipc": "ipc"}[cfg.actor.weight_update_mode]
        extra += ["--weight-transfer-config", f'{{"backend": "{backend}"}}']
    if cfg.rollout.backend == "sglang" and cfg.actor.routing_replay:
        extra += ["--enable-return-routed-experts"]  # each token's experts, for the trainer
    # Off the local machine the servers bind their node's address: they take a key.
    inference_key = None if local else secrets.token_hex(16)
    if inference_key is not None and cfg.rollout.backend != "local":
        extra += ["--api-key", inference_key]
    servers = inference_spec(
        cfg.rollout.backend, resolve_model_path(cfg.actor.path), cfg.local_engine,
        n_servers=n_servers, seed=cfg.seed, device=device,
        cpus=cfg.scheduler.inference_threads or 1, extra_args=extra,
        cache_dir=str(paths.logs / "vllm-cache"),
        gpu_memory_fraction=cfg.rollout.gpu_memory_fraction if device == "cuda" else None,
        tensor_parallel_size=cfg.server_tensor_size,
        expert_parallel_size=cfg.server_expert_size,
        lora=(LoraServing(cfg.actor.lora_rank, tuple(cfg.actor.target_modules))
              if cfg.actor.use_lora else None))
    if cfg.rollout.backend == "vllm" and cfg.actor.weight_update_mode == "ipc":
        # vLLM takes the IPC handles pickled (its HTTP form); the servers bind 127.0.0.1
        # (ipc needs the local scheduler), so only this machine's processes can send them.
        servers.env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    trainer_cores: list[int] = []
    if local:
        if device == "cpu":
            servers.cores, trainer_cores = split_cores(
                sorted(os.sched_getaffinity(0)), cfg.scheduler.inference_threads,
                cfg.scheduler.trainer_threads, n_servers)
        else:  # GPUs 0..M-1 train (inline: GPU 0); the servers take the next ones, or
            # colocated the same ones (server i beside ranks i*T..): T each (tensor parallel)
            servers.cores = [[] for _ in range(n_servers)]
            first, t = (0 if colocated else world), cfg.server_tensor_size
            servers.gpu_ids = [list(range(first + i * t, first + (i + 1) * t))
                               for i in range(n_servers)]
    if inference_key is not None and cfg.rollout.backend == "local":
        servers.env["ASYNCRL_API_KEY"] = inference_key
    shared = None  # the cores trainer and servers lend each other (scheduler.share_cores)
    if (isinstance(scheduler, LocalScheduler) and device == "cpu" and not service
            and cfg.rollout.backend == "local" and cfg.scheduler.share_cores):
        shared = sorted(os.sched_getaffinity(0))
        servers.affinity = shared
        servers.env[CORE_SHARE_ENV] = f"{scheduler.open_core_share()},{{index}}"
    # Alone with an inline trainer, the local servers start while the trainer loads; vLLM
    # and SGLang on a shared GPU first, as they size their KV cache from the memory free on
    # start (ours from the GPU's total).
    defer = (local and not service and place.router == "inline" and place.agent == "inline"
             and not (colocated and cfg.rollout.backend != "local"))
    if defer:
        assert isinstance(scheduler, LocalScheduler)
        workers = scheduler.create_workers(servers, wait=False)
    else:
        workers = scheduler.create_workers(servers)
    addresses = [w.address for w in workers]
    router = None
    if place.router == "service":
        [worker] = scheduler.create_workers(router_spec(
            cfg, addresses, inference_key=inference_key, local=local))
        router = worker.address
        logger.info("router: %s", router)
    agent = None
    if place.agent == "service":
        admin_key = cfg.agent.admin_key or secrets.token_hex(16)
        # The service takes the admin key from its environment, not from a file.
        agent_slice = build_agent_spec(cfg)
        spec_file = write_spec(replace(agent_slice, agent=replace(agent_slice.agent,
                                                                   admin_key=None)),
                               paths.spec("agent"))
        [worker] = scheduler.create_workers(agent_spec(
            cfg, str(spec_file), addresses, admin_key=admin_key,
            inference_key=inference_key, local=local, router=router))
        agent = AgentClient(worker.address, admin_key,
                            wait_timeout=cfg.rollout.server_wait_timeout)
        logger.info("agent service: %s", worker.address)
    if not service:
        if local:
            threads = scheduler.pin_trainer(trainer_cores, shared=shared)
            logger.info("trainer: inline, %d thread(s)%s", threads,
                        f", sharing cores {shared} on demand" if shared else "")
        ready = (lambda: scheduler.wait_workers(servers.role)) if defer else _ready
        return Services(addresses, None, inference_key, agent, router, ready=ready,
                        cores_shared=shared is not None, placement=place)
    key = secrets.token_hex(16)
    spec_file = write_spec(build_trainer_spec(cfg), paths.spec("trainer"))
    spec = trainer_spec(cfg, str(spec_file), api_key=key)
    if local:
        spec.cores = (rank_cores(trainer_cores, world) if device == "cpu"
                      else [[] for _ in range(world)])
        spec.gpu_ids = [[r] for r in range(world)] if device == "cuda" else None
    ranks = [w.address for w in scheduler.create_workers(spec)]
    logger.info("trainer: %d rank(s) at %s", world, ", ".join(ranks))
    weights = None
    if place.weight_update == "service":
        weights_key = secrets.token_hex(16)
        spec_file = write_spec(build_weight_update_spec(cfg, paths.weights),
                               paths.spec("weight_update"))
        [worker] = scheduler.create_workers(weight_update_spec(
            str(spec_file), ranks, addresses, router, local=local,
            keys={"ASYNCRL_API_KEY": weights_key, "ASYNCRL_TRAINER_KEY": key,
                  "ASYNCRL_INFERENCE_KEY": inference_key}))
        weights = WeightUpdateClient(worker.address, api_key=weights_key,
                                     timeout=cfg.scheduler.trainer_timeout)
        logger.info("weight update: %s", worker.address)
    return Services(addresses, TrainingClient(ranks, api_key=key,
                                              timeout=cfg.scheduler.trainer_timeout),
                    inference_key, agent, router, weights, placement=place)
