"""Mixture-of-Experts in training: the router load-balancing loss and routing replay.

Both work on HF's MoE routers (a module with `top_k`, `num_experts` and a `weight`, whose
forward returns (logits, top-k weights, top-k experts), as transformers' Qwen3MoeTopKRouter),
found in the decoder's order, so router j is the j-th MoE layer.

Load balancing (`router_aux_loss_coef` > 0): each router's logits are kept from the forward
(a forward hook), and the micro-batch adds coef * HF's `load_balancing_loss_func` over its
real tokens (E * sum_e fraction of top-k picks of e * mean router probability of e, summed
over layers' tokens as HF does), weighted by the micro-batch's share of the batch's tokens.
With `shared_prefix`, a prefix the rows share counts once (its trie node).

Routing replay (`routing_replay`): each router takes the experts the rollout recorded for a
token (`TensorBatch.routed_experts`) instead of its own top k; their weights are still the
router's own softmax at those experts (renormalised if the config says so), so the router
keeps its gradient. A token without a record (-1: the last of a completion, which no log-prob
depends on) is routed by the router itself. Prompt tokens replay the engine's prefill choices:
the rollout's log-probs attended keys and values computed under them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from asyncrl.api.types import TensorBatch


def is_router(module: nn.Module) -> bool:
    """Whether `module` is an MoE top-k router (see the module doc)."""
    return all(hasattr(module, a) for a in ("top_k", "num_experts", "weight")) and (
        type(module).__name__.endswith("Router"))


class MoeTraining:
    """The MoE options of one train engine, hooked into its HF model's routers."""

    def __init__(self, hf_model: nn.Module, *, aux_loss_coef: float, replay: bool,
                 shared_prefix: bool) -> None:
        self.routers = [m for m in hf_model.modules() if is_router(m)]  # in layer order
        self.aux_loss_coef, self.replay = aux_loss_coef, replay
        name = type(hf_model).__name__
        if not self.routers and (aux_loss_coef > 0 or replay):
            key = "routing_replay=true" if replay else f"router_aux_loss_coef={aux_loss_coef}"
            raise ValueError(f"actor.{key} is for Mixture-of-Experts models, and {name} has no "
                             f"MoE router; set actor.{key.split('=')[0]} to its default")
        if replay and shared_prefix:
            # One trie node per shared prompt token, but the rows' prompts may have been
            # routed differently (prefilled under different weight versions).
            raise ValueError("actor.routing_replay=true needs each row's own prompt tokens, "
                             "and actor.shared_prefix=true shares them between rows; set "
                             "actor.shared_prefix=false")
        self._logits: list[torch.Tensor] = []
        self._aux: torch.Tensor | None = None
        for router in self.routers:
            if aux_loss_coef > 0:
                router.register_forward_hook(self._keep_logits)
            if replay:
                router.forward = functools.partial(_replayed_forward, router, router.forward)
                router.replay_routes = None

    @property
    def active(self) -> bool:
        return bool(self.routers) and (self.aux_loss_coef > 0 or self.replay)

    def before_forward(self, mb: TensorBatch) -> None:
        """Set each router's recorded experts for the forward on `mb` (and its recomputation
        in backward, under gradient checkpointing); forget the last forward's logits."""
        self._logits.clear()
        if not self.replay:
            return
        routes = mb.routed_experts
        if routes is None:
            raise ValueError("actor.routing_replay=true, but the batch carries no routed "
                             "experts: the local backend records them, and sglang through "
                             "the controller's own client (scheduler.router=inline); vLLM's "
                             "are not read. Use one of those or set "
                             "actor.routing_replay=false")
        layers, k = routes.shape[2], routes.shape[3]
        if layers != len(self.routers) or k != self.routers[0].top_k:
            raise ValueError(f"the batch's routed experts are for {layers} MoE layers of top "
                             f"{k}, the model has {len(self.routers)} of top "
                             f"{self.routers[0].top_k}: were they recorded by another model?")
        for j, router in enumerate(self.routers):
            router.replay_routes = routes[:, :, j].reshape(-1, k).long()

    def after_forward(self, real_rows: torch.Tensor) -> None:
        """Keep the load-balancing term of the forward just run (for `add_aux_loss`);
        `real_rows` (bool) marks the router rows that are real tokens."""
        self._aux = None
        if self.aux_loss_coef > 0 and self._logits:
            self._aux = load_balancing_loss(self._logits, self.routers[0].num_experts,
                                            self.routers[0].top_k, real_rows)
        self._logits.clear()

    def add_aux_loss(self, loss: torch.Tensor, stats: dict[str, float],
                     share: float) -> torch.Tensor:
        """`loss` plus coef * the last forward's aux loss * `share` (the micro-batch's part
        of the batch's tokens), and that term without coef as stats["router_aux_loss"]; the
        loss unchanged when there is none."""
        aux, self._aux = self._aux, None
        if aux is None:
            return loss
        stats["router_aux_loss"] = share * float(aux.detach())
        return loss + self.aux_loss_coef * share * aux

    def _keep_logits(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():  # training forwards only (also the recomputation's)
            self._logits.append(output[0])


def _replayed_forward(router: nn.Module, own_forward, hidden_states: torch.Tensor):
    """The router's forward with its top-k experts replaced by `router.replay_routes`
    ([rows, top_k], -1 rows: its own), weighted by its own probabilities there."""
    logits, weights, chosen = own_forward(hidden_states)
    routes = router.replay_routes
    if routes is None:
        return logits, weights, chosen
    if routes.shape != chosen.shape:
        raise ValueError(f"replayed routes {list(routes.shape)} do not match the forward's "
                         f"{list(chosen.shape)} rows")
    recorded = (routes >= 0).all(-1, keepdim=True)
    chosen = torch.where(recorded, routes.to(chosen.device), chosen)
    probs = logits.softmax(-1, dtype=torch.float32)
    top = probs.gather(-1, chosen)
    if getattr(router, "norm_topk_prob", False):
        top = top / top.sum(-1, keepdim=True)
    return logits, top.to(logits.dtype), chosen


def load_balancing_loss(logits: list[torch.Tensor], num_experts: int, top_k: int,
                        real: torch.Tensor) -> torch.Tensor:
    """HF's Switch-style loss over the layers' router logits [rows, E] at the `real` rows:
    E * sum_e (share of top-k picks that went to e) * (mean probability of e)."""
    picks = torch.zeros(num_experts, dtype=torch.float32, device=logits[0].device)
    prob_sum = torch.zeros_like(picks)
    weight = real.reshape(-1).to(device=picks.device, dtype=torch.float32)
    for layer in logits:
        probs = layer.softmax(-1, dtype=torch.float32)
        chosen = probs.topk(top_k, dim=-1).indices
        picks = picks.scatter_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * weight[:, None]).sum(0)
    rows = weight.sum() * len(logits)
    return num_experts * torch.sum((picks / rows) * (prob_sum / rows))
