"""The `ray` scheduler: the same commands, each started by a small Ray actor on its node.

Each role gets one placement group (a bundle of {CPU, GPU, memory} per worker): trainer
ranks (torch_distributed) PACK onto as few nodes as fit, other roles SPREAD. In each
bundle an actor picks a free port on its node, starts the command as a subprocess (log
under <run_dir>/logs/, shared storage on a cluster) and reports host, port, pid and Ray
node id. The driver polls health over HTTP. Workers are grouped by node id, not by IP:
several Ray nodes may share an address (a test cluster, containers).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncrl.config.schema import SchedulerConfig
from asyncrl.launch import process
from asyncrl.launch.base import (
    SchedulerError,
    Worker,
    WorkerSpec,
    free_port,
    health_ok,
    log_tail,
    port_is_free,
    torch_env,
    wait_healthy,
    write_registry,
)

logger = logging.getLogger(__name__)


class WorkerActor:
    """Runs in a Ray actor: starts and stops one worker process on the actor's node."""

    def __init__(self, log_path: str) -> None:
        self.log_path = log_path
        self.proc = None

    def node(self) -> tuple[str, str, str]:
        """(Ray node id, node IP, hostname)."""
        return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
                socket.gethostname())

    def free_port(self) -> int:
        return free_port(ray.util.get_node_ip_address())

    def start(self, spec: WorkerSpec, index: int, env: dict[str, str],
              port: int | None = None) -> tuple[str, int, int]:
        """Start worker `index` of `spec` (on `port` if free); returns (host, port, pid)."""
        host = ray.util.get_node_ip_address()
        if port is None or not port_is_free(host, port):
            port = spec.pick_port(host)
        cores = sorted(os.sched_getaffinity(0))
        values = {"host": host, "port": str(port), "index": str(index),
                  "cpus": str(spec.cpus), "cores": ",".join(map(str, cores))}
        full_env = dict(os.environ)
        if spec.cpus:
            full_env["OMP_NUM_THREADS"] = str(spec.cpus)
        if spec.gpus:
            full_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ray.get_gpu_ids()))
        full_env.update(env)
        full_env.update(spec.environment(values))
        self.proc = process.spawn(spec.argv(index, values), full_env, self.log_path)
        return host, port, self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None:
            process.stop([self.proc], timeout)

    def log_tail(self, n: int = 30) -> str:
        return log_tail(self.log_path, n)


@dataclass
class _Role:
    spec: WorkerSpec
    group: PlacementGroup
    actors: list[Any] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)
    env: list[dict[str, str]] = field(default_factory=list)  # rank variables per worker


