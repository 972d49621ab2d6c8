"""What one trainer rank runs in RL: the actor, its frozen and critic companions, the step.

`RLWorker` is built from a `TrainerSpec`, the part of the run's config a rank reads (the
controller builds it, and writes it to a file for the training service's ranks). Its
`train(batch)` is the algorithm's whole step on a collated batch: proximal log-probs (or
none when the training forward gives them), reference and teacher log-probs, critic
values, advantages and returns, the actor's optimiser steps, the critic's. Every rank of
a data-parallel world calls the same methods in the same order with the same full batch
(each engine takes its own rows), so the controller can drive one rank in its own process
(`scheduler.trainer=inline`) or N rank processes through the training service
(`trainer/service.py`) the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from asyncrl.algorithms import (
    compute_advantages_and_returns,
    make_ppo_loss_fn,
    mean_token_kl,
    with_distillation,
)
from asyncrl.algorithms.advantages import in_reward_kl_logprobs
from asyncrl.api.types import TensorBatch
from asyncrl.config import ActorConfig, CriticConfig, RefConfig, TeacherConfig
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.models.hub import resolve_model_path
from asyncrl.trainer.critic import Critic
from asyncrl.trainer.dist import local_device
from asyncrl.trainer.engine import FSDPTrainEngine
from asyncrl.trainer.frozen import (
    LoraBase,
    check_teacher_vocab,
    make_ref_engine,
    make_teacher_engine,
)
from asyncrl.trainer.updates import train_epochs
from asyncrl.weights.broadcast import WeightSender
from asyncrl.weights.ipc import IpcExporter, IpcUnavailable

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TrainerSpec:
    """What one trainer rank reads of the run's config."""

    actor: ActorConfig
    ref: RefConfig  # loaded only when actor.kl_ctl > 0
    teacher: TeacherConfig  # loaded only when actor.distill_coef > 0
    critic: CriticConfig | None  # PPO's value model; None: no critic
    seed: int  # random initial weights (init_from_scratch, a critic's head)
    device: Literal["cpu", "cuda"]  # cluster.device
    tokenizer_path: str  # the actor's tokenizer (the teacher's vocabulary is checked against it)
    # The share of its GPU's memory the rank may take (a colocated server has the rest);
    # None: no cap.
    gpu_memory_fraction: float | None
    # cluster.fileroot as configured: the training service writes and reads only under it.
    fileroot: str


