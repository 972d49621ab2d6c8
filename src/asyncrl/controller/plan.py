"""The memory of an RL run per device, worked out from its config before anything starts.

`asyncrl plan --config run.yaml [key=value ...]` prints, for a trainer rank and an inference
server, the bytes of weights, gradients, optimiser state, activations and KV cache, says
whether they fit the device (`--device-gb`, default: this machine's memory on a CPU run, 80
GB on a GPU run) and, when they do not, which change would make them fit.

What a trainer rank holds (FSDP2 over `d` ranks, every parameter sharded d ways):
- fp32 master weights, 4 bytes per parameter, and per trained parameter an fp32 gradient (4)
  and AdamW's two moments (8);
- the compute copy: on a GPU, FSDP2 gathers one decoder layer at a time in bf16 and
  prefetches the next (two layers, plus the embedding and head of the root group); on one
  CPU rank, a persistent bf16 copy of every weight (`trainer/cpu/precision.py`);
- a frozen reference (KL) or teacher: its weights in the compute dtype, sharded d ways;
- activations of one micro-batch of `max_tokens_per_mb` tokens: per decoder layer and token
  what the backward keeps (the layer's input and normed input twice, q, k and v with k and v
  repeated to every head, the attention output, gate, up, their product and its input to
  down), or with gradient checkpointing only each layer's input plus one layer's worth; and
  the log-prob head's chunk of logits.
What an inference server holds (our engine): the weights twice (served and the spare a
weight update fills), the KV cache of `max_batch_size` slots of `max_seq_len` positions, and
one step's transient tensors (`inference/server/memory.py`). vLLM and SGLang take
`rollout.gpu_memory_fraction` of their GPU whatever the model; the plan says so.

The figures are estimates: `benchmarks/memory_plan.py` measures peaks beside them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GiB = 2**30
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
                model_type == "qwen3" else h // heads, intermediate_size=inter,
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
            moe_intermediate_size=c.get("moe_intermediate_size", 0))

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

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of one decoder layer's projections (every expert's, for MoE)."""
        h, d = self.hidden_size, self.head_dim
        attn = [(h, self.num_heads * d), (h, self.num_kv_heads * d), (h, self.num_kv_heads * d),
                (self.num_heads * d, h)]
        if self.num_experts:
            i = self.moe_intermediate_size
            return attn + [(h, i), (h, i), (i, h)] * self.num_experts + [(h, self.num_experts)]
        i = self.intermediate_size
        return attn + [(h, i), (h, i), (i, h)]

    def layer_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        n = sum(a * b for a, b in self.linear_shapes()) + 2 * h  # + the two RMSNorms
        if self.qkv_bias:
            n += (self.num_heads + 2 * self.num_kv_heads) * d
        if self.qk_norm:
            n += 2 * d
        return n

    def embedding_params(self) -> int:
        """The input embedding and the head (one matrix when tied) and the final norm."""
        v, h = self.vocab_size, self.hidden_size
        return v * h * (1 if self.tie_word_embeddings else 2) + h

    @property
    def n_params(self) -> int:
        return self.num_layers * self.layer_params() + self.embedding_params()

    def lora_params(self, rank: int, targets: list[str] | None = None) -> int:
        """Adapter parameters of rank `rank` on every projection of every layer (`targets`
        None or ["all-linear"]) or on the named ones (q_proj, k_proj, v_proj, o_proj,
        gate_proj, up_proj, down_proj)."""
        mlp = ["gate_proj", "up_proj", "down_proj"]
        names = ["q_proj", "k_proj", "v_proj", "o_proj"] + mlp * max(1, self.num_experts)
        shapes = self.linear_shapes()[:len(names)]
        chosen = set(names) if not targets or targets == ["all-linear"] else set(targets)
        unknown = chosen - set(names)
        if unknown:
            raise ValueError(f"actor.target_modules {sorted(unknown)} are not projections of "
                             f"this model; use some of {sorted(set(names))} or 'all-linear'")
        per_layer = sum(rank * (a + b) for name, (a, b) in zip(names, shapes) if name in chosen)
        return self.num_layers * per_layer

    def activation_bytes_per_token_layer(self, dtype_bytes: int = 2) -> int:
        """Bytes one token keeps for the backward of one decoder layer (see the module doc)."""
        h, d, a = self.hidden_size, self.head_dim, self.num_heads
        i = (self.moe_intermediate_size * self.experts_per_token if self.num_experts
             else self.intermediate_size)
        attention = 4 * a * d  # q, k and v at every head, the attention's output
        mlp = 4 * i  # gate, up, act(gate) * up, and the down projection's input
        return dtype_bytes * (4 * h + attention + mlp)


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
        rows.append(f"{'inference server':<28s}")
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


