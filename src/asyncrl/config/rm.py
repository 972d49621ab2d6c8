"""The reward-model trainer's config (`asyncrl rm`): Bradley-Terry on preference pairs.

Keys mirror the offline trainers' (`model`, `train_dataset`, `valid_dataset`, `evaluator`,
AReaL's names) so one YAML shape serves SFT, DPO and RM. Load it with
`load_config(path, overrides, schema=RMConfig)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from asyncrl.config.offline import (
    OfflineEvaluatorConfig,
    OfflineSchedulerConfig,
    TrainEngineConfig,
)
from asyncrl.config.schema import ClusterConfig, StatsLoggerConfig, _check

# The reward model's section is the offline trainers' model section: `path`'s decoder,
# here under a fresh scalar head (seeded by `seed`). Evaluator and scheduler likewise.
RMModelConfig = TrainEngineConfig
RMEvaluatorConfig = OfflineEvaluatorConfig
RMSchedulerConfig = OfflineSchedulerConfig


@dataclass(kw_only=True)
class PreferenceDatasetConfig:
    # A JSONL file of {"prompt", "chosen", "rejected"} rows: strings (one user turn, one
    # assistant turn) or chat message lists (chosen/rejected may then hold the prompt too).
    path: str = ""
    batch_size: int = 8  # pairs per optimiser step (or per evaluation forward)
    shuffle: bool = True  # reshuffled every epoch from (seed, epoch)
    max_length: Optional[int] = None  # pairs with a side longer than this (tokens) are dropped
    size: Optional[int] = None  # keep the first `size` rows

    def check(self, name: str) -> None:
        """Raise naming `<name>.<key>` if a value is out of range."""
        _check(bool(self.path), f"{name}.path is empty: give a JSONL file of "
               "prompt/chosen/rejected rows")
        _check(self.batch_size >= 1, f"{name}.batch_size must be >= 1, got {self.batch_size}")
        _check(self.size is None or self.size >= 1,
               f"{name}.size must be >= 1 or null (all rows), got {self.size}")
        _check(self.max_length is None or self.max_length >= 2,
               f"{name}.max_length must be >= 2 tokens or null, got {self.max_length}")


@dataclass(kw_only=True)
class RMConfig:
    """Reward-model training: -log sigmoid(r_chosen - r_rejected), mean over pairs."""

    experiment_name: str = "asyncrl-rm"
    trial_name: str = "trial0"
    seed: int = 1  # the head's initial weights and the shuffling of the data
    total_train_epochs: int = 1
    total_train_steps: Optional[int] = None  # stop earlier than the epochs allow
    tokenizer_path: str = "${model.path}"
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    scheduler: RMSchedulerConfig = field(default_factory=RMSchedulerConfig)
    model: RMModelConfig = field(default_factory=RMModelConfig)
    train_dataset: PreferenceDatasetConfig = field(default_factory=PreferenceDatasetConfig)
    valid_dataset: Optional[PreferenceDatasetConfig] = None
    evaluator: RMEvaluatorConfig = field(default_factory=RMEvaluatorConfig)
    stats_logger: StatsLoggerConfig = field(default_factory=StatsLoggerConfig)

    def __post_init__(self) -> None:
        _check(self.total_train_epochs >= 1,
               f"total_train_epochs must be >= 1, got {self.total_train_epochs}")
        _check(self.total_train_steps is None or self.total_train_steps >= 1,
               f"total_train_steps must be >= 1 or null, got {self.total_train_steps}")
        _check(self.scheduler.trainer_threads is None or self.scheduler.trainer_threads >= 1,
               f"scheduler.trainer_threads must be >= 1 or null, got "
               f"{self.scheduler.trainer_threads}")
        self.train_dataset.check("train_dataset")
        if self.valid_dataset is not None:
            self.valid_dataset.check("valid_dataset")
