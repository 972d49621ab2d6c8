"""PPO's critic in the RL loop: its engine, loss and minibatches, behind three calls."""

from __future__ import annotations

import torch

from asyncrl.algorithms import make_value_loss_fn, value_stats
from asyncrl.api import TensorBatch
from asyncrl.config import CriticConfig, ExperimentConfig
from asyncrl.training import FSDPValueEngine, split_minibatches


class Critic:
    """The value model: values before the actor's update, then its own minibatch steps."""

    def __init__(self, cfg: CriticConfig, *, total_steps: int, seed: int) -> None:
        self.n_minibatches = cfg.ppo_n_minibatches or 1
        # The schedule counts optimiser steps: one per minibatch.
        self.engine = FSDPValueEngine(cfg, total_steps=total_steps * self.n_minibatches,
                                      seed=seed)
        self.loss_fn = make_value_loss_fn(cfg)

    @classmethod
    def from_config(cls, cfg: ExperimentConfig, total_steps: int) -> Critic | None:
        """The initialised critic `cfg.critic` describes; None without one."""
        if cfg.critic is None:
            return None
        critic = cls(cfg.critic, total_steps=total_steps, seed=cfg.seed)
        critic.engine.initialize()
        return critic

    def compute_values(self, batch: TensorBatch) -> torch.Tensor:
        """V [B, T] under the current critic, token-aligned like the log-probs."""
        return self.engine.compute_values(batch)

    def train(self, batch: TensorBatch) -> dict[str, float]:
        """Steps towards `batch.returns`; `critic/` stats (the last minibatch's, value stats)."""
        stats = value_stats(batch)  # of the values the advantages used (before this update)
        for minibatch in split_minibatches(batch, self.n_minibatches):
            step_stats = self.engine.train_batch(minibatch, self.loss_fn)
        return {f"critic/{k}": v for k, v in (step_stats | stats).items()}
