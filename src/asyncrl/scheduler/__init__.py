"""Schedulers: start, watch and stop the processes of a run."""

from asyncrl.scheduler.local import LocalScheduler, SchedulerError, split_cores

__all__ = ["LocalScheduler", "SchedulerError", "split_cores"]
