"""Contracts shared by every package: typed data and the engine/workflow/reward protocols."""

from asyncrl.api.errors import InferenceError
from asyncrl.api.protocols import (
    InferenceEngine,
    LossFn,
    RewardFn,
    TrainEngine,
    Trainer,
    Workflow,
)
from asyncrl.api.types import (
    Batch,
    GenerationRequest,
    GenerationResponse,
    SamplingParams,
    StopReason,
    TensorBatch,
    Trajectory,
)

__all__ = [
    "Batch", "GenerationRequest", "GenerationResponse", "InferenceEngine", "InferenceError", "LossFn", "RewardFn",
    "SamplingParams", "StopReason", "TensorBatch", "TrainEngine", "Trainer", "Trajectory",
    "Workflow",
]
