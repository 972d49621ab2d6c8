"""The FSDP2 train engine: token log-probs, one optimiser step per batch, saving.

On one rank the model is not wrapped by FSDP: with bf16 compute, `trainer/cpu/precision.py`
keeps persistent bf16 copies of the fp32 master weights (FSDP2's numbers without its
per-step copies).

Data parallelism: every rank passes the same full batch; the engine takes its own rows
(balanced by tokens) and all ranks run the same number of micro-batches. Loss normalisers
(`n_tokens`, `n_seqs`) are those of the whole batch and FSDP sums (not averages) gradients
over ranks, so the gradient is that of the batch loss whatever the world size. With a
tensor-parallel mesh (`spec.backend` fsdp:d<M>t<S>, `trainer/parallel.py`) the rows are
split over the M data-parallel groups; the S ranks of a group see the same rows.

`train_batch` adds `entropy`, the token mean over the loss tokens of the entropy of the
sampling distribution (the logits at the actor's temperature), computed without gradient
inside the chunked vocabulary projection.

With `spec.shared_prefix`, each micro-batch runs as the token trie of its rows
(`trainer/prefix.py`): a prefix that rows share (a group's prompt) is computed once, and
its activations receive every row's gradient. Outputs and gradients equal the padded path's.

Loss-function stats are per-micro-batch contributions to batch-level numbers and are
summed over micro-batches and ranks, except keys ending in `_max` / `_min` (max / min).
A loss function reporting a batch mean should therefore divide by the batch's `n_tokens`,
as the loss itself does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from asyncrl.api import cores, faults
from asyncrl.api.protocols import LossFn
from asyncrl.api.types import ImageInputs, TensorBatch
from asyncrl.config.allocation import check_lora_layout
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.models.hub import resolve_model_path
from asyncrl.models.processors import QWEN_VL_TYPES, load_processor
from asyncrl.trainer import checkpoint, experts, lora, parallel, vision
from asyncrl.trainer.cpu import grad_ops, heap, precision
from asyncrl.trainer.cpu.attention import NAME as TRIE_ATTENTION
from asyncrl.trainer.cpu.attention import use_trie_attention
from asyncrl.trainer.cpu.linear import use_contiguous_weight_grads
from asyncrl.trainer.cpu.logprob_head import token_logprobs
from asyncrl.trainer.cpu.mlp import use_fused_mlps
from asyncrl.trainer.cpu.norm import use_fused_norms
from asyncrl.trainer.cpu.optim import (
    CopyingAdamW,
    init_state,
    make_lr_scheduler,
    make_optimizer,
)
from asyncrl.trainer.cpu.options import cpu_paths
from asyncrl.trainer.cpu.precision import ComputeWeights
from asyncrl.trainer.cpu.rope import use_fused_rope
from asyncrl.trainer.dist import init_process_group, local_device
from asyncrl.trainer.microbatch import plan_micro_batches, to_device
from asyncrl.trainer.moe import MoeTraining
from asyncrl.trainer.prefix import PrefixPack, pack_prefixes

logger = logging.getLogger(__name__)

HF_PREFIX = "hf."  # the HF model is the `hf` child of the FSDP root
# A micro-batch's images and the row of each item (TensorBatch.images, .image_rows).
RowImages = tuple[ImageInputs, torch.Tensor]
# On the CPU, the trie's node count and packed-row width rounded up to these multiples
# (`trainer/prefix.py`): oneDNN builds a matmul primitive per shape it has not seen, ~3 ms
# each, and every batch of a run has other sizes (~19 new shapes, 50-70 ms of each step);
# rounded, a few sizes recur. (1, 1): the exact sizes (GPUs, whose kernels need no build).
SHAPE_MULTIPLES = (32, 16)


class TokenLogprobModel(nn.Module):
    """An HF causal LM whose forward returns log p(token_t | tokens_<t) at chosen positions.

    It is the FSDP root, so one forward unshards every parameter it uses. Only the chosen
    positions go through the vocabulary projection (prompt tokens do not need it in
    training), chunk by chunk with a hand-written backward (`logprob_head.py`): never a
    full [B, T, V] log_softmax.

    Given a `PrefixPack`, the decoder runs on the trie's nodes and each distinct (prefix,
    token) goes through the projection once; rows sharing it read the same value.

    A vision-language model's rows may carry images (`TensorBatch.images`): HF's vision
    encoder and connector run on them, and the features replace the embeddings of each
    row's prompt image tokens, as the inference servers placed them; Qwen2-VL's family
    also takes their three-dimensional positions (`trainer/vision.py`).
    """

    packs_prefixes = True  # its forward takes `pack` (FSDPTrainEngine checks it)

    def __init__(self, hf_model: nn.Module, temperature: float) -> None:
        super().__init__()
        self.hf = hf_model
        self.temperature = temperature

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                targets: torch.Tensor, with_entropy: bool = False,
                pack: PrefixPack | None = None, images: RowImages | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[B, T] fp32 log-probs where `targets` (bool [B, T]) is True, 0 elsewhere.

        `with_entropy`: also the entropy of the sampling distribution (logits / T) at those
        positions, [B, T], without gradient. `pack`: the rows' trie (the same numbers).
        `images`: the rows' images and the row of each of their items.
        """
        chosen = targets[:, 1:]  # token t is predicted by the hidden state at t - 1
        if pack is None:
            out = self._decode(images, input_ids=input_ids, attention_mask=attention_mask)
            hidden = out.last_hidden_state[:, :-1][chosen]
            parts = self._logprobs(hidden, input_ids[:, 1:][chosen], with_entropy)
        else:
            parts = self._trie_logprobs(pack, chosen, with_entropy, images, input_ids,
                                        attention_mask)
        placed = [_place(chosen, values) for values in parts]
        return tuple(placed) if with_entropy else placed[0]

    def _trie_logprobs(self, pack: PrefixPack, chosen: torch.Tensor, with_entropy: bool,
                       images: RowImages | None = None, input_ids: torch.Tensor | None = None,
                       attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """`_logprobs` of the chosen tokens, each distinct node once, from its parent's state.

        The gather that hands a node's value to every row through it sums their gradients
        in backward, into the one shared activation: the exact gradient.
        """
        use_trie_attention(self.hf)
        inputs = pack.model_inputs()
        if images is not None:
            # The rows' embeddings with their images' features (and M-RoPE positions),
            # each node's read from one of its rows: rows share a node through image tokens
            # only when their pixels are equal (the pack's keys, `vision.image_keys`).
            rows = {"input_ids": input_ids, "attention_mask": attention_mask}
            embeds = self._with_images(rows, self.hf.get_input_embeddings()(input_ids),
                                       *images)
            del inputs["input_ids"]
            inputs["inputs_embeds"] = pack.from_rows(embeds)
            if "position_ids" in rows:  # [3, B, T] -> [3, 1, N + P]
                inputs["position_ids"] = pack.from_rows(
                    rows["position_ids"].permute(1, 2, 0)).permute(2, 0, 1)
        out = self._decode(**inputs)
        nodes, spread = pack.chosen_nodes(chosen)
        hidden = pack.to_slots(out.last_hidden_state).flatten(0, 1)[pack.parent[nodes]]
        parts = self._logprobs(hidden, pack.input_ids.flatten()[nodes], with_entropy)
        return [values[spread] for values in parts]

    def _decode(self, images: RowImages | None = None, **inputs: torch.Tensor) -> Any:
        """The decoder on `inputs`; the input embedding's gradient to its sink where it has
        one (`precision.embedding`: the tied embedding's rows added in fp32)."""
        if "inputs_embeds" in inputs:
            return self.hf.get_decoder()(**inputs, use_cache=False)
        embeds = precision.embedding(self.hf.get_input_embeddings(), inputs["input_ids"])
        if images is not None:
            if embeds is None:
                embeds = self.hf.get_input_embeddings()(inputs["input_ids"])
            embeds = self._with_images(inputs, embeds, *images)
        if embeds is not None:
            del inputs["input_ids"]
            inputs["inputs_embeds"] = embeds
        return self.hf.get_decoder()(**inputs, use_cache=False)

    def _with_images(self, inputs: dict[str, torch.Tensor], embeds: torch.Tensor,
                     images: ImageInputs, rows: torch.Tensor) -> torch.Tensor:
        """`embeds` with each row's prompt image tokens replaced by its images' features,
        in order (`trainer/vision.py`); with patches, `inputs` gains their positions."""
        input_ids, config = inputs["input_ids"], self.hf.config
        if images.image_grid_thw is None:
            features = self.hf.get_image_features(
                images.pixel_values[None], images.pixel_attention_mask[None]).pooler_output
            per_row = torch.bincount(rows, minlength=input_ids.shape[0]) * features.shape[1]
            mask = vision.prompt_image_mask(input_ids, config.image_token_id, per_row)
            return embeds.masked_scatter(
                mask[..., None], features.reshape(-1, features.shape[-1]).to(embeds.dtype))
        if config.model_type not in QWEN_VL_TYPES:
            raise NotImplementedError(
                f"images with image_grid_thw for a {config.model_type!r} model: the trainer "
                f"places them for {', '.join(QWEN_VL_TYPES)} (Qwen3-VL also feeds image "
                "features to inner decoder layers, which it does not do)")
        grids = vision.merged_grids(images, config.vision_config.spatial_merge_size)
        out = self.hf.get_image_features(images.pixel_values, images.image_grid_thw)
        features = getattr(out, "pooler_output", out)  # transformers 5; 4: the split features
        if isinstance(features, (tuple, list)):
            features = torch.cat(list(features))
        per_row = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        per_row.index_add_(0, rows, grids.prod(-1))
        mask = vision.prompt_image_mask(input_ids, config.image_token_id, per_row)
        inputs["position_ids"] = vision.mrope_positions(inputs["attention_mask"], mask, rows,
                                                        grids)
        return embeds.masked_scatter(mask[..., None], features.to(embeds.dtype))

    def _logprobs(self, hidden: torch.Tensor, tokens: torch.Tensor,
                  with_entropy: bool) -> list[torch.Tensor]:
        """[log-probs] or [log-probs, entropies] of the chosen positions (`logprob_head`)."""
        head = self.hf.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError(f"{type(self.hf).__name__}'s output projection has a bias, "
                             "which the trainer's log-prob head does not apply")
        return list(token_logprobs(hidden, head.weight, tokens, self.temperature,
                                   with_entropy))


def _place(chosen: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per-position values back to [B, T]: 0 where not chosen and at position 0."""
    flat = torch.zeros(chosen.shape, dtype=torch.float32, device=values.device)
    return nn.functional.pad(flat.masked_scatter(chosen, values), (1, 0))


def _follow_core_share(layers: nn.ModuleList) -> None:
    """Re-read this process's share of the cores (`api/cores.py`) before every decoder
    layer's forward and before its backward (a hook on its output's gradient), so that
    cores an idle server lends are taken up, and given back, within one layer."""

    def before_backward(grad: torch.Tensor) -> None:
        cores.adjust()

    def before_forward(module: nn.Module, args: Any) -> None:
        cores.adjust()

    def after_forward(module: nn.Module, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(before_backward)

    for layer in layers:
        layer.register_forward_pre_hook(before_forward)
        layer.register_forward_hook(after_forward)


def _own_memory(model: nn.Module) -> None:
    """Give the parameters memory of their own. transformers keeps the tensors of a
    checkpoint whose dtype matches (an fp32 file read as fp32 masters) as views of the
    file's private mapping: the first optimiser step then copied every page on write
    (131k page faults, 1.3 s for SmolLM2-135M's masters here), and until then a change
    to the file on disk would have changed the weights. Copied at load, before the
    servers have answered, instead."""
    with torch.no_grad():
        for param in model.parameters():  # a tied parameter is listed once
            param.data = param.data.clone()


def freeze(model: nn.Module, prefixes: Sequence[str]) -> None:
    """Parameters whose names start with one of `prefixes` take no gradients (and no
    optimiser state); a prefix that names no parameter is refused, naming some that exist."""
    names = [name for name, _ in model.named_parameters()]
    for prefix in prefixes:
        if not any(n == prefix or n.startswith(prefix + ".") for n in names):
            tops = sorted({".".join(n.split(".")[:3]) for n in names})
            raise ValueError(f"frozen_modules: {prefix!r} names no parameter of the model; "
                             f"its modules include {tops[:12]}")
    for name, p in model.named_parameters():
        if any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes):
            p.requires_grad_(False)


def _check_no_dropout(config: Any) -> None:
    """Refuse a model with dropout: its log-probs must be the inference engine's function."""
    for name, value in vars(config).items():
        if "dropout" in name and isinstance(value, float) and value > 0:
            raise ValueError(f"model config {name}={value}: the trainer's log-probs must match "
                             f"the inference engine's, which has no dropout; set {name} to 0")


def _check_packable(model: nn.Module, layout: parallel.Layout) -> None:
    """Refuse `shared_prefix` where the trie's 4D ancestor mask would not be the one applied."""
    name = type(model).__name__
    if layout.tensor_parallel:
        raise ValueError(f"shared_prefix=true: the trie attention does not run on heads split "
                         f"over t{layout.tensor} ranks (actor.backend); set shared_prefix to "
                         "false")
    if not getattr(model, "packs_prefixes", False):
        raise ValueError(f"shared_prefix=true: {name} has no shared-prefix forward; "
                         "set shared_prefix to false")
    config = model.hf.config
    if config._attn_implementation not in ("sdpa", TRIE_ATTENTION):
        # eager adds the mask as a float bias; flash attention takes no 4D mask at all.
        raise ValueError(f"shared_prefix=true needs sdpa attention, the model uses "
                         f"{config._attn_implementation!r}; set shared_prefix to false")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        # A custom 4D mask replaces the one HF would build, sliding windows included.
        raise ValueError(f"shared_prefix=true needs full-attention layers, the model has "
                         f"{sorted(layer_types)}; set shared_prefix to false")


def _real_rows(mb: TensorBatch, pack: PrefixPack | None) -> torch.Tensor:
    """Which rows of the decoder's flattened input are real tokens: [B * T] for padded rows,
    [N + P] for a trie's nodes (padding nodes are not)."""
    if pack is None:
        return mb.attention_mask.reshape(-1)
    real = torch.zeros(pack.input_ids.numel(), dtype=torch.bool, device=pack.slots.device)
    real[pack.node_of[pack.node_of >= 0]] = True
    return real[pack.slots]


def targets_all(mb: TensorBatch) -> torch.Tensor:
    """Every real token after the first (the first has no context to be predicted from)."""
    targets = mb.attention_mask.clone()
    targets[:, 0] = False
    return targets


def targets_loss(mb: TensorBatch) -> torch.Tensor:
    """Loss tokens only: the ones any loss over `loss_mask` reads."""
    return targets_all(mb) & (mb.loss_mask > 0)


_COMBINE = {"sum": float.__add__, "max": max, "min": min}
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _reduction(key: str) -> str:
    """How a stat combines over micro-batches and ranks, from its name's suffix."""
    return key.rsplit("_", 1)[-1] if key.endswith(("_max", "_min")) else "sum"


def reduce_stats(per_mb: list[dict[str, float]]) -> dict[str, float]:
    """Sum micro-batch stats, max/min those named `*_max` / `*_min`."""
    out: dict[str, float] = {}
    for stats in per_mb:
        for key, value in stats.items():
            value = float(value)
            out[key] = _COMBINE[_reduction(key)](out[key], value) if key in out else value
    return out


def _reduce_stats_across_ranks(stats: dict[str, float], device: torch.device,
                               group: Any = None) -> dict[str, float]:
    """The same reduction as `reduce_stats`, over the ranks of `group` (default: all; every
    rank must hold the same keys)."""
    if dist.get_world_size(group) == 1:
        return stats
    out = dict(stats)
    for kind, op in _REDUCE_OPS.items():
        keys = sorted(k for k in stats if _reduction(k) == kind)
        if keys:
            values = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=device)
            dist.all_reduce(values, op=op, group=group)
            out.update(zip(keys, values.tolist()))
    return out


class FSDPTrainEngine:
    """A data-parallel FSDP2 policy (fp32 master weights, optional bf16 compute)."""

    def __init__(self, spec: TrainEngineSpec, *, total_steps: int, seed: int = 1) -> None:
        if not isinstance(spec, TrainEngineSpec):
            raise TypeError(f"{type(self).__name__} takes a TrainEngineSpec (e.g. "
                            f"TrainEngineSpec.of(cfg.actor)), got {type(spec).__name__}")
        self.spec = spec
        self.total_steps = total_steps
        self.seed = seed
        self.steps_done = 0  # optimiser steps taken (restored by load_state)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.rank, self.world_size = 0, 1
        # Data-parallel groups of tensor-parallel ranks (trainer/parallel.py), and the group
        # of this rank's data-parallel peers (None: every rank, without tensor parallelism).
        self.layout = parallel.Layout(1)
        self._data_group = None
        self.device = torch.device("cpu")
        self._tied: set[str] = set()  # parameter names that alias another (tied embeddings)
        self._compute_weights: ComputeWeights | None = None  # one rank, bf16 compute
        self._owns_process_group = False
        self.lora_config: Any = None  # PEFT's LoraConfig with spec.use_lora (trainer/lora.py)
        self.processor: Any = None  # a vision-language model's, saved with its weights
        self._base_path = ""  # the model the weights (the base, with LoRA) come from
        self._moe: MoeTraining | None = None  # MoE models: aux loss, routing replay

    # ---- set-up -------------------------------------------------------------------------

    def initialize(self) -> None:
        """Join the process group, load and shard the model, build optimiser and schedule."""
        from transformers import AutoTokenizer

        self.device = local_device(self.spec.device)
        self._owns_process_group = init_process_group(self.spec.device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.layout = parallel.Layout.of(self.spec.backend, self.world_size)
        if self.device.type == "cpu" and cpu_paths().keep_freed_memory:
            heap.keep_freed_memory()  # trainer/cpu/heap.py: no page faults for reused buffers
        torch.manual_seed(self.seed)  # the same seed on every rank: identical scratch weights
        path = self._base_path = resolve_model_path(self.spec.path)
        hf_model = self._load_hf_model(path)
        _check_no_dropout(hf_model.config)
        freeze(hf_model, self.spec.frozen_modules)
        if self.layout.expert_parallel:
            experts.check_model(hf_model, self.layout.expert)  # refused before any other set-up
        if self.spec.use_lora:  # before the CPU paths, which then patch the adapters' layers too
            check_lora_layout(self.layout, self.spec.backend)
            self.lora_config = lora.add_adapters(hf_model, self.spec)
        self._moe = MoeTraining(hf_model, aux_loss_coef=self.spec.router_aux_loss_coef,
                                replay=self.spec.routing_replay,
                                shared_prefix=self.spec.shared_prefix)
        # The CPU paths read weights as plain tensors: off where layers are split.
        fast = not self.layout.tensor_parallel
        if fast:
            use_fused_norms(hf_model)  # bf16 on the CPU: trainer/cpu/norm.py
        if fast and self.device.type == "cpu" and self.spec.dtype == "bfloat16":
            # Only where they apply: elsewhere the modules stay HF's own, untouched.
            use_contiguous_weight_grads(hf_model.get_decoder())  # trainer/cpu/linear.py
            use_fused_mlps(hf_model)  # trainer/cpu/mlp.py
            use_fused_rope(hf_model)  # trainer/cpu/rope.py (bit for bit HF's, module-wide)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # a vision-language model's processor, saved with its weights
        if hasattr(hf_model.config, "vision_config"):
            self.processor = load_processor(path)
        self._tied = checkpoint.tied_aliases(hf_model)
        if self.spec.gradient_checkpointing:
            # Non-reentrant checkpointing is the kind that composes with FSDP2's hooks.
            hf_model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = self._wrap(hf_model)
        if self.spec.shared_prefix:
            _check_packable(self.model, self.layout)
        self._shard(self.model)
        if cores.current() is not None:
            _follow_core_share(self.model.hf.get_decoder().layers)
        copies = self._compute_weights.copies() if self._compute_weights is not None else None
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(trainable, self.spec.optimizer, copies)
        if self.device.type == "cpu":
            init_state(self.optimizer)  # trainer/cpu/optim.py: not in the first steps
        if self._compute_weights is not None and not isinstance(self.optimizer, CopyingAdamW):
            self._compute_weights.watch(self.optimizer)  # the copies are cast again
        self.lr_scheduler = make_lr_scheduler(self.optimizer, self.spec.optimizer, self.total_steps)

    def _wrap(self, hf_model: nn.Module) -> nn.Module:
        """The FSDP root around the HF model: its forward gives one number per chosen token."""
        return TokenLogprobModel(hf_model, self.spec.temperature)

    def _load_hf_model(self, path: str) -> nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        config = AutoConfig.from_pretrained(path)
        # a vision-language model (Idefics3, SmolVLM): its whole module, vision side included
        auto = AutoModelForImageTextToText if hasattr(config, "vision_config") \
            else AutoModelForCausalLM
        if self.spec.init_from_scratch:
            return auto.from_config(config, dtype=torch.float32)
        return auto.from_pretrained(path, dtype=torch.float32)

    def _shard(self, model: nn.Module) -> None:
        if self.world_size == 1 and not cpu_paths().fsdp_on_one_rank:
            model.to(self.device)
            if self.device.type == "cpu":
                _own_memory(model)
            if self.spec.dtype == "bfloat16":
                self._compute_weights = ComputeWeights(model, torch.bfloat16)
            return
        mesh = parallel.make_mesh(self.device.type, self.layout)
        if self.spec.dtype == "bfloat16":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            mp = MixedPrecisionPolicy()
        reshard = self.world_size > 1  # (cpu_paths().fsdp_on_one_rank: keep the gathered layer)
        if self.layout.tensor_parallel:
            parallel.apply_tensor_parallel(model.hf, mesh)
            self._data_group, mesh = parallel.data_group(mesh, self.layout), mesh["dp"]
        elif self.layout.expert_parallel:
            # Experts: split over "ep", then sharded by FSDP2 over the "dp" ranks holding the
            # same ones; the rest of the model over every rank (all take rows of their own).
            experts.apply_expert_parallel(model.hf, mesh["ep"])
            for module in model.hf.modules():
                if experts.is_experts(module):
                    fully_shard(module, mesh=mesh["dp"], mp_policy=mp,
                                reshard_after_forward=reshard)
            mesh = mesh["dp", "ep"]._flatten("world")  # every rank, one dimension
        for layer in model.hf.get_decoder().layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        if self.world_size == 1:
            return
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # Losses are already divided by the whole batch's normaliser: sum over ranks.
                # Plain SUM also on gloo, which lacks the PREMUL_SUM a custom factor asks for.
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    def destroy(self) -> None:
        """Free the model and the process group if `initialize` created it."""
        self.model = self.optimizer = self.lr_scheduler = self._compute_weights = None
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_process_group = False

    def _require_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("FSDPTrainEngine is not initialised; call initialize() first")
        return self.model

    @contextmanager
    def _computing(self) -> Iterator[None]:
        """Around forwards and their backwards: the compute weights in place (one rank)."""
        with self._compute_weights.active() if self._compute_weights else nullcontext():
            yield

    # ---- forward / backward -------------------------------------------------------------

    def _my_micro_batches(self, batch: TensorBatch) -> list[tuple[list[int], bool]]:
        """(rows, real) for this rank; a rank short of micro-batches repeats one, not real."""
        lengths = batch.seq_lens.tolist()
        spec = self.spec.mb_spec
        plans = plan_micro_batches(lengths, spec.max_tokens_per_mb, self.layout.batch_groups,
                                   spec.granularity)
        mine = plans[self.layout.data_rank(self.rank)]
        n = max(len(p) for p in plans)
        return [(mine[i], True) if i < len(mine) else (mine[0], False) for i in range(n)]

    def compute_logprobs(self, batch: TensorBatch) -> torch.Tensor:
        """Token-aligned log-probs [B, T] (fp32, CPU); position 0 and padding hold 0."""
        return self._forward_all(batch)

    def compute_base_logprobs(self, batch: TensorBatch) -> torch.Tensor:
        """`compute_logprobs` of the base model, its LoRA adapters switched off (the KL
        reference under LoRA: no second copy of the model)."""
        if self.lora_config is None:
            raise RuntimeError("compute_base_logprobs needs LoRA adapters (spec.use_lora)")
        with lora.adapters_off(self._require_model()):
            return self._forward_all(batch)

    def compute_outputs(self, batch: TensorBatch) -> torch.Tensor:
        """The root's per-token output [B, T] without gradient, what `train_batch`'s loss reads.

        Log-probs for a policy, values for a critic, scores for a reward model: so a loss
        function can be evaluated on held-out rows whatever the engine.
        """
        return self._forward_all(batch)

    @torch.no_grad()
    @cores.busy()
    def _forward_all(self, batch: TensorBatch) -> torch.Tensor:
        """The root's per-token output [B, T] on every real token after the first (fp32, CPU)."""
        model = self._require_model()
        model.eval()
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
        with self._computing():
            for rows, real in self._my_micro_batches(batch):
                mb = to_device(batch.select(rows), self.device)
                per_token = self._root_forward(model, mb, targets_all(mb))
                if real:
                    out[torch.as_tensor(rows, device=self.device),
                        : per_token.shape[1]] = per_token
        if self.layout.batch_groups > 1:  # each row is non-zero in exactly one group
            dist.all_reduce(out, group=self._data_group)
        return out.cpu()

    @cores.busy()  # this process's share of the cores (api/cores.py), if it has one
    def train_batch(self, batch: TensorBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimiser step on `batch`.

        `loss_fn` gets the root's output on the batch's loss tokens only (0 elsewhere):
        log-probs for a policy (the vocabulary projection is skipped on prompt tokens),
        values for a critic (`FSDPValueEngine`).
        """
        model = self._require_model()
        model.train()  # HF runs activation checkpointing in train mode only
        n_tokens = int((batch.loss_mask > 0).sum())
        n_seqs = len(batch)
        self.optimizer.zero_grad(set_to_none=True)
        mb_stats, loss_sum = [], 0.0
        micro_batches = self._my_micro_batches(batch)
        n_real = int(batch.attention_mask.sum())
        with self._computing():
            for rows, real in micro_batches:
                mb = to_device(batch.select(rows), self.device)
                out, forward_stats = self._train_forward(model, mb, n_tokens)
                loss, stats = loss_fn(out, mb, n_tokens=n_tokens, n_seqs=n_seqs)
                stats |= forward_stats
                loss = self._moe.add_aux_loss(loss, stats, int(mb.attention_mask.sum()) / n_real)
                if not real:
                    loss = loss * 0.0  # keeps FSDP's collectives in step with busier ranks
                loss.backward()
                faults.point("train", self.steps_done + 1)
                if real:
                    mb_stats.append(stats)
                    loss_sum += float(loss.detach())
        cores.adjust()
        grad_norm = self._clip_gradients()
        lr = self.optimizer.param_groups[0]["lr"]
        # A non-finite gradient would turn every weight into NaN: skip that update.
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
        self.optimizer.grad_scale = None  # a scale `_clip_gradients` left for this step only
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        self.steps_done += 1
        stats = reduce_stats(mb_stats)
        stats["loss"] = loss_sum
        stats = _reduce_stats_across_ranks(stats, self.device, self._data_group)
        stats.update(grad_norm=grad_norm, lr=lr, n_mbs=float(len(micro_batches)),
                     n_tokens=float(n_tokens), n_seqs=float(n_seqs), update_skipped=float(skipped))
        return stats

    def _train_forward(self, model: nn.Module, mb: TensorBatch,
                       n_tokens: int) -> tuple[torch.Tensor, dict[str, float]]:
        """The root's output on the loss tokens, and stats of the forward itself.

        The policy's: log-probs, and its token entropy over the loss tokens (this
        micro-batch's share of the batch mean). Engines with other roots override it.
        """
        logprobs, entropy = self._root_forward(model, mb, targets_loss(mb), with_entropy=True)
        return logprobs, {"entropy": float((entropy * mb.loss_mask).sum()) / max(n_tokens, 1)}

    def _root_forward(self, model: nn.Module, mb: TensorBatch, targets: torch.Tensor,
                      **kwargs: Any) -> Any:
        """The root's forward on `mb`, through the rows' prefix trie if `spec.shared_prefix`."""
        keys = None
        if mb.pixel_values is not None:
            kwargs["images"] = (mb.images, mb.image_rows)
            if self.spec.shared_prefix:
                keys = vision.image_keys(mb.input_ids.cpu(), model.hf.config.image_token_id,
                                         mb.images, mb.image_rows.cpu())
        if self.spec.shared_prefix:
            nodes, width = SHAPE_MULTIPLES if self.device.type == "cpu" else (1, 1)
            pack = pack_prefixes(mb.input_ids.cpu(), mb.attention_mask.cpu(), keys=keys,
                                 node_multiple=nodes, width_multiple=width)
            kwargs["pack"] = pack.to(mb.input_ids.device)
        if not self._moe.active:
            return model(mb.input_ids, mb.attention_mask, targets, **kwargs)
        self._moe.before_forward(mb)
        out = model(mb.input_ids, mb.attention_mask, targets, **kwargs)
        self._moe.after_forward(_real_rows(mb, kwargs.get("pack")))
        return out

    def _clip_gradients(self) -> float:
        """The global gradient norm (before clipping); clips to `gradient_clipping` if > 0:
        in place, or by the fused AdamW's gradient scale on the next `optimizer.step()`
        (`cpu_paths().clip_in_optimizer`; the caller resets `optimizer.grad_scale` after it)."""
        self.optimizer.grad_scale = None
        params = [p for p in self._require_model().parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        norm = grad_ops.total_norm(grads) if cpu_paths().norm_in_c else None
        if norm is None:  # per-shard partial norms -> the global norm, whole on every rank
            norm = parallel.total_norm(grads)
        max_norm = self.spec.optimizer.gradient_clipping
        total = float(norm)
        # Scaling by a coefficient of 1 would be a wasted pass over every gradient.
        if 0 < max_norm < total:
            if (cpu_paths().clip_in_optimizer and self.optimizer.defaults.get("fused")
                    and not any(isinstance(p, DTensor) for p in params)):
                # the inverse of clip_grads_with_norm_'s coefficient max_norm / (norm + 1e-6)
                self.optimizer.grad_scale = (norm.detach().float() + 1e-6) / max_norm
            else:
                parallel.clip_grads_with_norm_(params, max_norm, norm)
        return total

    # ---- saving -------------------------------------------------------------------------

    def hf_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Full CPU weights under HF names, tied aliases left out.

        A collective: every rank calls it; rank 0 gets the weights, the others an empty dict.
        """
        return checkpoint.full_state_dict(self._require_model(), prefix=HF_PREFIX,
                                          drop=self._tied, dtype=dtype)

    def device_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Full weights under HF names, in `dtype`, on this rank's device, tied aliases left
        out: the bf16 compute copies themselves where they are current, else cast copies.
        One unsharded rank only (the weights a colocated server copies by CUDA IPC)."""
        model = self._require_model()
        if self.world_size != 1 or isinstance(model, FSDPModule):
            raise RuntimeError(f"device_state_dict needs one unsharded rank (world size "
                               f"{self.world_size}); gather with hf_state_dict instead")
        fresh = self._compute_weights.fresh() if self._compute_weights is not None else None
        return checkpoint.full_state_dict(model, prefix=HF_PREFIX, drop=self._tied,
                                          dtype=dtype, ready=fresh or {})

    def save_hf(self, path: str, dtype: torch.dtype | None = None) -> None:
        """Full weights (master fp32, or `dtype`), config and tokenizer as an HF folder.

        Every rank must call it (gathering the shards is a collective); only rank 0 writes.
        With LoRA: the adapters alone, as PEFT's adapter folder (`_save_adapters`).
        """
        if self.lora_config is not None:
            self._save_adapters(path, dtype)
            return
        model = self._require_model()
        # On one rank the bf16 compute copies, when they hold the masters' current values
        # (CopyingAdamW writes them as it steps), are the bf16 weights: no second cast.
        fresh = self._compute_weights.fresh() if self._compute_weights is not None else None
        weights = checkpoint.full_state_dict(model, prefix=HF_PREFIX, drop=self._tied,
                                             dtype=dtype, ready=fresh)
        if self.rank == 0:
            hf = model.hf
            checkpoint.write_hf_folder(path, weights, hf.config, self.tokenizer,
                                       getattr(hf, "generation_config", None), self.processor)
        dist.barrier()

    def _save_adapters(self, path: str, dtype: torch.dtype | None) -> None:
        """The LoRA adapters (in `dtype`) as PEFT's adapter folder, with the base model's
        path and the tokenizer: what a publish sends and a saved checkpoint holds. Every
        rank must call it; only rank 0 writes."""
        model = self._require_model()
        fresh = self._compute_weights.fresh() if self._compute_weights is not None else None
        weights = checkpoint.full_state_dict(model, prefix=HF_PREFIX, drop=self._tied,
                                             dtype=dtype, ready=fresh, trainable_only=True)
        if self.rank == 0:
            adapters = lora.to_peft_names(weights)
            lora.write_adapter_folder(path, adapters, self.lora_config, self._base_path,
                                      self.tokenizer)
            if not getattr(self, "_size_logged", False):
                self._size_logged = True
                logger.info("LoRA: a saved version holds %.2f MB of adapters; the full "
                            "weights in the same dtype would be %.2f MB",
                            sum(t.nbytes for t in adapters.values()) / 2**20,
                            self._full_weight_bytes(dtype) / 2**20)
        dist.barrier()

    def _full_weight_bytes(self, dtype: torch.dtype | None) -> int:
        """Bytes of the base model's weights in `dtype` (fp32 if None), tied aliases once."""
        itemsize = (dtype or torch.float32).itemsize
        seen = {id(p): p.numel() for name, p in self._require_model().named_parameters()
                if not p.requires_grad}
        return sum(seen.values()) * itemsize

    def save_state(self, path: str) -> None:
        """Model, optimiser, lr schedule, step count and RNG state, for an exact resume.
        With LoRA the model part is the adapters (the base is `spec.path`, loaded again)."""
        checkpoint.save_train_state(path, self._require_model(), self.optimizer,
                                    self._extra_state(),
                                    trainable_only=self.lora_config is not None)

    def load_state(self, path: str) -> None:
        """Restore what `save_state` wrote (the world size may differ)."""
        extra = checkpoint.load_train_state(path, self._require_model(), self.optimizer,
                                            trainable_only=self.lora_config is not None)
        if self._compute_weights is not None:
            self._compute_weights.invalidate()
        self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        self.steps_done = int(extra["steps_done"])
        torch.set_rng_state(extra["cpu_rng"])
        if self.device.type == "cuda" and "cuda_rng" in extra:
            torch.cuda.set_rng_state(extra["cuda_rng"])

    def _extra_state(self) -> dict[str, Any]:
        extra = {"lr_scheduler": self.lr_scheduler.state_dict(), "steps_done": self.steps_done,
                 "cpu_rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            extra["cuda_rng"] = torch.cuda.get_rng_state()
        return extra
