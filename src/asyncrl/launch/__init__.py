"""Schedulers: start, watch and stop the processes of a run (local | ray | slurm)."""

from pathlib import Path
from typing import Any

from asyncrl.launch.base import (
    Scheduler,
    SchedulerError,
    Worker,
    WorkerSpec,
    read_registry,
)
from asyncrl.launch.commands import inference_spec, server_command
from asyncrl.launch.local import LocalScheduler, split_cores
from asyncrl.launch.slurm import SlurmScheduler

__all__ = ["LocalScheduler", "Scheduler", "SchedulerError", "Worker", "WorkerSpec",
           "inference_spec", "make_scheduler", "read_registry", "server_command", "split_cores"]


def make_scheduler(scheduler_cfg: Any, cluster_cfg: Any, run_dir: Path, *,
                   ray_cfg: Any = None, slurm_cfg: Any = None, **kw: Any) -> Scheduler:
    """The scheduler `scheduler_cfg.type` names (local | ray | slurm) for the run in `run_dir`.

    `ray_cfg` (the `ray` section: address; None starts Ray here) and `slurm_cfg` (the
    `slurm` section: partition, account, time, extra_sbatch_args) configure those two;
    `kw` goes to the scheduler's constructor.
    """
    kind = scheduler_cfg.type
    if kind == "local":
        return LocalScheduler(scheduler_cfg, run_dir, **kw)
    nodes = {"n_nodes": cluster_cfg.n_nodes, "n_gpus_per_node": cluster_cfg.n_gpus_per_node}
    if kind == "ray":
        from asyncrl.launch.ray import (
            RayScheduler,  # ray: optional and heavy, loaded if asked
        )

        kw.setdefault("address", getattr(ray_cfg, "address", None))
        return RayScheduler(scheduler_cfg, run_dir, **nodes, **kw)
    if kind == "slurm":
        if slurm_cfg is not None:
            kw = {"partition": slurm_cfg.partition, "account": slurm_cfg.account,
                  "time_limit": slurm_cfg.time, "sbatch_args": slurm_cfg.extra_sbatch_args,
                  **kw}
        return SlurmScheduler(scheduler_cfg, run_dir, **nodes, **kw)
    raise ValueError(f"scheduler.type={kind!r} is not one of 'local', 'ray', 'slurm'")