def plan_trainer(shape: ModelShape, *, world_size: int, device: str, tokens_per_mb: int,
                 gradient_checkpointing: bool = False, compute_bytes: int = 2,
                 trainable: int | None = None,
                 frozen: tuple[ModelShape, ...] = ()) -> dict[str, int]:
    """Bytes of one trainer rank (see the module doc). `trainable`: trained parameters (all
    when None; the adapters' count with LoRA); `frozen`: the reference and teacher models
    held beside the actor, each as a train engine without gradients (a LoRA actor's
    reference is the base itself: none)."""
    p, d = shape.n_params, world_size
    trained = p if trainable is None else trainable
    compute = _compute_copy(shape, d, device, compute_bytes)
    per_layer = shape.activation_bytes_per_token_layer(compute_bytes) * tokens_per_mb
    if gradient_checkpointing:
        activations = shape.num_layers * tokens_per_mb * shape.hidden_size * compute_bytes
        activations += per_layer
    else:
        activations = shape.num_layers * per_layer
    head = 3 * min(tokens_per_mb, HEAD_CHUNK_TOKENS) * shape.vocab_size * 4
    plan = {"weights (fp32 master)": 4 * p // d, "weights (compute copy)": compute,
            "gradients (fp32)": 4 * trained // d, "optimiser (AdamW fp32)": 8 * trained // d,
            "activations": activations + head, "runtime": RUNTIME_BYTES[device]}
    if frozen:
        plan["reference/teacher weights"] = sum(
            4 * f.n_params // d + _compute_copy(f, d, device, compute_bytes) for f in frozen)
    return plan


def _compute_copy(shape: ModelShape, world_size: int, device: str, compute_bytes: int) -> int:
    """The compute-dtype weights beside the fp32 masters at their peak."""
    if compute_bytes >= 4:
        return 0
    if device == "cpu" and world_size == 1:  # a persistent copy of every weight
        return compute_bytes * shape.n_params
    # FSDP2: two layers in flight and the root group (embedding, head)
    return compute_bytes * (2 * shape.layer_params() + shape.embedding_params())


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
    from asyncrl.config.allocation import parse_allocation_mode

    actor = cfg.actor
    shape = shape or ModelShape.of(actor.path)
    device = cfg.cluster.device
    if device_bytes is None:
        device_bytes = (80 * GiB if device == "cuda"
                        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    world = cfg.trainer_world_size
    compute_bytes = 2 if actor.dtype == "bfloat16" else 4
    use_lora = getattr(actor, "use_lora", False)
    trainable = (shape.lora_params(actor.lora_rank, list(actor.target_modules))
                 if use_lora else None)
    frozen = []
    if actor.kl_ctl != 0 and not use_lora:  # a LoRA actor's reference is its base
        frozen.append(shape)
    if actor.distill_coef != 0:
        frozen.append(ModelShape.of(cfg.teacher.path))
    plan = Plan(device=device, device_bytes=device_bytes)
    plan.trainer = plan_trainer(
        shape, world_size=world, device=device, tokens_per_mb=actor.mb_spec.max_tokens_per_mb,
        gradient_checkpointing=actor.gradient_checkpointing, compute_bytes=compute_bytes,
        trainable=trainable, frozen=tuple(frozen))
    backend = cfg.rollout.backend or "local"
    colocated = bool(cfg.allocation_mode) and parse_allocation_mode(
        cfg.allocation_mode).colocated
    if device == "cpu":  # every process of the run on this machine
        plan.ranks_per_device, plan.servers_per_device = world, cfg.rollout.n_servers or 1
    elif colocated:
        plan.servers_per_device = 1
    if backend == "local":
        plan.server = plan_local_server(
            shape, max_batch_size=cfg.local_engine.max_batch_size,
            max_seq_len=cfg.local_engine.max_seq_len, device=device,
            dtype_bytes=4 if cfg.local_engine.dtype == "float32" else 2)
    else:
        fraction = cfg.rollout.gpu_memory_fraction or (0.5 if colocated else 0.9)
        weights = 2 * shape.n_params
        rest = int(fraction * device_bytes) - weights
        plan.server = {"weights (bf16)": weights, "KV cache and activations": max(rest, 0)}
        plan.server_note = (f"{backend} takes rollout.gpu_memory_fraction={fraction} of its "
                            "device whatever the model; its KV cache gets what weights leave")
        plan.server_weights_fit = rest > 0
        if rest <= 0:
            plan.server_note += ("; here the weights alone exceed it: raise "
                                 "rollout.gpu_memory_fraction or give each server more GPUs")
    if not plan.fits:
        plan.advice = _advice(cfg, shape, plan, use_lora)
    return plan


def _advice(cfg: Any, shape: ModelShape, plan: Plan, use_lora: bool) -> list[str]:
    """The changes that make the run fit, largest saving first."""
    t, out = plan.trainer, []
    budget = ((plan.device_bytes - plan.servers_per_device * plan.server_total)
              // plan.ranks_per_device)
    over = plan.trainer_total - budget
    if over > 0:
        states = t["weights (fp32 master)"] + t["gradients (fp32)"] + t["optimiser (AdamW fp32)"]
        world = cfg.trainer_world_size
        if states > over:
            need = world
            while need < 4096 and states - states * world / need < over:
                need *= 2
            if need > world:
                out.append(f"shard over more ranks: allocation_mode fsdp:d{need} (weights, "
                           f"gradients and optimiser state: {states / GiB:.1f} GiB now)")
        if not use_lora:
            out.append("train LoRA adapters (actor.use_lora=true): gradients and optimiser "
                       f"state shrink from {12 * shape.n_params / world / GiB:.1f} GiB to a "
                       "few hundred MiB")
        if not cfg.actor.gradient_checkpointing and t["activations"] > budget / 4:
            out.append("actor.gradient_checkpointing=true (activations "
                       f"{t['activations'] / GiB:.1f} GiB)")
        if t["activations"] > budget / 4:
            out.append(f"lower actor.mb_spec.max_tokens_per_mb "
                       f"(now {cfg.actor.mb_spec.max_tokens_per_mb})")
    if plan.server and "KV cache" in plan.server and plan.server_total > budget:
        out.append(f"lower local_engine.max_batch_size (now {cfg.local_engine.max_batch_size}) "
                   f"or local_engine.max_seq_len (now {cfg.local_engine.max_seq_len}): the KV "
                   f"cache takes {plan.server['KV cache'] / GiB:.1f} GiB")
    return out or ["use a device with more memory"]
