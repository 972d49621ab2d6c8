"""The trainer rank process (`python -m asyncrl.trainer.service`): the FSDP2 train engines
(policy, critic, reward, frozen), the worker one rank runs, micro-batching, checkpoints;
cpu/ holds the CPU speed paths."""

from asyncrl.trainer.engine import FSDPTrainEngine, TokenLogprobModel
from asyncrl.trainer.microbatch import (
    plan_micro_batches,
    split_across_ranks,
    split_by_token_budget,
)
from asyncrl.trainer.reward import FSDPRewardEngine, RewardModel
from asyncrl.trainer.updates import split_minibatches, train_epochs
from asyncrl.trainer.value import FSDPValueEngine, ValueModel

__all__ = ["FSDPRewardEngine", "FSDPTrainEngine", "FSDPValueEngine", "RewardModel",
           "TokenLogprobModel", "ValueModel",
           "plan_micro_batches", "split_across_ranks", "split_by_token_budget",
           "split_minibatches", "train_epochs"]