class RLWorker:
    """One trainer rank of the PPO family: engines from `spec`, one `train` call per batch."""

    def __init__(self, spec: TrainerSpec) -> None:
        self.spec = spec
        self.actor: FSDPTrainEngine | None = None
        self.ref: FSDPTrainEngine | LoraBase | None = None
        self.teacher: FSDPTrainEngine | None = None
        self.critic = None  # trainer.critic.Critic when spec.critic is set
        self._ipc = None  # weights.ipc.IpcExporter, made by the first ipc_weights
        actor = spec.actor
        # One optimiser step per batch: the proximal log-probs come from the training forward.
        self.prox_in_loss = actor.recompute_logprob and actor.updates_per_batch == 1
        self.loss_fn = with_distillation(
            make_ppo_loss_fn(actor, prox_is_current=self.prox_in_loss), actor)

    def initialize(self, total_steps: int) -> dict[str, int]:
        """Load and shard every model; `total_steps` RL steps size the lr schedules.

        A collective on a data-parallel world: every rank calls it. Returns rank and world.
        """
        from transformers import AutoTokenizer

        spec = self.spec
        if self.actor is not None:  # initialised again (a controller that reconnects): free
            self.destroy()  # the old engines, and the process group the old actor made
        if spec.gpu_memory_fraction is not None and spec.device == "cuda":
            # The GPU's other share is the colocated server's (rollout.gpu_memory_fraction):
            # past it this rank's allocator fails here rather than starve the server.
            torch.cuda.set_per_process_memory_fraction(spec.gpu_memory_fraction,
                                                       local_device(spec.device))
        # The lr schedule counts optimiser steps: several per batch with minibatches or epochs.
        self.actor = FSDPTrainEngine(TrainEngineSpec.of(spec.actor, device=spec.device),
                                     seed=spec.seed,
                                     total_steps=total_steps * spec.actor.updates_per_batch)
        self.actor.initialize()
        self.ref = make_ref_engine(spec.actor, spec.ref, seed=spec.seed, device=spec.device,
                                   actor_engine=self.actor)
        if self.ref is not None:
            self.ref.initialize()
        self.teacher = make_teacher_engine(spec.actor, spec.teacher, seed=spec.seed,
                                           device=spec.device)
        if self.teacher is not None:
            self.teacher.initialize()
            tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(spec.tokenizer_path))
            check_teacher_vocab(tokenizer, self.teacher)
        self.critic = Critic.from_config(spec.critic, total_steps=total_steps, seed=spec.seed,
                                         device=spec.device, epochs=spec.actor.ppo_epochs)
        return {"rank": self.actor.rank, "world_size": self.actor.world_size}

    def _require_actor(self) -> FSDPTrainEngine:
        if self.actor is None:
            raise RuntimeError("RLWorker is not initialised; call initialize(total_steps) first")
        return self.actor

    def train(self, tb: TensorBatch) -> dict[str, float]:
        """One RL step on `tb`: log-probs, advantages, the optimiser steps; `train/` stats."""
        actor, cfg = self._require_actor(), self.spec.actor
        if cfg.recompute_logprob and not self.prox_in_loss:
            tb.prox_logprobs = actor.compute_logprobs(tb)
        if self.ref is not None:
            tb.ref_logprobs = self.ref.compute_logprobs(tb)
        if self.teacher is not None:
            tb.teacher_logprobs = self.teacher.compute_logprobs(tb)
        if self.critic is not None:
            tb.values = self.critic.compute_values(tb)
        tb.advantages, tb.returns = compute_advantages_and_returns(tb, cfg)
        stats = train_epochs(actor, tb, self.loss_fn, n_minibatches=cfg.ppo_n_minibatches,
                             epochs=cfg.ppo_epochs)
        if self.ref is not None and not cfg.use_kl_loss:
            # The in-reward KL is not in the loss: report the one the advantages used.
            stats["kl_ref"] = mean_token_kl(tb, in_reward_kl_logprobs(tb), cfg.kl_estimator)
        critic_stats = self.critic.train(tb) if self.critic is not None else {}
        return {f"train/{k}": v for k, v in stats.items()} | critic_stats

    def compute_logprobs(self, tb: TensorBatch) -> torch.Tensor:
        """The actor's token log-probs [B, T] under its current weights."""
        return self._require_actor().compute_logprobs(tb)

    def save_hf(self, path: str, dtype: torch.dtype | None = None, *,
                with_critic: bool = False) -> None:
        """The actor as an HF folder at `path`; `with_critic`: the critic's too, if there is
        one, beside it as `<path>_critic`."""
        self._require_actor().save_hf(path, dtype=dtype)
        if with_critic and self.critic is not None:
            self.critic.engine.save_hf(f"{path}_critic")

    def hf_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The actor's full weights under HF names on rank 0 (a collective; broadcast sync)."""
        return self._require_actor().hf_state_dict(dtype)

    def ipc_weights(self, dtype: str) -> dict[str, Any]:
        """The actor's weights in `dtype` in one GPU buffer shared by CUDA IPC: the body of a
        server's IPC update (weights/ipc.py). The buffer is rewritten by the next call, so
        every server must have copied it by then (the publish waits for them)."""
        actor = self._require_actor()
        if actor.device.type != "cuda":
            raise IpcUnavailable(f"this trainer rank runs on {actor.device}: CUDA IPC shares "
                                 "GPU memory; use actor.weight_update_mode=disk")
        if self._ipc is None:
            self._ipc = IpcExporter()
        return self._ipc.export(actor.device_state_dict(getattr(torch, dtype)))

    def weight_sender(self, backend: str, dtype: str) -> tuple[Any, str]:
        """The broadcast's trainer side in this process (rank 0), and its host."""
        return WeightSender(0, backend=backend, dtype=getattr(torch, dtype)), "127.0.0.1"

    def save_state(self, path: str) -> None:
        """Everything an exact resume needs: `<path>/actor` (and `<path>/critic`)."""
        self._require_actor().save_state(str(Path(path) / "actor"))
        if self.critic is not None:
            self.critic.engine.save_state(str(Path(path) / "critic"))

    def load_state(self, path: str) -> None:
        """Restore what `save_state` wrote."""
        root = Path(path)
        if self.critic is not None and not (root / "critic").is_dir():
            raise FileNotFoundError(f"the recover checkpoint in {root} has no critic "
                                    "state (it was written by a run without `critic`); start a "
                                    "fresh trial or drop the critic section")
        self._require_actor().load_state(str(root / "actor"))
        if self.critic is not None:
            self.critic.engine.load_state(str(root / "critic"))

    def info(self) -> dict[str, Any]:
        actor = self._require_actor()
        return {"rank": actor.rank, "world_size": actor.world_size,
                "steps_done": actor.steps_done}

    def destroy(self) -> None:
        """Free every engine; the actor last, as it owns the process group."""
        if self._ipc is not None:
            self._ipc.close()
        critic = self.critic.engine if self.critic is not None else None
        for engine in (self.ref, self.teacher, critic):
            if engine is not None:
                engine.destroy()
        if self.actor is not None:
            self.actor.destroy()
        self.actor = self.ref = self.teacher = self.critic = None
