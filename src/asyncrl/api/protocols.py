"""The extension points: each is a small protocol with one job."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from asyncrl.api.types import GenerationRequest, GenerationResponse, TensorBatch, Trajectory


@runtime_checkable
class InferenceEngine(Protocol):
    """What the rollout side sees of the inference servers (an HTTP client in practice)."""

    async def agenerate(self, req: GenerationRequest) -> GenerationResponse:
        """Generate one completion; tokens carry the weight version that produced them."""
        ...

    async def pause(self) -> None:
        """Stop scheduling decode steps on every server; requests in flight are kept."""
        ...

    async def resume(self) -> None:
        ...

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        """Load the safetensors folder `path` as weight version `version` on every server."""
        ...

    async def close(self) -> None:
        ...


class LossFn(Protocol):
    """A training loss over one micro-batch.

    `logprobs` are the current policy's log-probs, token-aligned with `mb.input_ids`.
    The returned loss must already be divided by the whole batch's normaliser
    (`n_tokens` loss tokens, `n_seqs` sequences), so summing micro-batch gradients
    gives the gradient of the batch loss.
    """

    def __call__(self, logprobs: torch.Tensor, mb: TensorBatch, *, n_tokens: int,
                 n_seqs: int) -> tuple[torch.Tensor, dict[str, float]]: ...


@runtime_checkable
class TrainEngine(Protocol):
    """A trainable policy: log-probs, one optimiser step over a batch, saving."""

    def compute_logprobs(self, batch: TensorBatch) -> torch.Tensor:
        """Token-aligned log-probs [B, T] of `batch.input_ids` under the current weights."""
        ...

    def train_batch(self, batch: TensorBatch, loss_fn: LossFn) -> dict[str, float]:
        """Accumulate `loss_fn` over micro-batches, clip, step the optimiser and schedule."""
        ...

    def save_hf(self, path: str) -> None:
        """Write the weights (safetensors) and config in HF format to `path`."""
        ...

    def save_state(self, path: str) -> None:
        """Model, optimiser and scheduler state for exact resume."""
        ...

    def load_state(self, path: str) -> None:
        ...


class Trainer(Protocol):
    """The controller's handle on the trainer ranks of RL (in process or a service's).

    Every call is a step of all ranks together; each returns rank 0's answer.
    """

    def initialize(self, total_steps: int) -> dict[str, int]:
        """Load and shard the models; `total_steps` RL steps size the lr schedules."""
        ...

    def train(self, tb: TensorBatch) -> dict[str, float]:
        """One RL step (log-probs, advantages, optimiser steps); its stats."""
        ...

    def compute_logprobs(self, tb: TensorBatch) -> torch.Tensor:
        ...

    def save_hf(self, path: str, dtype: torch.dtype | None = None, *,
                with_critic: bool = False) -> None:
        """The policy as an HF folder (weights in `dtype`, default the master fp32; with
        actor.use_lora, PEFT's folder of the adapters alone); with
        `with_critic`, the critic's (if any) beside it as `<path>_critic`. `path` may hold
        an earlier save of the same model (the disk weight publisher reuses a pruned
        version's folder): its files are written over."""
        ...

    def save_state(self, path: str) -> None:
        ...

    def load_state(self, path: str) -> None:
        ...

    def weight_sender(self, backend: str, dtype: str) -> tuple[Any, str]:
        """Broadcast sync: the trainer side (`weights.broadcast.WeightSender`'s interface)
        and the host of rank 0, where the group's rendezvous is."""
        ...

    def destroy(self) -> None:
        ...


@runtime_checkable
class Workflow(Protocol):
    """One episode: from a dataset item to a group of trajectories (or None to reject it)."""

    async def run(self, engine: InferenceEngine, item: dict[str, Any]) -> list[Trajectory] | None:
        ...


class RewardFn(Protocol):
    """Score one completion. Raise on failure: a failure is reported, never scored 0.
    A (value, info) pair adds a JSON-serialisable record of how the value was computed,
    which the workflow keeps in the trajectory's meta as "reward_info"."""

    def __call__(self, completion: str,
                 item: dict[str, Any]) -> float | tuple[float, dict[str, Any]]: ...