class RayScheduler:
    """Starts, watches and stops the workers of one run as Ray actors' subprocesses."""

    def __init__(self, cfg: SchedulerConfig, run_dir: Path, *, address: str | None = None,
                 n_nodes: int = 1, n_gpus_per_node: int = 0,
                 init_kwargs: dict[str, Any] | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.log_dir = self.run_dir / "logs"
        self.n_nodes, self.n_gpus_per_node = n_nodes, n_gpus_per_node
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:  # else: the caller connected already (a test cluster, a notebook)
            ray.init(address=address, **(init_kwargs or {}))
        self._actor = ray.remote(WorkerActor)
        self.roles: dict[str, _Role] = {}

    def __enter__(self) -> RayScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create_workers(self, spec: WorkerSpec) -> list[Worker]:
        """Place `spec.count` bundles, start a worker in each; return them once healthy."""
        if spec.role in self.roles:
            raise SchedulerError(f"role {spec.role!r} already has workers; delete them first")
        self._check_fits(spec)
        bundle = _bundle(spec)
        group = placement_group([dict(bundle) for _ in range(spec.count)],
                                strategy="PACK" if spec.torch_distributed else "SPREAD",
                                name=f"asyncrl-{spec.role}-{uuid.uuid4().hex[:8]}")
        role = self.roles[spec.role] = _Role(spec, group)
        try:
            try:
                ray.get(group.ready(), timeout=self.cfg.startup_timeout)
            except GetTimeoutError:
                raise SchedulerError(
                    f"Ray could not place {spec.count} x {bundle} for role {spec.role!r} within "
                    f"scheduler.startup_timeout={self.cfg.startup_timeout} s; the cluster has "
                    f"{ray.cluster_resources()}") from None
            role.actors = [self._new_actor(role, i) for i in range(spec.count)]
            nodes = ray.get([a.node.remote() for a in role.actors])
            role.env = [{} for _ in nodes]
            if spec.torch_distributed:
                master_port = ray.get(role.actors[0].free_port.remote())
                role.env = [torch_env(r, [n[0] for n in nodes], nodes[0][1], master_port)
                            for r in range(spec.count)]
            started = ray.get([a.start.remote(spec, i, role.env[i])
                               for i, a in enumerate(role.actors)])
            role.workers = [_worker(spec.role, i, node, *where, self._log_path(spec.role, i))
                            for i, (node, where) in enumerate(zip(nodes, started))]
            self._wait_healthy(role, role.workers)
        except BaseException:
            self.delete_workers(spec.role)
            raise
        self._write_registry()
        return list(role.workers)

    def get_workers(self, role: str) -> list[Worker]:
        return list(self.roles[role].workers) if role in self.roles else []

    def check_health(self, role: str) -> list[bool]:
        r = self.roles[role]
        path = r.spec.health_path
        return [_poll(a) is None and (path is None or health_ok(w.address, path))
                for a, w in zip(r.actors, r.workers)]

    def restart_worker(self, role: str, index: int) -> Worker:
        """Stop worker `index` and start it again in its actor (a new one if the actor died)."""
        r = self.roles[role]
        old = r.workers[index]
        try:
            ray.get(r.actors[index].stop.remote())
        except RayActorError:
            r.actors[index] = self._new_actor(r, index)
        actor = r.actors[index]
        node = ray.get(actor.node.remote())
        where = ray.get(actor.start.remote(r.spec, index, r.env[index], old.port))
        r.workers[index] = _worker(role, index, node, *where, old.log_path)
        self._wait_healthy(r, [r.workers[index]])
        self._write_registry()
        return r.workers[index]

    def delete_workers(self, role: str | None = None, timeout: float = 10.0) -> None:
        """Stop the processes, then kill their actors and remove the placement groups."""
        names = [n for n in self.roles if role is None or n == role]
        if not names:
            return
        roles = [self.roles.pop(n) for n in names]
        stops = [a.stop.remote(timeout) for r in roles for a in r.actors]
        try:
            ray.get(stops, timeout=timeout + 10)
        except (RayActorError, GetTimeoutError) as err:
            logger.warning("stopping workers of %s: %s", names, err)
        for r in roles:
            for actor in r.actors:
                ray.kill(actor)  # its process dies with it (PR_SET_PDEATHSIG)
            remove_placement_group(r.group)
        self._write_registry()

    def close(self) -> None:
        """Stop every worker; disconnect from Ray if this scheduler connected."""
        if ray.is_initialized():
            self.delete_workers(None)
            if self._owns_ray:
                ray.shutdown()

    def _new_actor(self, role: _Role, index: int) -> Any:
        bundle = _bundle(role.spec)
        return self._actor.options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
            memory=bundle.get("memory"), max_concurrency=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                role.group, placement_group_bundle_index=index),
        ).remote(str(self._log_path(role.spec.role, index)))

    def _log_path(self, role: str, index: int) -> Path:
        return self.log_dir / f"{role}-{index}.log"

    def _wait_healthy(self, role: _Role, workers: list[Worker]) -> None:
        def exited(w: Worker) -> str | None:
            code = _poll(role.actors[w.index])
            return None if code is None else f"exited ({code}) on node {w.node_id}"

        wait_healthy(workers, health_path=role.spec.health_path,
                     timeout=self.cfg.startup_timeout, exited=exited,
                     tail=lambda w: _tail(role.actors[w.index], w.log_path))

    def _check_fits(self, spec: WorkerSpec) -> None:
        """The cluster config must hold the role (Ray would otherwise wait until the timeout)."""
        if not self.n_gpus_per_node or not spec.gpus:
            return
        if spec.gpus > self.n_gpus_per_node:
            raise SchedulerError(f"role {spec.role!r} asks for {spec.gpus} GPUs per worker but "
                                 f"cluster.n_gpus_per_node={self.n_gpus_per_node}")
        capacity = self.n_nodes * (self.n_gpus_per_node // spec.gpus)
        if spec.count > capacity:
            raise SchedulerError(f"role {spec.role!r}: {spec.count} workers x {spec.gpus} GPUs "
                                 f"do not fit cluster.n_nodes={self.n_nodes} x "
                                 f"n_gpus_per_node={self.n_gpus_per_node}")

    def _write_registry(self) -> None:
        workers = [w for r in self.roles.values() for w in r.workers]
        write_registry(self.run_dir, "ray", workers,
                       ray_address=ray.get_runtime_context().gcs_address)


def _poll(actor: Any) -> str | None:
    """The worker's exit code, "actor died", or None while it runs."""
    try:
        code = ray.get(actor.poll.remote())
    except RayActorError:
        return "actor died"
    return None if code is None else f"code {code}"


def _tail(actor: Any, log_path: str) -> str:
    """The log's end, read on the worker's node (here if its actor is gone: shared storage)."""
    try:
        return ray.get(actor.log_tail.remote())
    except RayActorError:
        return log_tail(log_path)


_LIGHT_MEMORY = float(64 << 20)  # bytes a worker asking no resource reserves


def _bundle(spec: WorkerSpec) -> dict[str, float]:
    """One worker's resources. Ray needs some per bundle, so a worker asking none (a light
    service: router, weight update, agent proxy) reserves 64 MiB of memory, which fits
    beside workers that hold every CPU of a node."""
    bundle = {"CPU": float(spec.cpus), "GPU": float(spec.gpus),
              "memory": float(spec.memory_gb * 2**30)}
    return {k: v for k, v in bundle.items() if v} or {"memory": _LIGHT_MEMORY}


def _worker(role: str, index: int, node: tuple[str, str, str], host: str, port: int, pid: int,
            log_path: str | Path) -> Worker:
    node_id, _, hostname = node
    return Worker(role=role, index=index, host=host, port=port, address=f"http://{host}:{port}",
                  node_id=node_id, pid=pid, log_path=str(log_path), hostname=hostname)
