"""PPO's critic in the RL loop: its engine, loss and minibatches, behind three calls."""

from __future__ import annotations

import torch

from asyncrl.algorithms import make_value_loss_fn, value_stats
from asyncrl.api import TensorBatch
from asyncrl.config import CriticConfig
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.trainer import FSDPValueEngine, train_epochs


class Critic:
    """The value model: values before the actor's update, then its own minibatch steps."""

    def __init__(self, cfg: CriticConfig, *, total_steps: int, seed: int, device: str,
                 epochs: int = 1) -> None:
        self.n_minibatches = cfg.ppo_n_minibatches or 1
        self.epochs = epochs  # the actor's ppo_epochs: both pass over the batch alike
        # The schedule counts optimiser steps: one per minibatch and epoch.
        self.engine = FSDPValueEngine(TrainEngineSpec.of(cfg, device=device),
                                      total_steps=total_steps * self.n_minibatches * epochs,
                                      seed=seed)
        self.loss_fn = make_value_loss_fn(cfg)

    @classmethod
    def from_config(cls, cfg: CriticConfig | None, *, total_steps: int, seed: int,
                    device: str, epochs: int = 1) -> Critic | None:
        """The initialised critic `cfg` (the `critic` section) describes; None without one."""
        if cfg is None:
            return None
        critic = cls(cfg, total_steps=total_steps, seed=seed, device=device, epochs=epochs)
        critic.engine.initialize()
        return critic

    def compute_values(self, batch: TensorBatch) -> torch.Tensor:
        """V [B, T] under the current critic, token-aligned like the log-probs."""
        return self.engine.compute_values(batch)

    def train(self, batch: TensorBatch) -> dict[str, float]:
        """Steps towards `batch.returns`; `critic/` stats (merged over steps, value stats)."""
        stats = value_stats(batch)  # of the values the advantages used (before this update)
        step_stats = train_epochs(self.engine, batch, self.loss_fn,
                                  n_minibatches=self.n_minibatches, epochs=self.epochs)
        return {f"critic/{k}": v for k, v in (step_stats | stats).items()}
