"""Schedulers: start, watch and stop the processes of a run (local | ray | slurm)."""

from asyncrl.launch.base import (
    Scheduler,
    SchedulerError,
    Worker,
    WorkerSpec,
    make_scheduler,
    read_registry,
)
from asyncrl.launch.commands import inference_spec, server_command
from asyncrl.launch.local import LocalScheduler, split_cores

__all__ = ["LocalScheduler", "Scheduler", "SchedulerError", "Worker", "WorkerSpec",
           "inference_spec", "make_scheduler", "read_registry", "server_command", "split_cores"]
