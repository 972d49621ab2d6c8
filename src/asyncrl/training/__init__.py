"""The FSDP2 train engine, micro-batching, checkpoint save/load."""

from asyncrl.training.engine import FSDPTrainEngine, TokenLogprobModel
from asyncrl.training.microbatch import (
    plan_micro_batches,
    split_across_ranks,
    split_by_token_budget,
)

__all__ = ["FSDPTrainEngine", "TokenLogprobModel", "plan_micro_batches", "split_across_ranks",
           "split_by_token_budget"]
