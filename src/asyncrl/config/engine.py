"""The trained model's shared sections: its optimiser, how a batch is cut into micro-batches,
and `TrainEngineSpec`, the keys a train engine reads (built from a YAML section).

Also `_check`, the one way every config raises on a bad value (a ValueError the loader turns
into a ConfigError naming the key).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal, Optional


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(kw_only=True)
class OptimizerConfig:
    type: Literal["adam"] = "adam"  # AdamW (decoupled weight decay)
    # Peak learning rate: reached after the warmup, then kept or decayed (lr_scheduler_type).
    lr: float = 1e-6
    # AdamW's decoupled weight decay, on every parameter (0: none).
    weight_decay: float = 0.0
    # AdamW's decay rate of the gradient's running mean.
    beta1: float = 0.9
    # AdamW's decay rate of the squared gradient's running mean.
    beta2: float = 0.999
    # Added to AdamW's denominator (the root of the second moment).
    eps: float = 1e-8
    # After the warmup: a constant lr, or linear or cosine decay from lr towards
    # min_lr_ratio * lr over the run's optimiser steps.
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps_proportion: float = 0.0  # of the total training steps
    min_lr_ratio: float = 0.0  # the final lr of linear/cosine decay, as a fraction of lr
    gradient_clipping: float = 1.0  # max global grad norm; 0 disables clipping

    def __post_init__(self) -> None:
        _check(self.lr > 0, f"optimizer.lr must be > 0, got {self.lr}")
        _check(0 <= self.warmup_steps_proportion < 1,
               "optimizer.warmup_steps_proportion must be in [0, 1), got "
               f"{self.warmup_steps_proportion}")


@dataclass(kw_only=True)
class MicroBatchSpec:
    # Tokens (padding included) per forward/backward micro-batch; a longer sequence gets
    # a micro-batch of its own.
    max_tokens_per_mb: int = 8192
    # Consecutive rows that always share a micro-batch (and a data-parallel rank): a loss
    # over several rows, like DPO's (chosen, rejected) pairs, needs them together.
    granularity: int = 1

    def __post_init__(self) -> None:
        _check(self.max_tokens_per_mb >= 1,
               f"mb_spec.max_tokens_per_mb must be >= 1, got {self.max_tokens_per_mb}")
        _check(self.granularity >= 1, f"mb_spec.granularity must be >= 1, got {self.granularity}")


@dataclass(frozen=True, kw_only=True)
class TrainEngineSpec:
    """What a train engine reads: the model, its compute dtype, micro-batches, optimiser.

    Built from the section that describes the model (`actor`, `critic`, `model`, a frozen
    `ref`/`teacher`) by `of(section)`; the engine sees nothing else of the config.
    """

    path: str
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # compute dtype; master weights fp32
    init_from_scratch: bool = False
    gradient_checkpointing: bool = False
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    temperature: float = 1.0  # a policy's log-probs are those of logits / temperature
    # Rows sharing a prefix (a group's prompt, an agent's earlier turns) run it once: each
    # micro-batch goes through the model as a token trie (trainer/prefix.py). Exact
    # gradients; needs sdpa attention and full-attention layers.
    shared_prefix: bool = False
    # LoRA adapters on the target modules, the base frozen (the actor's keys; trainer/lora.py).
    use_lora: bool = False
    lora_rank: int = 32
    lora_alpha: int = 16
    target_modules: tuple[str, ...] = ("all-linear",)
    peft_type: str = "lora"
    # Parameter-name prefixes that take no gradients (SFT's `model.frozen_modules`).
    frozen_modules: tuple[str, ...] = ()
    # Mixture of Experts (trainer/moe.py): the router load-balancing loss's coefficient (0:
    # off), and routing replay (the rollout's recorded experts instead of the router's own).
    router_aux_loss_coef: float = 0.0
    routing_replay: bool = False
    # The trainer mesh, "fsdp:d<M>t<S>" (actor.backend): M data-parallel groups of S ranks
    # that split each layer (trainer/parallel.py); or "fsdp:d<M>e<E>", the experts split
    # over E ranks (trainer/experts.py). null: data parallel over every rank.
    backend: Optional[str] = None
    # Where the rank computes. Not a key of any section: the trainer that builds the spec
    # sets it from cluster.n_gpus_per_node (`ClusterConfig.device`), never from the host.
    device: Literal["cpu", "cuda"] = "cpu"

    @classmethod
    def of(cls, section: Any, **overrides: Any) -> TrainEngineSpec:
        """The spec of a config section: the keys it has, defaults for the others."""
        keys = {f.name: getattr(section, f.name) for f in fields(cls) if hasattr(section, f.name)}
        keys = {k: tuple(v) if isinstance(v, list) else v for k, v in keys.items()}
        return cls(**(keys | overrides))


def moe_adapter_error(modules: list[str], names: list[str]) -> ValueError:
    """The refusal of LoRA `modules` that adapt a Mixture-of-Experts router or experts
    (`names`: those modules), which the trainer (trainer/lora.py) and `asyncrl plan` raise."""
    return ValueError(f"target_modules={modules} adapts the MoE router or experts "
                      f"({', '.join(names[:2])}): they take no adapters here (the servers "
                      "adapt linear layers, and an adapted router would route otherwise than "
                      "the rollout did); name attention projections (q_proj, k_proj, v_proj, "
                      "o_proj) or use [all-linear]")
