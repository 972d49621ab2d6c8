"""Rollout: the staleness bound and the controller that runs episodes asynchronously."""

from asyncrl.controller.rollout.controller import (
           Episode,
           RolloutController,
           RolloutError,
)
from asyncrl.controller.rollout.evaluate import evaluate
from asyncrl.controller.rollout.filters import has_reward_signal, make_episode_filter
from asyncrl.controller.rollout.staleness import StalenessManager

__all__ = ["Episode", "RolloutController", "RolloutError", "StalenessManager", "evaluate",
           "has_reward_signal", "make_episode_filter"]
