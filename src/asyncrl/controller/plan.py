"""The memory of an RL run per device, worked out from its config before anything starts.

`asyncrl plan --config run.yaml [key=value ...]` prints, for a trainer rank and an inference
server, the bytes of weights, gradients, optimiser state, activations and KV cache, says
whether they fit the device (`--device-gb`, default: this machine's memory on a CPU run, 80
GB on a GPU run) and, when they do not, which change would make them fit.

What a trainer rank holds. Its mesh is `actor.backend` as the trainer reads it
(`config/allocation.py`, with the trainer's refusals: t and e together, e not dividing the
model's experts, LoRA under t or e): M data groups of S ranks (`fsdp:d<M>t<S>`), a rank
holding 1/S of each attention and dense MLP projection (embeddings, norms and head whole),
FSDP2 sharding that over the M groups; or M data groups of E ranks (`fsdp:d<M>e<E>`), a
rank holding 1/E of each MoE layer's experts, FSDP2 sharding those over the M ranks that
hold the same experts and every other parameter over all M x E ranks:
- fp32 master weights, 4 bytes per parameter, and per trained parameter an fp32 gradient (4)
  and AdamW's two moments (8). With LoRA the frozen base stays in fp32 (the engine loads
  every weight so) beside the adapters, and only the adapters have gradients and moments.
  LoRA on an MoE model adapts what trainer/lora.py adapts: with `all-linear` the attention
  projections (q, k, v, o), never the router or the experts;
- the compute copy: with FSDP2, the rank's share of one decoder layer gathered in bf16 and
  the next prefetched (two layers, plus the embedding and head of the root group); on one
  rank, which FSDP does not wrap, a persistent bf16 copy of every weight
  (`trainer/cpu/precision.py`);
- a frozen reference (KL) or teacher: a data-parallel engine over all ranks, its fp32
  weights sharded and its compute copy as above;
- activations of one micro-batch of `max_tokens_per_mb` tokens: per decoder layer and token
  what the backward keeps, or with gradient checkpointing only each layer's input plus one
  layer's worth; and the log-prob head's chunk of logits. With the trainer's fused CPU
  paths (one CPU device, no tensor parallelism) a layer keeps its input and normed input
  twice, q, k and v with k and v repeated to every head, the attention output, gate, up,
  their product and its input to down; HF's own modules (on a GPU, and under tensor
  parallelism) keep more, as counted by saved-tensor hooks on HF's layers (see
  `activation_bytes_per_token_layer`). The heads and the MLP's width are divided by S. An
  MoE layer keeps per routed copy of a token (top k of them) its gathered input, gate and
  up, their activation and product, and the expert's output, and per token the router's
  logits and probabilities.
What an inference server holds (our engine): the weights twice (served and the spare a
weight update fills), the KV cache of `max_batch_size` slots of `max_seq_len` positions, and
one step's transient tensors (`inference/server/memory.py`). vLLM and SGLang take
`rollout.gpu_memory_fraction` of each GPU whatever the model, a server of T GPUs
(`rollout.backend: vllm:d2t4`) holding 1/T of the weights on each; the plan says so.

The figures are estimates: `benchmarks/memory_plan.py` measures peaks beside them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.config.allocation import (
    TENSOR_PARALLEL_MODEL_TYPES,
    TrainLayout,
    check_expert_split,
    check_lora_layout,
    check_tensor_split,
    parse_train_backend,
)
from asyncrl.config.engine import moe_adapter_error

GiB = 2**30
# The module names of HF's Qwen3-MoE router and fused experts, which take no adapters.
MOE_MODULES = ("gate", "experts")
# Tokens of the log-prob head's vocabulary chunk (trainer/cpu/logprob_head.py computes the
# log-softmax over the vocabulary in chunks and never holds [T, V] at once).
HEAD_CHUNK_TOKENS = 1024
# Memory a process holds before its first tensor: the CUDA context, or on a CPU the Python
# interpreter with torch and transformers imported.
RUNTIME_BYTES = {"cuda": int(0.5 * GiB), "cpu": int(0.45 * GiB)}


def _dense(h: int, layers: int, heads: int, kv: int, inter: int, tied: bool,
           model_type: str = "qwen3", vocab: int = 151936) -> dict[str, Any]:
    return dict(model_type=model_type, hidden_size=h, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, head_dim=128 if
                model_type.startswith("qwen3") else h // heads, intermediate_size=inter,
                vocab_size=vocab, tie_word_embeddings=tied)


# The config.json facts of models users plan for, so that `asyncrl plan` answers without
# the hub (any other model: its local HF folder).
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-0.6B": _dense(1024, 28, 16, 8, 3072, True),
    "Qwen/Qwen3-1.7B": _dense(2048, 28, 16, 8, 6144, True),
    "Qwen/Qwen3-4B": _dense(2560, 36, 32, 8, 9728, True),
    "Qwen/Qwen3-8B": _dense(4096, 36, 32, 8, 12288, False),
    "Qwen/Qwen3-14B": _dense(5120, 40, 40, 8, 17408, False),
    "Qwen/Qwen3-32B": _dense(5120, 64, 64, 8, 25600, False),
    "Qwen/Qwen3-30B-A3B": _dense(2048, 48, 32, 4, 6144, False, "qwen3_moe") | dict(
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    "Qwen/Qwen3-235B-A22B": _dense(4096, 94, 64, 4, 12288, False, "qwen3_moe") | dict(
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536),
    "Qwen/Qwen2.5-1.5B-Instruct": _dense(1536, 28, 12, 2, 8960, True, "qwen2"),
    "Qwen/Qwen2.5-7B-Instruct": _dense(3584, 28, 28, 4, 18944, False, "qwen2", 152064),
}


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on in a decoder's config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0  # 0: dense
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    model_type: str = ""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        c = config
        heads = c["num_attention_heads"]
        experts = c.get("num_experts") or c.get("num_local_experts") or 0
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c.get("intermediate_size", 0), num_layers=c["num_hidden_layers"],
            num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            qkv_bias=c.get("model_type") == "qwen2" or c.get("attention_bias", False),
            qk_norm=c.get("model_type", "").startswith("qwen3"),
            num_experts=experts, experts_per_token=c.get("num_experts_per_tok", 0),
            moe_intermediate_size=c.get("moe_intermediate_size", 0),
            model_type=c.get("model_type", ""))

    @classmethod
    def of(cls, name_or_path: str) -> ModelShape:
        """The shape of a model as `actor.path` names it: its local folder (a named small
        model is built once), else a known hub id's facts."""
        from asyncrl.models.hub import resolve_model_path

        if name_or_path in KNOWN_CONFIGS and not Path(name_or_path).is_dir():
            return cls.from_config(KNOWN_CONFIGS[name_or_path])
        try:
            return cls.from_path(resolve_model_path(name_or_path))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"cannot plan for {name_or_path!r}: {e}; give its local HF "
                                    f"folder or one of {sorted(KNOWN_CONFIGS)}") from None

    @classmethod
    def from_path(cls, path: str | os.PathLike) -> ModelShape:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{path} has no config.json: give the model's HF folder")
        return cls.from_config(json.loads(file.read_text()))

    def attention_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of q, k, v and o."""
        h, d = self.hidden_size, self.head_dim
        return [(h, self.num_heads * d), (h, self.num_kv_heads * d),
                (h, self.num_kv_heads * d), (self.num_heads * d, h)]

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of one decoder layer's projections (every expert's, for MoE)."""
        h = self.hidden_size
        if self.num_experts:
            i = self.moe_intermediate_size
            return (self.attention_shapes() + [(h, i), (h, i), (i, h)] * self.num_experts
                    + [(h, self.num_experts)])
        i = self.intermediate_size
        return self.attention_shapes() + [(h, i), (h, i), (i, h)]

    def layer_split_params(self) -> int:
        """Parameters of one layer that tensor parallelism splits: the attention projections
        (with their biases) and a dense MLP's (trainer/parallel.py's plan)."""
        n = sum(a * b for a, b in self.attention_shapes())
        if self.qkv_bias:
            n += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if not self.num_experts:
            n += 3 * self.hidden_size * self.intermediate_size
        return n

    def layer_expert_params(self) -> int:
        """Parameters of one layer's experts (0 for a dense model)."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def layer_whole_params(self) -> int:
        """Parameters of one layer every rank of a tensor or expert group holds whole: the
        two RMSNorms, Qwen3's q/k norms and an MoE router."""
        n = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        return n + self.num_experts * self.hidden_size

    def layer_params(self) -> int:
        return self.layer_split_params() + self.layer_expert_params() + self.layer_whole_params()

    def rank_layer_params(self, tensor: int = 1, expert: int = 1) -> int:
        """One layer's parameters on one rank of a tensor group of `tensor` ranks and an
        expert group of `expert` ranks (before FSDP shards them over the data groups)."""
        return (self.layer_split_params() // tensor + self.layer_expert_params() // expert
                + self.layer_whole_params())

    def embedding_params(self) -> int:
        """The input embedding and the head (one matrix when tied) and the final norm."""
        v, h = self.vocab_size, self.hidden_size
        return v * h * (1 if self.tie_word_embeddings else 2) + h

    @property
    def n_params(self) -> int:
        return self.num_layers * self.layer_params() + self.embedding_params()

    def rank_params(self, tensor: int = 1, expert: int = 1) -> int:
        """The model's parameters on one rank of a (tensor, expert) group, before FSDP."""
        return self.num_layers * self.rank_layer_params(tensor, expert) + self.embedding_params()

    def lora_params(self, rank: int, targets: list[str] | None = None) -> int:
        """Adapter parameters of rank `rank` on the projections trainer/lora.py adapts: with
        `targets` None or ["all-linear"] every linear layer of the decoder (of an MoE model
        the attention's q, k, v and o: its router and fused experts are no linear layers),
        else the named ones. Naming an MoE model's router or experts is the trainer's
        refusal."""
        names = ["q_proj", "k_proj", "v_proj", "o_proj"]
        shapes = self.attention_shapes()
        if not self.num_experts:
            names += ["gate_proj", "up_proj", "down_proj"]
            shapes = self.linear_shapes()
        everything = not targets or targets == ["all-linear"]
        moe_named = sorted(set(targets or []) & set(MOE_MODULES)) if self.num_experts else []
        if moe_named:
            raise moe_adapter_error(list(targets or []), moe_named)
        chosen = set(names) if everything else set(targets)
        unknown = chosen - set(names)
        if unknown:
            raise ValueError(f"actor.target_modules {sorted(unknown)} are not projections of "
                             f"this model that take adapters; use some of {sorted(names)} "
                             "or 'all-linear'")
        per_layer = sum(rank * (a + b) for name, (a, b) in zip(names, shapes) if name in chosen)
        return self.num_layers * per_layer

    def rank_expert_params(self, expert: int = 1) -> int:
        """The experts' parameters (every layer's) on one rank of an expert group of `expert`
        ranks, before FSDP."""
        return self.num_layers * self.layer_expert_params() // expert

    def activation_bytes_per_token_layer(self, dtype_bytes: int = 2, tensor: int = 1,
                                         hf_modules: bool = False) -> int:
        """Bytes one token keeps for the backward of one decoder layer on one rank of a
        tensor group of `tensor` ranks (see the module doc). `hf_modules`: the layer runs
        HF's own norms, rotary embedding and MLP (on a GPU, and under tensor parallelism),
        not the trainer's fused CPU paths (`trainer/cpu/`)."""
        h, d, b = self.hidden_size, self.head_dim, dtype_bytes
        heads, kv = self.num_heads * d, self.num_kv_heads * d
        if hf_modules:
            # Counted by saved-tensor hooks on HF's llama and qwen3 layers in bf16: 16 bytes
            # per hidden unit (the norms keep their fp32 inputs), 4 per query and per KV
            # head dimension (10 with Qwen3's fp32 q/k norms), 8 per MLP unit.
            per_head = (5 if self.qk_norm else 2) * b
            common = 8 * b * h + per_head * (heads + kv) // tensor
        else:  # q, k and v at every head and the attention's output; the layer's input and
            # normed input twice
            common = b * (4 * h + 4 * heads // tensor)
        if not self.num_experts:
            # gate, up, act(gate) * up and the down projection's input
            return common + b * 4 * self.intermediate_size // tensor
        # Per routed copy of the token (HF's Qwen3MoeExperts): the gathered input, gate_up's
        # output, act(gate), the product, down's output (kept for the routing weight's
        # gradient); the router's logits and their fp32 softmax.
        routed = self.experts_per_token * (2 * h + 4 * self.moe_intermediate_size)
        return common + b * routed + self.num_experts * (b + 4)


def train_layout(backend: str | None, world_size: int = 1) -> TrainLayout:
    """The mesh of `actor.backend` as the trainer reads it (config/allocation.py: "fsdp:d2t2",
    "fsdp:d2e4", the same refusals); None: data parallel over `world_size` ranks."""
    return TrainLayout(world_size) if backend is None else parse_train_backend(backend)


@dataclass
class Plan:
    """Bytes per device of one trainer rank and one inference server, and what to change."""

    device: str
    device_bytes: int
    trainer: dict[str, int] = field(default_factory=dict)
    server: dict[str, int] = field(default_factory=dict)
    server_note: str = ""
    # How many trainer ranks and servers share one device: on a CPU machine all of them,
    # with a colocated allocation one of each, else one of either (0 servers: separate).
    ranks_per_device: int = 1
    servers_per_device: int = 0
    server_weights_fit: bool = True  # vLLM/SGLang: the weights within their memory fraction
    advice: list[str] = field(default_factory=list)

    @property
    def trainer_total(self) -> int:
        return sum(self.trainer.values())

    @property
    def server_total(self) -> int:
        return sum(self.server.values())

    @property
    def device_total(self) -> int:
        """The bytes of the fullest device."""
        if self.servers_per_device:
            return (self.ranks_per_device * self.trainer_total
                    + self.servers_per_device * self.server_total)
        return max(self.trainer_total, self.server_total)

    @property
    def fits(self) -> bool:
        return self.device_total <= self.device_bytes and self.server_weights_fit

    def table(self) -> str:
        rows = [f"{'trainer rank':<28s}{'GiB':>10s}"]
        rows += [f"  {k:<26s}{v / GiB:>10.2f}" for k, v in self.trainer.items()]
        rows.append(f"  {'total':<26s}{self.trainer_total / GiB:>10.2f}")
        rows.append("inference server")
        rows += [f"  {k:<26s}{v / GiB:>10.2f}" for k, v in self.server.items()]
        if self.server:
            rows.append(f"  {'total':<26s}{self.server_total / GiB:>10.2f}")
        if self.server_note:
            rows.append(f"  {self.server_note}")
        if self.servers_per_device:
            where = (f"{self.ranks_per_device} rank(s) and {self.servers_per_device} "
                     f"server(s) on one {self.device} device")
        else:
            where = f"one rank or one server per {self.device} device"
        verdict = "fits" if self.fits else "does NOT fit"
        rows.append(f"{where}: {self.device_total / GiB:.2f} GiB, {verdict} in "
                    f"{self.device_bytes / GiB:.1f} GiB")
        rows += [f"  - {a}" for a in self.advice]
        return "\n".join(rows)


def plan_trainer(shape: ModelShape, *, device: str, tokens_per_mb: int,
                 layout: TrainLayout = TrainLayout(1), gradient_checkpointing: bool = False,
                 compute_bytes: int = 2, adapters: int = 0,
                 frozen: tuple[ModelShape, ...] = ()) -> dict[str, int]:
    """Bytes of one trainer rank (see the module doc). `adapters`: LoRA's adapter parameters
    (0: every parameter is trained); `frozen`: the reference and teacher models held beside
    the actor, each a data-parallel engine over all ranks without gradients (a LoRA actor's
    reference is the base itself: none)."""
    d, t, e = layout
    # FSDP2 shards the rank's experts over the d ranks that hold the same ones, and the rest
    # of its (tensor, expert) part over the data groups, under e over all d x e ranks
    # (trainer/experts.py)
    held, experts = shape.rank_params(t, e), shape.rank_expert_params(e)
    sharded = experts // d + (held - experts) // (d * e)
    trained = adapters // d if adapters else sharded
    compute = _compute_copy(shape, layout, device, compute_bytes, adapters)
    hf_modules = device != "cpu" or t > 1  # the fused CPU paths are off (trainer/engine.py)
    per_layer = shape.activation_bytes_per_token_layer(compute_bytes, t,
                                                       hf_modules) * tokens_per_mb
    if gradient_checkpointing:
        activations = shape.num_layers * tokens_per_mb * shape.hidden_size * compute_bytes
        activations += per_layer
    else:
        activations = shape.num_layers * per_layer
    head = 3 * min(tokens_per_mb, HEAD_CHUNK_TOKENS) * shape.vocab_size * 4
    plan = {"weights (fp32 master)": 4 * (sharded + adapters // d),
            "weights (compute copy)": compute, "gradients (fp32)": 4 * trained,
            "optimiser (AdamW fp32)": 8 * trained, "activations": activations + head,
            "runtime": RUNTIME_BYTES[device]}
    if frozen:
        world = TrainLayout(layout.world_size)
        plan["reference/teacher weights"] = sum(
            4 * f.n_params // world.data + _compute_copy(f, world, device, compute_bytes)
            for f in frozen)
    return plan


def _compute_copy(shape: ModelShape, layout: TrainLayout, device: str, compute_bytes: int,
                  adapters: int = 0) -> int:
    """The compute-dtype weights beside the fp32 masters at their peak."""
    if compute_bytes >= 4:
        return 0
    if layout.world_size == 1:  # no FSDP on one rank: a persistent copy of every weight
        return compute_bytes * (shape.n_params + adapters)
    # FSDP2: two of the rank's layers in flight and the root group (embedding, head)
    layer = shape.rank_layer_params(layout.tensor, layout.expert) + adapters // shape.num_layers
    return compute_bytes * (2 * layer + shape.embedding_params())


def plan_local_server(shape: ModelShape, *, max_batch_size: int, max_seq_len: int,
                      dtype_bytes: int = 2, device: str = "cpu") -> dict[str, int]:
    """Bytes of one of our inference servers (inference/server/memory.py's accounting)."""
    weights = dtype_bytes * shape.n_params
    slot = 2 * shape.num_layers * shape.num_kv_heads * max_seq_len * shape.head_dim * dtype_bytes
    n = max(8192, max_seq_len)
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    per_row = 4 * shape.hidden_size + 2 * qkv + 3 * (shape.intermediate_size or
                                                     shape.moe_intermediate_size)
    reserve = ((n * per_row + shape.num_heads * n * min(n, max_seq_len)) * dtype_bytes
               + 4 * max_batch_size * shape.vocab_size * 4)
    return {"weights (served + spare)": 2 * weights, "KV cache": slot * max_batch_size,
            "step transients": reserve, "runtime": RUNTIME_BYTES[device]}


def plan_run(cfg: Any, shape: ModelShape | None = None, device_bytes: int | None = None) -> Plan:
    """The plan of `cfg` (an ExperimentConfig)."""
    actor = cfg.actor
    shape = shape or ModelShape.of(actor.path)
    device = cfg.cluster.device
    if device_bytes is None:
        device_bytes = (80 * GiB if device == "cuda"
                        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    plan = Plan(device=device, device_bytes=device_bytes)
    inputs = _trainer_inputs(cfg, shape)
    plan.trainer = plan_trainer(shape, **inputs)
    colocated = cfg.colocated
    if device == "cpu":  # every process of the run on this machine
        plan.ranks_per_device = inputs["layout"].world_size
        plan.servers_per_device = cfg.rollout.n_servers or 1
    elif colocated:
        plan.servers_per_device = 1
    backend = cfg.rollout.backend or "local"
    if backend == "local":
        plan.server = plan_local_server(
            shape, max_batch_size=cfg.local_engine.max_batch_size,
            max_seq_len=cfg.local_engine.max_seq_len, device=device,
            dtype_bytes=4 if cfg.local_engine.dtype == "float32" else 2)
    else:
        _plan_gpu_server(plan, cfg, shape, backend, colocated)
    if not plan.fits:
        plan.advice = _advice(cfg, shape, plan, inputs)
    return plan


def _trainer_inputs(cfg: Any, shape: ModelShape) -> dict[str, Any]:
    """plan_trainer's arguments for the actor of `cfg`."""
    actor = cfg.actor
    layout = train_layout(actor.backend, cfg.trainer_world_size)
    # what the trainer refuses when it loads the model (trainer/engine.py)
    check_expert_split(shape.num_experts, layout.expert, shape.model_type or "this model")
    if actor.use_lora:
        check_lora_layout(layout, actor.backend)
    check_tensor_split(shape.model_type, {"num_attention_heads": shape.num_heads,
                                          "num_key_value_heads": shape.num_kv_heads,
                                          "intermediate_size": shape.intermediate_size},
                       layout.tensor)
    adapters = (shape.lora_params(actor.lora_rank, list(actor.target_modules))
                if actor.use_lora else 0)
    frozen = []
    if actor.kl_ctl != 0 and not (actor.use_lora and cfg.ref.path == actor.path):
        frozen.append(ModelShape.of(cfg.ref.path) if cfg.ref.path != actor.path else shape)
    if actor.distill_coef != 0:
        frozen.append(ModelShape.of(cfg.teacher.path))
    return dict(device=cfg.cluster.device, tokens_per_mb=actor.mb_spec.max_tokens_per_mb,
                layout=layout,
                gradient_checkpointing=actor.gradient_checkpointing,
                compute_bytes=2 if actor.dtype == "bfloat16" else 4, adapters=adapters,
                frozen=tuple(frozen))


def _plan_gpu_server(plan: Plan, cfg: Any, shape: ModelShape, backend: str,
                     colocated: bool) -> None:
    """A vLLM or SGLang server's GPU: its weights split over its `t` GPUs, the rest of its
    memory fraction for the KV cache."""
    fraction = cfg.rollout.gpu_memory_fraction or (0.5 if colocated else 0.9)
    t = cfg.server_tensor_size
    weights = 2 * shape.n_params // t
    rest = int(fraction * plan.device_bytes) - weights
    name = "weights (bf16)" if t == 1 else f"weights (bf16, 1/{t} per GPU)"
    plan.server = {name: weights, "KV cache and activations": max(rest, 0)}
    plan.server_note = (f"{backend} takes rollout.gpu_memory_fraction={fraction} of each GPU; "
                        "its KV cache gets what the weights leave")
    plan.server_weights_fit = rest > 0
    if rest <= 0:
        plan.server_note += ("; here the weights alone exceed it: raise "
                             "rollout.gpu_memory_fraction or give each server more GPUs (t)")


def _advice(cfg: Any, shape: ModelShape, plan: Plan, inputs: dict[str, Any]) -> list[str]:
    """Each change that lowers the fullest device, with the trainer rank's GiB it gives,
    largest saving first; "(fits)" where that alone makes the run fit."""
    budget = ((plan.device_bytes - plan.servers_per_device * plan.server_total)
              // plan.ranks_per_device)
    out: list[tuple[int, str]] = []
    if plan.trainer_total > budget:
        for change, total in _trainer_levers(cfg, shape, inputs, budget):
            if total < plan.trainer_total:
                out.append((total, f"{change}: {total / GiB:.1f} GiB per trainer rank"
                            + (" (fits)" if total <= budget else "")))
    out.sort()
    advice = [text for _, text in out]
    server = plan.server
    if "KV cache" in server and plan.server_total > budget:
        advice.append(f"lower local_engine.max_batch_size (now "
                      f"{cfg.local_engine.max_batch_size}) or local_engine.max_seq_len (now "
                      f"{cfg.local_engine.max_seq_len}): the KV cache takes "
                      f"{server['KV cache'] / GiB:.1f} GiB")
    if not plan.server_weights_fit:
        backend, n, t = cfg.rollout.backend, cfg.rollout.n_servers, cfg.server_tensor_size
        weights = 2 * shape.n_params
        fraction = cfg.rollout.gpu_memory_fraction or 0.9
        need = next((s for s in (2, 4, 8, 16) if s > t
                     and weights / s < 0.8 * fraction * plan.device_bytes), None)
        if need:
            advice.append(f"split each server over more GPUs: rollout {backend}:d{n}t{need} "
                          f"(weights {weights / need / GiB:.1f} GiB per GPU)")
    return advice or ["use a device with more memory"]


def _trainer_levers(cfg: Any, shape: ModelShape, inputs: dict[str, Any],
                    budget: int) -> list[tuple[str, int]]:
    """(the change, the trainer rank's bytes with it) of each lever that applies."""
    def total(**change: Any) -> int:
        return sum(plan_trainer(shape, **(inputs | change)).values())

    actor, layout, out = cfg.actor, inputs["layout"], []
    gpu = inputs["device"] == "cuda"  # more ranks on one CPU machine share its memory
    if gpu:
        # t and e do not combine, and LoRA trains data parallel only
        split = not inputs["adapters"]
        for letter, valid in (("d", [2 ** k for k in range(1, 11)]),
                              ("t", _tensor_sizes(shape) if split and layout.expert == 1
                               else []),
                              ("e", _expert_sizes(shape) if split and layout.tensor == 1
                               else [])):
            now = getattr(layout, {"d": "data", "t": "tensor", "e": "expert"}[letter])
            bigger = [n for n in valid if n > now]
            if bigger:
                out.append(_smallest_that_fits(total, layout, letter, bigger, budget,
                                               _mesh_key(cfg)))
    if not inputs["adapters"]:
        flat = TrainLayout(layout.world_size)
        adapters = shape.lora_params(actor.lora_rank, list(actor.target_modules))
        out.append((f"train LoRA adapters (actor.use_lora=true, lora_rank={actor.lora_rank}"
                    + (f", {_mesh_key(cfg)(flat)}: LoRA is data parallel"
                       if flat != layout else "") + ")",
                    total(adapters=adapters, layout=flat, frozen=inputs["frozen"][1:]
                          if actor.kl_ctl and cfg.ref.path == actor.path  # the base is it
                          else inputs["frozen"])))
    if not inputs["gradient_checkpointing"]:
        out.append(("actor.gradient_checkpointing=true", total(gradient_checkpointing=True)))
    tokens = inputs["tokens_per_mb"]
    if tokens >= 2048:
        out.append((f"actor.mb_spec.max_tokens_per_mb={tokens // 4} (now {tokens})",
                    total(tokens_per_mb=tokens // 4)))
    return out


def _mesh_key(cfg: Any) -> Any:
    """How a trainer mesh is spelled in this config: allocation_mode's training part, or
    actor.backend when there is no allocation_mode."""
    alloc = cfg.allocation
    if alloc is None:
        return lambda layout: f"actor.backend {layout.spelling}"
    op = "|" if alloc.colocated else "+"
    return lambda layout: f"allocation_mode {alloc.rollout_part}{op}{layout.spelling}"


def _smallest_that_fits(total: Any, layout: TrainLayout, letter: str, sizes: list[int],
                        budget: int, key: Any) -> tuple[str, int]:
    """The first of `sizes` for dimension `letter` whose rank fits `budget` (else the
    largest), as (the change, the rank's bytes)."""
    field_name = {"d": "data", "t": "tensor", "e": "expert"}[letter]
    for n in sizes:
        changed = layout._replace(**{field_name: n})
        bytes_ = total(layout=changed)
        if bytes_ <= budget:
            break
    what = {"d": "shard over more data groups", "t": "split layers over tensor ranks",
            "e": "split experts over expert ranks"}[letter]
    return f"{what}: {key(changed)} ({changed.world_size} ranks)", bytes_


def _tensor_sizes(shape: ModelShape) -> list[int]:
    """Tensor sizes the trainer can split this model by (whole heads, equal MLP slices);
    none for the model types trainer/parallel.py does not split (MoE models among them)."""
    if shape.model_type not in TENSOR_PARALLEL_MODEL_TYPES:
        return []
    return [t for t in (2, 4, 8) if not (shape.num_heads % t or shape.num_kv_heads % t
                                         or shape.intermediate_size % t)]


def _expert_sizes(shape: ModelShape) -> list[int]:
    return [e for e in (2, 4, 8, 16, 32, 64) if shape.num_experts and not shape.num_experts % e]
