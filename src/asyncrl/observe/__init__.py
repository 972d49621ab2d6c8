"""Observability: stats loggers, progress bar, plots."""

from asyncrl.observe.plot import plot_reward_curve
from asyncrl.observe.progress import ProgressBar
from asyncrl.observe.stats import StatsLogger, read_stats, write_samples
from asyncrl.observe.timing import StepTimer

__all__ = ["ProgressBar", "StatsLogger", "StepTimer", "plot_reward_curve", "read_stats",
           "write_samples"]
