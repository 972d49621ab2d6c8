"""Our own decoder forward for Llama-family HF checkpoints, with a static slot KV cache.

Supported `model_type`s: llama, mistral, qwen2 (q/k/v bias), qwen3 (per-head q/k RMSNorm),
qwen3_moe (qwen3's attention; Mixture-of-Experts MLPs in the layers its config names, whose
top-k choices each forward records in `Transformer.last_routes`).
Weights are read from the folder's *.safetensors under their HF names. They are stored
fused (q|k|v in one matrix, gate|up in another) so a layer costs four matmuls instead of
seven. In bfloat16 on CPU the matrices are prepacked for our own matmul kernels
(kernels/decode.c, a whole forward in one C call; bindings and layout in cpu.py) or,
without a C compiler, for oneDNN. A weight update builds a complete new `Weights` off the
decode loop; the engine swaps it in between steps.

The KV cache is preallocated: [layers, slots, kv_heads, max_seq_len, head_dim]. The engine
keeps its active sequences in slots 0..n-1 (it moves the last one into a freed slot), so
decode attends over plain slices of the cache instead of gathering rows every step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.inference.server import vision
from asyncrl.inference.server.cpu_decode import (
    DecodeKernels,
    PackedMatrix,
    can_pack,
    huge_empty,
    huge_zeros,
)
from asyncrl.models import safetensors_file
from asyncrl.models.processors import QWEN_VL_TYPES

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}

# Per model_type: which projections carry a bias and whether q/k get a per-head RMSNorm.
# Llama and Qwen3 put `attention_bias` on q, k, v and o; Qwen2 always biases q, k, v only.
_ARCHS: dict[str, Callable[[dict[str, Any]], dict[str, bool]]] = {
    "llama": lambda c: dict(qkv_bias=c.get("attention_bias", False),
                            o_bias=c.get("attention_bias", False),
                            mlp_bias=c.get("mlp_bias", False), qk_norm=False),
    "mistral": lambda c: dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False),
    "qwen2": lambda c: dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False),
    "qwen3": lambda c: dict(qkv_bias=c.get("attention_bias", False),
                            o_bias=c.get("attention_bias", False),
                            mlp_bias=False, qk_norm=True),
    "qwen3_moe": lambda c: dict(qkv_bias=c.get("attention_bias", False),
                                o_bias=c.get("attention_bias", False),
                                mlp_bias=False, qk_norm=True),
}
# transformers >= 5 holds each MoE layer's experts as two stacked tensors (what our trainer
# publishes); checkpoints on disk and the hub name each expert's matrices.
_FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")
_ROPE_TYPES = ("default", "llama3")


class CheckpointError(ValueError):
    """A weights folder that cannot be loaded into this model (missing, extra or mis-shaped)."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope: dict[str, Any]  # the rope parameters; rope["rope_type"] is one of _ROPE_TYPES
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    # Mixture of Experts (qwen3_moe): the layers whose MLP is a router over `num_experts`
    # SwiGLU experts of `moe_intermediate_size`, `num_experts_per_tok` of them per token,
    # their softmax weights renormalised to sum 1 if `norm_topk_prob`. () : all dense.
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Where the decoder's tensors are in the checkpoint (a vision-language model nests them
    # under model.text_model.), and the prefixes of tensors another module reads (its
    # vision encoder's): the decoder skips those.
    text_prefix: str = "model."
    foreign_prefixes: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> ModelConfig:
        """Parse an HF config.json dict; unsupported architectures or options raise."""
        model_type = c.get("model_type")
        if model_type in (*QWEN_VL_TYPES, "qwen3_vl"):
            raise NotImplementedError(
                f"model_type {model_type!r}: the local engine does not serve Qwen's "
                "vision-language models (their decoder's rotary positions are three-"
                "dimensional, M-RoPE); serve it with vLLM or SGLang (allocation_mode "
                "vllm:d<N>+fsdp:d<M> or sglang:d<N>+fsdp:d<M>)")
        if model_type not in _ARCHS:
            raise NotImplementedError(
                f"model_type {model_type!r} is not supported by the local engine "
                f"(supported: {sorted(_ARCHS)})")
        if c.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(
                f"hidden_act {c['hidden_act']!r} is not supported (only silu)")
        window = c.get("sliding_window")
        if window is not None and (model_type == "mistral" or c.get("use_sliding_window")):
            raise NotImplementedError(
                f"sliding-window attention (sliding_window={window}) is not supported")
        # transformers 5 writes `rope_parameters` (theta inside); 4.x wrote rope_theta and
        # rope_scaling.
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise NotImplementedError(
                f"rope type {rope_type!r} is not supported (supported: {list(_ROPE_TYPES)})")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise NotImplementedError("partial_rotary_factor != 1 is not supported")
        rope["rope_type"] = rope_type
        rope.setdefault("original_max_position_embeddings", c.get("max_position_embeddings"))
        heads = c["num_attention_heads"]
        return cls(
            model_type=model_type, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
            num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)), rope=rope,
            tie_word_embeddings=c.get("tie_word_embeddings", False), **_ARCHS[model_type](c),
            **(_moe_fields(c) if model_type == "qwen3_moe" else {}),
        )


