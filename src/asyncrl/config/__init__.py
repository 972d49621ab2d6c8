"""Typed configuration: dataclasses per component, YAML + key=value loading."""

from asyncrl.config.loader import ConfigError, load_config, to_yaml
from asyncrl.config.schema import (
    ActorConfig,
    CriticConfig,
    DatasetConfig,
    ExperimentConfig,
    GenerationConfig,
    LocalEngineConfig,
    MicroBatchSpec,
    NormConfig,
    OptimizerConfig,
    RefConfig,
    RolloutConfig,
    TeacherConfig,
    WorkflowConfig,
)

__all__ = [
    "ActorConfig", "ConfigError", "CriticConfig", "DatasetConfig", "ExperimentConfig",
    "GenerationConfig", "LocalEngineConfig", "MicroBatchSpec", "NormConfig", "OptimizerConfig",
    "RefConfig", "RolloutConfig", "TeacherConfig", "WorkflowConfig", "load_config", "to_yaml",
]
