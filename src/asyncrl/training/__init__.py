"""The FSDP2 train engines (policy and critic), micro-batching, checkpoint save/load."""

from asyncrl.training.engine import FSDPTrainEngine, TokenLogprobModel
from asyncrl.training.microbatch import (
    plan_micro_batches,
    split_across_ranks,
    split_by_token_budget,
)
from asyncrl.training.reward import FSDPRewardEngine, RewardModel
from asyncrl.training.updates import split_minibatches, train_epochs
from asyncrl.training.value import FSDPValueEngine, ValueModel

__all__ = ["FSDPRewardEngine", "FSDPTrainEngine", "FSDPValueEngine", "RewardModel",
           "TokenLogprobModel", "ValueModel",
           "plan_micro_batches", "split_across_ranks", "split_by_token_budget",
           "split_minibatches", "train_epochs"]