def _moe_fields(c: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of a qwen3_moe config.json, with HF's rule for which layers are sparse:
    not in `mlp_only_layers`, and (layer + 1) a multiple of `decoder_sparse_step`."""
    # config.json from transformers >= 5 says num_local_experts (an attribute map), older
    # ones num_experts
    experts = c.get("num_experts", c.get("num_local_experts", 0))
    top_k, step = c.get("num_experts_per_tok", 0), c.get("decoder_sparse_step", 1)
    mlp_only = c.get("mlp_only_layers") or []
    if experts > 0 and not 1 <= top_k <= experts:
        raise ValueError(f"model config num_experts_per_tok={top_k} must be in [1, "
                         f"num_experts={experts}]")
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"model config decoder_sparse_step={step!r} must be an integer >= 1")
    layers = c["num_hidden_layers"]
    sparse = tuple(n for n in range(layers)
                   if experts > 0 and n not in mlp_only and (n + 1) % step == 0)
    return {"moe_layers": sparse, "num_experts": experts if sparse else 0,
            "num_experts_per_tok": top_k if sparse else 0,
            "moe_intermediate_size": c.get("moe_intermediate_size", 0) if sparse else 0,
            "norm_topk_prob": bool(c.get("norm_topk_prob", False))}


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with llama3 scaling where the config asks for it."""
    dim = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if cfg.rope["rope_type"] != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, and the
    # band in between is interpolated linearly in 1/wavelength.
    factor = cfg.rope["factor"]
    low, high = cfg.rope["low_freq_factor"], cfg.rope["high_freq_factor"]
    old_ctx = cfg.rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back before the weight, as HF does (bf16 parity)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate [..., hd] by position in HF's half-split layout (not interleaved).

    HF computes x * cos + cat(-x2, x1) * sin; with the sign folded into the first half of
    `signed_sin` that is x * cos + roll(x, hd / 2) * signed_sin, with identical rounding.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     bias: torch.Tensor) -> torch.Tensor:
    """Attention of one query per row: q [B, H, 1, hd] over k, v [B, KV, L, hd].

    Written out because SDPA's CPU kernel is several times slower for a single query
    row at batch > 1. Query heads are grouped per KV head (HF's GQA order), and the
    softmax runs in float32, as HF's eager attention does. Scores are computed as
    k @ q^T ([B, KV, L, group]): q @ k^T would make bmm copy the strided cache slice.
    `bias` is the additive mask [B, 1, L, 1].
    """
    b, h, _, hd = q.shape
    kv = k.shape[1]
    scores = torch.matmul(k, q.view(b, kv, h // kv, hd).transpose(-1, -2)).float()
    probs = (scores * hd ** -0.5 + bias).softmax(dim=-2).to(q.dtype)
    return torch.matmul(probs.transpose(-1, -2), v).view(b, h, 1, hd)


def packed_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(n, k) of every matrix `Weights` packs: q|k|v, o, gate|up, down per layer; lm_head."""
    h, hd = cfg.hidden_size, cfg.head_dim
    layer = [((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, h), (h, cfg.num_heads * hd),
             (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]
    return layer * cfg.num_layers + [(cfg.vocab_size, h)]


def fits_kernels(cfg: ModelConfig) -> bool:
    """Whether every matrix of the model has the shape the packed matmul kernels take."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    # q, k and v each whole blocks of 16 rows: `Weights.load` packs them one at a time.
    rows = (q, kv, cfg.hidden_size, 2 * cfg.intermediate_size, cfg.vocab_size)
    cols = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
    return all(n % 16 == 0 for n in rows) and cfg.intermediate_size % 16 == 0 and all(
        k % 2 == 0 for k in cols)


def linear(x: torch.Tensor, w: torch.Tensor | PackedMatrix,
           b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the kernel of a prepacked weight (ours, or oneDNN's)."""
    if isinstance(w, PackedMatrix):
        k = DecodeKernels.load()
        x2 = x.reshape(-1, w.k).contiguous()
        n = w.n // 2 if w.silu else w.n
        y = torch.empty(x2.shape[0], n, dtype=x.dtype)
        fn = k.gemm_silu if w.silu else k.gemm
        fn(x2.data_ptr(), w.k, x2.shape[0], w.k, w.data.data_ptr(), n,
           b.data_ptr() if b is not None else None, y.data_ptr(), n, torch.get_num_threads())
        return y.view(*x.shape[:-1], n)
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)


def moe(h: torch.Tensor, lw: LayerWeights, top_k: int,
        norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse MoE block on [..., hidden]: its output, and the experts each row chose
    [rows, top_k] (in descending router probability).

    As HF's Qwen3MoeSparseMoeBlock: the router's logits in the model dtype, a float32
    softmax over all experts, the top k (renormalised to sum 1 if `norm_topk_prob`) cast
    back, and each chosen expert's SwiGLU output scaled by its weight and summed.
    """
    flat = h.reshape(-1, h.shape[-1])
    probs = F.linear(flat, lw.router).softmax(-1, dtype=torch.float32)
    weights, chosen = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights.to(h.dtype)
    out = torch.zeros_like(flat)
    for e in chosen.unique().tolist():
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        gate, up = F.linear(flat[rows], lw.experts_gate_up[e]).chunk(2, -1)
        y = F.linear(F.silu(gate) * up, lw.experts_down[e])
        out.index_add_(0, rows, y * weights[rows, slot, None])
    return out.view(h.shape), chosen


def mlp(h: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
    """down(silu(gate(h)) * up(h)), with gate and up as one product."""
    if isinstance(lw.w_gate_up, PackedMatrix):
        act = linear(h, lw.w_gate_up, lw.b_gate_up)
    else:
        gate, up = linear(h, lw.w_gate_up, lw.b_gate_up).chunk(2, -1)
        act = F.silu(gate) * up
    return linear(act, lw.w_down, lw.b_down)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor  # [(heads + 2 kv_heads) * hd, hidden]
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor | None  # [2 * intermediate, hidden]; None in an MoE layer
    w_down: torch.Tensor | None
    bqkv: torch.Tensor | None = None
    bo: torch.Tensor | None = None
    b_gate_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    qk_norm: torch.Tensor | None = None  # [heads + kv_heads, hd]: q_norm rows, then k_norm rows
    # An MoE layer's router [experts, hidden] and experts, gate|up [experts, 2 * moe_inter,
    # hidden] and down [experts, hidden, moe_inter], all plain tensors.
    router: torch.Tensor | None = None
    experts_gate_up: torch.Tensor | None = None
    experts_down: torch.Tensor | None = None


def per_expert(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A stacked expert tensor (`_FUSED_EXPERTS`) as each expert's matrices under their
    checkpoint names (views); any other tensor as itself."""
    match = _FUSED_EXPERTS.fullmatch(name)
    if match is None:
        return [(name, tensor)]
    if tensor.dim() != 3:
        raise CheckpointError(f"mis-shaped tensor {name}: {tuple(tensor.shape)}, expected "
                              "[experts, rows, columns]")
    prefix, kind = match.groups()
    if kind == "down_proj":
        return [(f"{prefix}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
    half = tensor.shape[1] // 2  # gate's rows, then up's (HF chunks the product in two)
    return [pair for e in range(tensor.shape[0])
            for pair in ((f"{prefix}.{e}.gate_proj.weight", tensor[e, :half]),
                         (f"{prefix}.{e}.up_proj.weight", tensor[e, half:]))]


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF parameter name of the architecture, with its shape."""
    h, i, hd, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    for n in range(cfg.num_layers):
        a, m = f"model.layers.{n}.self_attn.", f"model.layers.{n}.mlp."
        shapes |= {f"model.layers.{n}.input_layernorm.weight": (h,),
                   f"model.layers.{n}.post_attention_layernorm.weight": (h,),
                   a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h),
                   a + "v_proj.weight": (kv, h), a + "o_proj.weight": (h, q)}
        if n in cfg.moe_layers:
            mi = cfg.moe_intermediate_size
            shapes[m + "gate.weight"] = (cfg.num_experts, h)
            for e in range(cfg.num_experts):
                shapes |= {f"{m}experts.{e}.gate_proj.weight": (mi, h),
                           f"{m}experts.{e}.up_proj.weight": (mi, h),
                           f"{m}experts.{e}.down_proj.weight": (h, mi)}
        else:
            shapes |= {m + "gate_proj.weight": (i, h), m + "up_proj.weight": (i, h),
                       m + "down_proj.weight": (h, i)}
        if cfg.qkv_bias:
            shapes |= {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
        if cfg.o_bias:
            shapes[a + "o_proj.bias"] = (h,)
        if cfg.mlp_bias and n not in cfg.moe_layers:
            shapes |= {m + "gate_proj.bias": (i,), m + "up_proj.bias": (i,),
                       m + "down_proj.bias": (h,)}
        if cfg.qk_norm:
            shapes |= {a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)}
    return {text_name(cfg, n): shape for n, shape in shapes.items()}


def is_foreign(cfg: ModelConfig, name: str) -> bool:
    """Whether checkpoint tensor `name` is another module's than the decoder's."""
    return bool(cfg.foreign_prefixes) and name.startswith(cfg.foreign_prefixes)


def text_name(cfg: ModelConfig, name: str) -> str:
    """The checkpoint name of decoder tensor `name` (as a causal LM's checkpoint has it)."""
    if cfg.text_prefix != "model." and name.startswith("model."):
        return cfg.text_prefix + name[len("model."):]
    return name


class Weights:
    """All parameters in the layout the forward reads: fused (q|k|v in one matrix, gate|up
    in another), cast, and prepacked where possible.

    Built from an HF state dict (`Weights(cfg, tensors, ...)`), or written one HF tensor at a
    time (`load`, then `finish`) into buffers allocated up front (`Weights.empty`). A weight
    update writes into the buffers of the weights the update before swapped out: no new
    memory to fault in, and a tensor goes straight to its place (packed) in one copy.
    `pack`: "asyncrl" (PackedMatrix, for kernels/decode.c), "onednn", or None (plain);
    "auto" takes oneDNN's where this torch has it.
    """

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: str | torch.device = "cpu", pack: str | None = "auto"):
        self._allocate(cfg, dtype, torch.device(device), pack)
        for name, tensor in tensors.items():
            self.load(name, tensor)
        self.finish()

    @classmethod
    def empty(cls, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu",
              pack: str | None = "auto", reuse: Weights | None = None) -> Weights:
        """Weights to `load` into: those of `reuse` if they have this layout, else new ones."""
        device = torch.device(device)
        if pack == "auto":
            pack = "onednn" if can_pack(dtype, device) else None
        if reuse is not None and reuse._layout == (cfg, dtype, device, pack):
            reuse._loaded.clear()
            reuse.complete = False
            return reuse
        weights = cls.__new__(cls)
        weights._allocate(cfg, dtype, device, pack)
        return weights

    @torch.inference_mode()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Write HF tensor `name` into its place; CheckpointError if the model has no such shape."""
        if _FUSED_EXPERTS.fullmatch(name):
            for part, t in per_expert(name, tensor):
                self.load(part, t)
            return
        write = self._writers.get(name)
        if write is None and is_foreign(self._layout[0], name):
            return  # another module's (a vision encoder's), loaded by its owner
        if write is None:
            # A tied checkpoint may still carry lm_head.weight; old ones carry rotary buffers.
            if name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq"):
                return
            raise CheckpointError(f"unexpected tensor {name!r} for this model")
        if tuple(tensor.shape) != self._shapes[name]:
            raise CheckpointError(f"mis-shaped tensor {name}: {tuple(tensor.shape)} != expected "
                                  f"{self._shapes[name]}")
        write(tensor)
        self._loaded.add(name)

    @torch.inference_mode()
    def finish(self) -> None:
        """After the last `load`: CheckpointError if a tensor is missing, else ready to use."""
        missing = sorted(set(self._shapes) - self._loaded)
        if missing:
            raise CheckpointError(f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        for owner, attr, plain in self._reorder:  # oneDNN's layout is its own: made from the whole
            setattr(owner, attr, torch.ops.mkldnn._reorder_linear_weight(plain, 1))
        self.complete = True

    def digest(self) -> str:
        """sha256 of every buffer the forward reads: equal weights, equal digests."""
        h = hashlib.sha256()
        for t in self._storage:
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
        return h.hexdigest()

    @torch.inference_mode()
    def _allocate(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                  pack: str | None) -> None:
        if pack == "auto":
            pack = "onednn" if can_pack(dtype, device) else None
        if pack not in ("asyncrl", "onednn", None):
            raise ValueError(f"pack={pack!r}: expected 'asyncrl', 'onednn', 'auto' or None")
        if pack == "asyncrl" and cfg.moe_layers:
            raise ValueError("pack='asyncrl': the one-call C forward has no MoE layers; "
                             "use 'onednn' or None")
        self.pack = pack
        self.complete = False
        self._layout = (cfg, dtype, device, pack)
        self._shapes = hf_shapes(cfg)
        self._loaded: set[str] = set()
        self._writers: dict[str, Callable[[torch.Tensor], None]] = {}
        self._reorder: list[tuple[Any, str, torch.Tensor]] = []  # oneDNN: made by `finish`
        self._storage: list[torch.Tensor] = []  # every buffer, for `digest`

        def new(*shape: int) -> torch.Tensor:
            t = (huge_empty(shape, dtype) if device.type == "cpu"
                 else torch.empty(shape, dtype=dtype, device=device))
            self._storage.append(t)
            return t

        def copy_into(dst: torch.Tensor) -> Callable[[torch.Tensor], None]:
            return lambda t: dst.copy_(t)

        # Our packed matrices go into one buffer on 2 MB pages (see `huge_empty`), each at a
        # 64-byte aligned offset; zeroed once so that the gaps hash the same (`digest`).
        def aligned(numel: int) -> int:
            return -(-numel // 32) * 32

        arena, offset = None, 0
        if pack == "asyncrl":
            arena = new(sum(aligned(n * k) for n, k in packed_shapes(cfg))).zero_()

        def matrix(owner: Any, attr: str, parts: list[tuple[str, int]], k: int,
                   silu: bool = False) -> None:
            """owner.attr = the matrix of `parts` (HF name, rows) stacked; a writer per part."""
            nonlocal offset
            n = sum(rows for _, rows in parts)
            if pack == "asyncrl":  # [n / 16, k / 2, 16, 2]: rows in blocks of 16 (cpu.py)
                data = arena[offset:offset + n * k].view(n // 16, k // 2, 16, 2)
                offset += aligned(n * k)
                setattr(owner, attr, PackedMatrix(data, n, k, silu))
                # gate|up: gate's blocks and up's alternate (PackedMatrix.pack)
                halves = data.view(n // 32, 2, k // 2, 16, 2) if silu else None
                start = 0
                for j, (name, rows) in enumerate(parts):
                    dst = halves[:, j] if silu else data[start // 16:(start + rows) // 16]
                    self._writers[name] = lambda t, dst=dst: _pack_rows(t.to(dtype), dst)
                    start += rows
                return
            plain = new(n, k)
            setattr(owner, attr, plain)
            if pack == "onednn":
                self._reorder.append((owner, attr, plain))
            start = 0
            for name, rows in parts:
                self._writers[name] = copy_into(plain[start:start + rows])
                start += rows

        def vector(parts: list[tuple[str, int]], silu: bool = False) -> torch.Tensor:
            """A (fused) bias or norm weight, a writer per part."""
            out = new(sum(rows for _, rows in parts))
            if silu and pack == "asyncrl":  # gate|up in the interleaved order of its matrix
                for j, (name, rows) in enumerate(parts):
                    self._writers[name] = lambda t, j=j: out.view(-1, 2, 16)[:, j].copy_(
                        t.view(-1, 16))
                return out
            start = 0
            for name, rows in parts:
                self._writers[name] = copy_into(out[start:start + rows])
                start += rows
            return out

        h, hd, inter, vocab = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
        q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd

        def experts(lw: LayerWeights, m: str) -> None:
            """An MoE layer's router and stacked experts, a writer per checkpoint tensor."""
            n_exp, mi = cfg.num_experts, cfg.moe_intermediate_size
            lw.router = new(n_exp, h)
            lw.experts_gate_up, lw.experts_down = new(n_exp, 2 * mi, h), new(n_exp, h, mi)
            self._writers[m + "gate.weight"] = copy_into(lw.router)
            for e in range(n_exp):
                self._writers |= {
                    f"{m}experts.{e}.gate_proj.weight": copy_into(lw.experts_gate_up[e, :mi]),
                    f"{m}experts.{e}.up_proj.weight": copy_into(lw.experts_gate_up[e, mi:]),
                    f"{m}experts.{e}.down_proj.weight": copy_into(lw.experts_down[e])}

        self.embed = new(vocab, h)
        self.norm = vector([("model.norm.weight", h)])
        if cfg.tie_word_embeddings and pack == "asyncrl":  # packed again as the output matrix
            matrix(self, "lm_head", [("model.embed_tokens.weight", vocab)], h)
            pack_lm_head = self._writers["model.embed_tokens.weight"]

            def write_embed(t: torch.Tensor) -> None:
                self.embed.copy_(t)
                pack_lm_head(t)

            self._writers["model.embed_tokens.weight"] = write_embed
        else:
            self._writers["model.embed_tokens.weight"] = copy_into(self.embed)
            if not cfg.tie_word_embeddings:
                matrix(self, "lm_head", [("lm_head.weight", vocab)], h)
            elif pack == "onednn":
                self._reorder.append((self, "lm_head", self.embed))
            else:
                self.lm_head = self.embed
        self.layers: list[LayerWeights] = []
        for n in range(cfg.num_layers):
            a, m = f"model.layers.{n}.self_attn.", f"model.layers.{n}.mlp."
            lw = LayerWeights(
                attn_norm=vector([(f"model.layers.{n}.input_layernorm.weight", h)]),
                mlp_norm=vector([(f"model.layers.{n}.post_attention_layernorm.weight", h)]),
                wqkv=None, wo=None, w_gate_up=None, w_down=None)
            matrix(lw, "wqkv", [(a + "q_proj.weight", q), (a + "k_proj.weight", kv),
                                (a + "v_proj.weight", kv)], h)
            matrix(lw, "wo", [(a + "o_proj.weight", h)], q)
            if n in cfg.moe_layers:
                experts(lw, m)
            else:
                matrix(lw, "w_gate_up", [(m + "gate_proj.weight", inter),
                                         (m + "up_proj.weight", inter)], h, silu=True)
                matrix(lw, "w_down", [(m + "down_proj.weight", h)], inter)
            if cfg.qkv_bias:
                lw.bqkv = vector([(a + "q_proj.bias", q), (a + "k_proj.bias", kv),
                                  (a + "v_proj.bias", kv)])
            if cfg.o_bias:
                lw.bo = vector([(a + "o_proj.bias", h)])
            if cfg.mlp_bias and n not in cfg.moe_layers:
                lw.b_gate_up = vector([(m + "gate_proj.bias", inter),
                                       (m + "up_proj.bias", inter)], silu=True)
                lw.b_down = vector([(m + "down_proj.bias", h)])
            if cfg.qk_norm:  # [heads + kv_heads, hd]: q_norm's row per query head, then k_norm's
                norms = new(cfg.num_heads + cfg.num_kv_heads, hd)
                self._writers[a + "q_norm.weight"] = lambda t, o=norms[:cfg.num_heads]: o.copy_(
                    t.expand_as(o))
                self._writers[a + "k_norm.weight"] = lambda t, o=norms[cfg.num_heads:]: o.copy_(
                    t.expand_as(o))
                lw.qk_norm = norms
            self.layers.append(lw)
        self._writers = {text_name(cfg, n): w for n, w in self._writers.items()}
        # For the one-call decode step: each layer's 12 pointers, in kernels/decode.c's order
        # (the buffers stay where they are, so these hold for every later `load`).
        self.pointers = None
        if pack == "asyncrl":
            def ptr(t: torch.Tensor | PackedMatrix | None, row: int = 0) -> int:
                if t is None:
                    return 0
                t = t.data if isinstance(t, PackedMatrix) else t
                return t[row].data_ptr() if t.dim() > 1 else t.data_ptr()

            heads = cfg.num_heads
            self.pointers = torch.tensor([
                [ptr(lw.attn_norm), ptr(lw.wqkv), ptr(lw.bqkv), ptr(lw.qk_norm),
                 ptr(lw.qk_norm, heads) if lw.qk_norm is not None else 0, ptr(lw.wo), ptr(lw.bo),
                 ptr(lw.mlp_norm), ptr(lw.w_gate_up), ptr(lw.b_gate_up), ptr(lw.w_down),
                 ptr(lw.b_down)] for lw in self.layers], dtype=torch.int64)


def _pack_rows(w: torch.Tensor, dst: torch.Tensor) -> None:
    """Pack rows w [n, k] into dst [n / 16, k / 2, 16, 2] (PackedMatrix's layout).

    Each pair of bf16 columns moves as one int32: the copy runs ~8x faster than with
    2-element rows.
    """
    n, k = w.shape
    src = w.contiguous().view(torch.int32).view(n // 16, 16, k // 2).transpose(1, 2)
    dst.view(torch.int32)[..., 0].copy_(src)


def read_checkpoint(path: str, shapes: dict[str, tuple[int, ...]],
                    ignore: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Read every *.safetensors in `path` and check names and shapes against `shapes`
    (names starting with one of `ignore` may be there too)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(path):
        tensors.update(read_checkpoint_file(f))
    check_tensors({n: tuple(t.shape) for n, t in tensors.items()}, shapes, f"checkpoint {path!r}",
                  ignore)
    return tensors


@contextlib.contextmanager
def mapped_checkpoint(path: str, shapes: dict[str, tuple[int, ...]],
                      ignore: tuple[str, ...] = ()) -> Iterator[dict[str, torch.Tensor]]:
    """`read_checkpoint` without copying: the tensors are views of the files' mappings,
    valid inside the block only (a weight load copies each into its own buffers). Files
    with dtypes the mapping does not name are read by safetensors itself."""
    with contextlib.ExitStack() as stack:
        tensors: dict[str, torch.Tensor] = {}
        for f in checkpoint_files(path):
            try:
                tensors.update(stack.enter_context(safetensors_file.mapped(f)))
            except safetensors_file.SafetensorsFormatError:
                tensors.update(read_checkpoint_file(f))  # its own error if it is not whole
            except OSError as e:
                raise CheckpointError(f"cannot read {f!r}: {e}") from e
        check_tensors({n: tuple(t.shape) for n, t in tensors.items()}, shapes,
                      f"checkpoint {path!r}", ignore)
        try:
            yield tensors
        finally:
            tensors.clear()


def checkpoint_files(path: str) -> list[str]:
    """The *.safetensors files of folder `path`; CheckpointError if there are none."""
    if not os.path.isdir(path):
        raise CheckpointError(f"weights path {path!r} is not a folder")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path!r}")
    return files


def read_checkpoint_file(file: str) -> dict[str, torch.Tensor]:
    """One *.safetensors file's tensors (copies); CheckpointError if it cannot be read."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(file)
    except (OSError, SafetensorError) as e:  # e.g. a file still being written
        raise CheckpointError(f"cannot read {file!r}: {e}") from e


def check_tensors(found: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]],
                  what: str, ignore: tuple[str, ...] = ()) -> None:
    """CheckpointError naming the missing, unexpected and mis-shaped tensors of `found`
    (names starting with one of `ignore` are another module's: never unexpected)."""
    found = {part: tuple(t.shape) for name, shape in found.items()
             for part, t in per_expert(name, torch.empty(shape, device="meta"))}
    # A tied checkpoint may still carry lm_head.weight; old ones carry rotary buffers.
    ignorable = {n for n in found if n.endswith("rotary_emb.inv_freq")
                 or (ignore and n.startswith(ignore))}
    if "lm_head.weight" not in shapes:
        ignorable.add("lm_head.weight")
    missing = sorted(set(shapes) - set(found))
    unexpected = sorted(set(found) - set(shapes) - ignorable)
    bad_shapes = [f"{n}: {tuple(found[n])} != expected {shape}"
                  for n, shape in shapes.items() if n in found and tuple(found[n]) != shape]
    problems = [f"{kind} tensors {names[:5]}{' ...' if len(names) > 5 else ''}"
                for kind, names in (("missing", missing), ("unexpected", unexpected),
                                    ("mis-shaped", bad_shapes)) if names]
    if problems:
        raise CheckpointError(f"{what} does not fit the model: " + "; ".join(problems))


def load_config(path: str) -> tuple[ModelConfig, dict[str, Any]]:
    """The parsed config and the raw config.json of an HF folder."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{path!r} has no config.json; is it an HF model folder?")
    with open(config_file) as f:
        raw = json.load(f)
    if vision.is_vision_language(raw):  # our decoder runs its text part
        cfg = ModelConfig.from_hf(vision.text_config(raw))
        return dataclasses.replace(cfg, text_prefix=vision.TEXT_PREFIX,
                                   foreign_prefixes=vision.VISION_PREFIXES), raw
    return ModelConfig.from_hf(raw), raw


def _embed(tokens: torch.Tensor, table: torch.Tensor,
           embeds: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The tokens' embeddings, with `embeds`' values (mask, values) where its mask is True."""
    x = F.embedding(tokens, table)
    if embeds is not None:
        mask, values = embeds
        x[mask] = values.to(x.dtype)
    return x


@dataclass
class KVCache:
    """Static per-slot keys and values: [layers, slots, kv_heads, max_seq_len, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]

    @torch.inference_mode()
    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst`."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


class Transformer:
    """A Llama-family decoder: batched prefill into cache slots and batched one-token decode."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype = torch.bfloat16,
                 max_seq_len: int = 2048, device: str | torch.device = "cpu"):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.w: Weights | None = None  # set by from_pretrained, or swapped in by the engine
        freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), rope_inv_freq(cfg))
        emb = torch.cat((freqs, freqs), dim=-1)
        half = emb.shape[-1] // 2
        sin = torch.cat((-emb[:, :half].sin(), emb[:, half:].sin()), dim=-1)  # see apply_rope
        # Cast to the model dtype as HF does before rotating, so bf16 rotations agree.
        self.cos, self.sin = emb.cos().to(dtype).to(device), sin.to(dtype).to(device)
        # bf16 on CPU: the steps between matmuls of a decode step run as C kernels.
        # (Not for MoE layers, which the C forward does not have.)
        use_kernels = self.device.type == "cpu" and dtype == torch.bfloat16 and not cfg.moe_layers
        self.kernels = DecodeKernels.load() if use_kernels else None
        # The experts each MoE layer chose in the last prefill or decode, int16: [B, T,
        # MoE layers, top_k] after a prefill (padded positions included), [B, MoE layers,
        # top_k] after a decode; None for a dense model.
        self.last_routes: torch.Tensor | None = None
        self._buffers: dict[str, torch.Tensor] = {}  # scratch of the C forward, reused

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype = torch.bfloat16,
                        max_seq_len: int = 2048, device: str | torch.device = "cpu") -> Transformer:
        """Build the model of an HF folder and load its weights."""
        cfg, _ = load_config(path)
        model = cls(cfg, dtype=dtype, max_seq_len=max_seq_len, device=device)
        model.w = model.read_weights(path)
        return model

    def read_weights(self, path: str) -> Weights:
        """Weights of the safetensors folder `path`, checked against this architecture.

        Slow (disk, casting, packing) and side-effect free, so callers run it off the
        decode loop and swap the result in (`self.w = ...`) at a step boundary.
        """
        tensors = read_checkpoint(path, hf_shapes(self.cfg), self.cfg.foreign_prefixes)
        tensors = {n: t for n, t in tensors.items() if not is_foreign(self.cfg, n)}
        return Weights(self.cfg, tensors, self.dtype, self.device, pack=self.pack_mode())

    def new_weights(self, reuse: Weights | None = None) -> Weights:
        """Empty weights of this model to `load` into (`reuse`'s buffers where they fit)."""
        return Weights.empty(self.cfg, self.dtype, self.device, pack=self.pack_mode(), reuse=reuse)

    def pack_mode(self) -> str | None:
        """How this model's weights are packed: for our kernels where they run, else oneDNN's."""
        if self.kernels is not None and self.kernels.has_gemm and fits_kernels(self.cfg):
            return "asyncrl"
        return "onednn" if can_pack(self.dtype, self.device) else None

    def new_cache(self, max_batch_size: int, max_seq_len: int) -> KVCache:
        """A zeroed cache of `max_batch_size` slots of `max_seq_len` positions."""
        if max_seq_len > self.cos.shape[0]:
            raise ValueError(f"cache of {max_seq_len} positions exceeds the rope table "
                             f"({self.cos.shape[0]})")
        c = self.cfg
        shape = (c.num_layers, max_batch_size, c.num_kv_heads, max_seq_len, c.head_dim)
        if self.device.type == "cpu":
            return KVCache(huge_zeros(shape, self.dtype), huge_zeros(shape, self.dtype))
        return KVCache(torch.zeros(shape, dtype=self.dtype, device=self.device),
                       torch.zeros(shape, dtype=self.dtype, device=self.device))

    def _qkv(self, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Project [B, T, hidden] to rotated q [B, H, T, hd] and k, v [B, KV, T, hd].

        q and k heads are normed and rotated together (one op each instead of two).
        """
        c = self.cfg
        b, t, _ = h.shape
        qkv = linear(h, lw.wqkv, lw.bqkv).view(b, t, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        qk, v = qkv.split([c.num_heads + c.num_kv_heads, c.num_kv_heads], dim=2)
        if lw.qk_norm is not None:
            qk = rms_norm(qk, lw.qk_norm, c.rms_norm_eps)
        q, k = apply_rope(qk, cos, sin).split([c.num_heads, c.num_kv_heads], dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend) -> torch.Tensor:
        """Run every decoder layer; `attend(layer, q, k, v)` owns the cache traffic."""
        c = self.cfg
        b, t, _ = x.shape
        routes = []
        for n, lw in enumerate(self.w.layers):
            q, k, v = self._qkv(lw, rms_norm(x, lw.attn_norm, c.rms_norm_eps), cos, sin)
            o = attend(n, q, k, v).transpose(1, 2).reshape(b, t, -1)
            x = x + linear(o, lw.wo, lw.bo)
            h = rms_norm(x, lw.mlp_norm, c.rms_norm_eps)
            if lw.router is None:
                x = x + mlp(h, lw)
                continue
            out, chosen = moe(h, lw, c.num_experts_per_tok, c.norm_topk_prob)
            x = x + out
            routes.append(chosen.to(torch.int16).view(b, t, -1))
        self.last_routes = torch.stack(routes, dim=2) if routes else None
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(x, self.w.norm, self.cfg.rms_norm_eps), self.w.lm_head)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, cache: KVCache, slot_start: int,
                *, all_logits: bool = False,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Right-padded prompts [B, T] into slots slot_start.., returning last-token logits [B, V].

        With `all_logits`, logits at every position [B, T, V] (for tests and scoring).
        `embeds` (mask bool [B, T], values [n, hidden]): the input embeddings of the n
        positions where mask is True, in place of their tokens' (image features).
        """
        b, t = tokens.shape
        if self.fused:
            valid = torch.arange(t)[None, :] < lengths[:, None]  # [B, T]
            rows_b, rows_t = valid.nonzero(as_tuple=True)  # prompt by prompt, in order
            ends = lengths.cumsum(0) - 1  # each prompt's last row
            if embeds is not None:
                embeds = (embeds[0][rows_b, rows_t], embeds[1])
            logits = self.forward_rows(tokens[rows_b, rows_t], rows_b + slot_start, rows_t,
                                        cache, None if all_logits else ends, embeds)
            if not all_logits:
                return logits
            full = logits.new_zeros(b, t, logits.shape[-1])  # padded positions: 0
            full[rows_b, rows_t] = logits
            return full
        pos = torch.arange(t, device=self.device)
        # Causal, and no query may look at a padding key; padded queries still see key 0,
        # so no row is fully masked (which would give NaN).
        mask = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < lengths[:, None, None])
        mask = mask[:, None]

        def attend(n: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.k[n, slot_start:slot_start + b, :, :t] = k
            cache.v[n, slot_start:slot_start + b, :, :t] = v
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        cos, sin = self.cos[:t, None], self.sin[:t, None]  # [T, 1, hd] against [B, T, heads, hd]
        x = _embed(tokens, self.w.embed, embeds)
        x = self._layers(x, cos, sin, attend)
        if all_logits:
            return self._logits(x)
        return self._logits(x[torch.arange(b, device=self.device), lengths - 1])

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
               kv_len: int) -> torch.Tensor:
        """One token for each of slots 0..B-1 at `positions` [B]; logits [B, V].

        `kv_len` = max(positions) + 1 bounds the attended cache slice.
        """
        if self.fused:
            return self.forward_rows(tokens, None, positions, cache, None)
        if self.kernels is not None:
            return self._decode_with_kernels(tokens, positions, cache)
        b, kv, t = tokens.shape[0], self.cfg.num_kv_heads, cache.max_seq_len
        # Row of each new key in a layer's cache viewed as [slots * kv * max_seq_len, hd]:
        # one index_copy_ per layer writes every (slot, head) at its own position.
        heads = torch.arange(kv, device=self.device)
        rows = torch.arange(b, device=self.device)
        dest = ((rows[:, None] * kv + heads[None, :]) * t + positions[:, None]).reshape(-1)
        # Additive mask, built once for all layers: each row sees its own positions only.
        visible = torch.arange(kv_len, device=self.device)[None, :] <= positions[:, None]
        bias = torch.zeros(b, 1, kv_len, 1, device=self.device)
        bias.masked_fill_(~visible[:, None, :, None], float("-inf"))

        def attend(n: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.k[n].view(-1, k.shape[-1]).index_copy_(0, dest, k.reshape(b * kv, -1))
            cache.v[n].view(-1, v.shape[-1]).index_copy_(0, dest, v.reshape(b * kv, -1))
            return decode_attention(q, cache.k[n, :b, :, :kv_len], cache.v[n, :b, :, :kv_len], bias)

        # [B, 1, 1, hd] against [B, 1, heads, hd]
        cos, sin = self.cos[positions][:, None, None], self.sin[positions][:, None, None]
        x = self._layers(F.embedding(tokens[:, None], self.w.embed), cos, sin, attend)
        if self.last_routes is not None:
            self.last_routes = self.last_routes[:, 0]
        return self._logits(x[:, 0])

    def _decode_with_kernels(self, tokens: torch.Tensor, positions: torch.Tensor,
                             cache: KVCache) -> torch.Tensor:
        """`decode` with the C kernels around oneDNN's matmuls: 3 calls a layer between them.

        Same roundings as the torch path; attention runs over each sequence's exact length
        in float32 (no mask, no padded slice).
        """
        c, k, w = self.cfg, self.kernels, self.w
        b, h, kv, hd = tokens.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        group, t, eps = h // kv, cache.max_seq_len, c.rms_norm_eps
        threads = torch.get_num_threads()
        x = F.embedding(tokens, w.embed)  # [B, hidden], the residual stream (updated in place)
        normed = torch.empty_like(x)
        o = torch.empty(b, h * hd, dtype=self.dtype)
        act = torch.empty(b, c.intermediate_size, dtype=self.dtype)
        norm_work = torch.empty(max(c.hidden_size, hd), dtype=torch.float32)
        attn_work = torch.empty(threads * (2 * group * hd + group * t + hd), dtype=torch.float32)
        pos = positions.contiguous()
        cos, sin = self.cos.data_ptr(), self.sin.data_ptr()
        k.add_rms_norm(x.data_ptr(), None, w.layers[0].attn_norm.data_ptr(), normed.data_ptr(),
                       b, c.hidden_size, eps, norm_work.data_ptr())
        for n, lw in enumerate(w.layers):
            qkv = linear(normed, lw.wqkv, lw.bqkv)
            qn = kn = None
            if lw.qk_norm is not None:
                qn, kn = lw.qk_norm[0].data_ptr(), lw.qk_norm[h].data_ptr()
            k.rope_attention(qkv.data_ptr(), qkv.stride(0), qn, kn, cos, sin,
                             cache.k[n].data_ptr(), cache.v[n].data_ptr(), pos.data_ptr(),
                             o.data_ptr(), b, h, kv, hd, t, hd ** -0.5, eps,
                             attn_work.data_ptr(), threads)
            # Each matmul result is bound to a name: the kernel reads it after data_ptr()
            # returns, so the tensor must still be alive then.
            attn_out = linear(o, lw.wo, lw.bo)
            k.add_rms_norm(x.data_ptr(), attn_out.data_ptr(), lw.mlp_norm.data_ptr(),
                           normed.data_ptr(), b, c.hidden_size, eps, norm_work.data_ptr())
            gate_up = linear(normed, lw.w_gate_up, lw.b_gate_up)
            k.silu_mul(gate_up.data_ptr(), act.data_ptr(), b, c.intermediate_size)
            mlp_out = linear(act, lw.w_down, lw.b_down)
            nxt = w.layers[n + 1].attn_norm if n + 1 < len(w.layers) else w.norm
            k.add_rms_norm(x.data_ptr(), mlp_out.data_ptr(), nxt.data_ptr(), normed.data_ptr(),
                           b, c.hidden_size, eps, norm_work.data_ptr())
        return linear(normed, w.lm_head)

    @property
    def fused(self) -> bool:
        """Whether `forward_rows` (the one-call C forward) runs for the current weights."""
        return self.kernels is not None and self.w is not None and self.w.pointers is not None

    @torch.inference_mode()
    def forward_rows(self, tokens: torch.Tensor, slots: torch.Tensor | None,
                      positions: torch.Tensor, cache: KVCache,
                      out_rows: torch.Tensor | None,
                      embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [n, V] of rows `out_rows` (all if None) of the token rows `tokens` [R] at
        cache slots `slots` (0..R-1 if None) and `positions`, as one C call
        (kernels/decode.c forward_rows_bf16): our packed matmuls and the kernels between
        them in one OpenMP parallel region. A prompt's rows attend each other causally.
        `embeds` (mask [R], values): as `prefill`'s."""
        c, w = self.cfg, self.w
        r, h, kv, hd = tokens.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        e, i, t, v = c.hidden_size, c.intermediate_size, cache.max_seq_len, c.vocab_size
        n_out = r if out_rows is None else out_rows.shape[0]
        threads = torch.get_num_threads()
        per_thread = max(e, 2 * (h // kv) * hd + (h // kv) * t + hd)
        x = _embed(tokens, w.embed, embeds)  # [R, hidden], the residual stream (updated in place)
        buf = self._scratch("buf", r * (2 * e + (2 * h + 2 * kv) * hd + i) + n_out * e,
                            self.dtype)
        work = self._scratch("work", threads * per_thread, torch.float32)
        logits = torch.empty(n_out, v, dtype=self.dtype)
        pos = positions.to(torch.int64).contiguous()
        slots = slots.to(torch.int64).contiguous() if slots is not None else None
        rows = out_rows.to(torch.int64).contiguous() if out_rows is not None else None
        self.kernels.forward_rows(
            w.pointers.data_ptr(), c.num_layers, w.norm.data_ptr(), w.lm_head.data.data_ptr(), v,
            x.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(), cache.k[0].numel(),
            slots.data_ptr() if slots is not None else None, pos.data_ptr(), r,
            rows.data_ptr() if rows is not None else None, n_out, self.cos.data_ptr(),
            self.sin.data_ptr(), e, h, kv, hd, i, t, hd ** -0.5, c.rms_norm_eps, buf.data_ptr(),
            work.data_ptr(), per_thread, logits.data_ptr(), threads)
        return logits

    def _scratch(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reused buffer of at least `numel` elements (grown on demand, never shrunk)."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype)
        return buf[:numel]
