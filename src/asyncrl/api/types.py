"""The typed data that crosses process and package boundaries.

Token alignment, used everywhere: per-token arrays have one entry per token of
`input_ids`. Entry t of `behavior_logprobs` is log p(input_ids[t] | input_ids[:t]); prompt
positions hold 0.0 and a version of -1. The trainer's recomputed log-probs use the same
alignment, so the three log-probabilities of the decoupled objective line up index for index.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch


class StopReason(str, enum.Enum):
    STOP = "stop"  # a stop token or stop string was produced
    LENGTH = "length"  # max_new_tokens (or the context limit) was reached
    ABORT = "abort"  # the request was cancelled


GREEDY_BELOW = 1e-5


@dataclass(kw_only=True)
class SamplingParams:
    """How to sample one completion; a temperature below GREEDY_BELOW (0 included) means
    greedy, as in vLLM (dividing logits by it would overflow)."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # keep going past the model's EOS tokens (benchmarks, tests)
    # The request's own random stream: the same seed, prompt and weights sample the same
    # tokens whatever else the server batches with it. None: the server's shared stream.
    seed: int | None = None
    # The most likely tokens and their log-probs to return beside each sampled token (under
    # the distribution its log-prob is taken from); 0: none. Our own engine only.
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop_token_ids": list(self.stop_token_ids),
            "stop": list(self.stop),
            "ignore_eos": self.ignore_eos,
            **({"seed": self.seed} if self.seed is not None else {}),
            **({"top_logprobs": self.top_logprobs} if self.top_logprobs else {}),
        }


# The key under which the rollout gives an item its sampling seed (rollout.seeded_sampling).
SAMPLING_SEED_KEY = "sampling_seed"


def mix_seed(seed: int, *parts: int) -> int:
    """A seed in [0, 2**63) derived from `seed` and `parts` (splitmix64 steps): the seed of
    draw `parts` of a run, of sample `parts` of an item."""
    x = seed % 2**64
    for part in parts:
        x = (x ^ (part % 2**64)) + 0x9E3779B97F4A7C15 & (2**64 - 1)
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & (2**64 - 1)
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & (2**64 - 1)
        x ^= x >> 31
    return x >> 1


def piece_seed(seed: int | None, n_done: int) -> int | None:
    """The seed of a generation continued after its first `n_done` tokens (a server resumed
    after a weight update): `seed` itself for the first piece, and a new stream after it, so
    that a continuation does not replay the draws its first piece used."""
    return seed if seed is None or n_done == 0 else mix_seed(seed, n_done)


def hash_arrays(digest: Any, *arrays: Any) -> None:
    """Feed each numpy array's dtype, shape and bytes to a hashlib `digest` (None: skipped)."""
    for array in arrays:
        if array is not None:
            digest.update(repr((array.dtype.str, array.shape)).encode())
            digest.update(array.tobytes())


@dataclass(kw_only=True)
class ImageInputs:
    """The images of one prompt as the model's image processor made them, in one of two
    layouts; the prompt's image tokens stand for them, in order.

    Tiles (Idefics3 / SmolVLM: an image is several tiles): `pixel_values` float32 [tiles,
    channels, height, width] and `pixel_attention_mask` bool [tiles, height, width] (True on
    real pixels; None: all real). An item is a tile.

    Patches (Qwen2-VL / Qwen2.5-VL): `pixel_values` float32 [patches, patch values], the
    images' patches one image after the other, and `image_grid_thw` long [images, 3], each
    image's grid of patches (temporal, height, width). An item is an image.
    """

    pixel_values: torch.Tensor
    pixel_attention_mask: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    def __post_init__(self) -> None:
        pv, mask, grid = self.pixel_values, self.pixel_attention_mask, self.image_grid_thw
        if grid is not None:
            if (grid.dtype != torch.int64 or grid.dim() != 2 or grid.shape[0] == 0
                    or grid.shape[1] != 3 or bool((grid <= 0).any())):
                raise ValueError("image_grid_thw must be int64 [images >= 1, 3] of positive "
                                 f"(temporal, height, width) patch counts, got {grid.dtype} "
                                 f"{grid.tolist() if grid.numel() <= 12 else list(grid.shape)}")
            if pv.dtype != torch.float32 or pv.dim() != 2 or mask is not None:
                raise ValueError("with image_grid_thw, pixel_values must be float32 [patches, "
                                 f"patch values] and no pixel_attention_mask, got {pv.dtype} "
                                 f"{list(pv.shape)}")
            if pv.shape[0] != int(grid.prod(-1).sum()):
                raise ValueError(f"pixel_values holds {pv.shape[0]} patches but image_grid_thw "
                                 f"{grid.tolist()} makes {int(grid.prod(-1).sum())}")
            return
        if pv.dtype != torch.float32 or pv.dim() != 4 or pv.shape[0] == 0:
            raise ValueError("pixel_values must be float32 [tiles >= 1, channels, height, width], "
                             f"got {pv.dtype} {list(pv.shape)}")
        if mask is not None and (mask.dtype != torch.bool
                                 or tuple(mask.shape) != (pv.shape[0], *pv.shape[2:])):
            raise ValueError(f"pixel_attention_mask must be bool {[pv.shape[0], *pv.shape[2:]]} "
                             f"(tiles, height, width), got {mask.dtype} {list(mask.shape)}")

    @classmethod
    def from_processor(cls, features: Any) -> ImageInputs:
        """The images of an HF processor's output for one prompt: pixel_values [1, tiles,
        ...] (and pixel_attention_mask [1, tiles, h, w] if it has one), or pixel_values
        [patches, ...] with image_grid_thw."""
        pv, grid = features["pixel_values"], features.get("image_grid_thw")
        if grid is not None:
            return cls(pixel_values=pv.float(), image_grid_thw=grid.long())
        mask = features.get("pixel_attention_mask")
        if pv.shape[0] != 1:
            raise ValueError(f"from_processor takes one prompt's images, got {pv.shape[0]}")
        return cls(pixel_values=pv[0].float(), pixel_attention_mask=None if mask is None
                   else mask[0].bool())

    @property
    def n_items(self) -> int:
        """Tiles, or images in the patch layout."""
        if self.image_grid_thw is not None:
            return self.image_grid_thw.shape[0]
        return self.pixel_values.shape[0]

    def item_sizes(self) -> list[int]:
        """The rows of `pixel_values` each item takes (1 per tile; an image's patches)."""
        if self.image_grid_thw is not None:
            return self.image_grid_thw.prod(-1).tolist()
        return [1] * self.pixel_values.shape[0]

    def items(self, start: int, stop: int) -> ImageInputs:
        """Items `start` to `stop` (exclusive) alone."""
        sizes = self.item_sizes()
        lo, hi = sum(sizes[:start]), sum(sizes[:stop])
        mask, grid = self.pixel_attention_mask, self.image_grid_thw
        return ImageInputs(pixel_values=self.pixel_values[lo:hi],
                           pixel_attention_mask=None if mask is None else mask[lo:hi],
                           image_grid_thw=None if grid is None else grid[start:stop])

    def digest(self) -> bytes:
        """A 16-byte hash of the pixels, mask and grids (with their dtypes and shapes):
        images equal pixel for pixel hash alike."""
        digest = hashlib.blake2b(digest_size=16)
        hash_arrays(digest, *(None if t is None else t.detach().cpu().contiguous().numpy()
                              for t in (self.pixel_values, self.pixel_attention_mask,
                                        self.image_grid_thw)))
        return digest.digest()

    def starts_with(self, other: ImageInputs) -> bool:
        """Whether `other`'s items are this one's first items (an earlier turn's images)."""
        if (other.image_grid_thw is None) != (self.image_grid_thw is None) or \
                other.n_items > self.n_items:
            return False
        head = self.items(0, other.n_items)
        return torch.equal(head.pixel_values, other.pixel_values) and (
            other.image_grid_thw is None
            or torch.equal(head.image_grid_thw, other.image_grid_thw))

    def to_dict(self) -> dict[str, Any]:
        """As JSON: each tensor's shape and little-endian bytes in base64."""
        out = {"pixel_values": _encode(self.pixel_values, "<f4")}
        if self.pixel_attention_mask is not None:
            out["pixel_attention_mask"] = _encode(self.pixel_attention_mask, "u1")
        if self.image_grid_thw is not None:
            out["image_grid_thw"] = _encode(self.image_grid_thw, "<i8")
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageInputs:
        """The images `to_dict` encoded; ValueError names a field that does not decode."""
        mask, grid = d.get("pixel_attention_mask"), d.get("image_grid_thw")
        return cls(pixel_values=_decode(d["pixel_values"], "<f4", torch.float32),
                   pixel_attention_mask=None if mask is None else _decode(mask, "u1", torch.bool),
                   image_grid_thw=None if grid is None else _decode(grid, "<i8", torch.int64))

    @staticmethod
    def cat(images: list[ImageInputs]) -> ImageInputs:
        """The items of `images` one after the other (a mask where any has one); ValueError
        for images of both layouts."""
        grids = [i.image_grid_thw for i in images]
        if any(g is None for g in grids) and any(g is not None for g in grids):
            raise ValueError("images of two layouts (tiles, and patches with image_grid_thw) "
                             "cannot be joined: they come from different processors")
        masks = None
        if any(i.pixel_attention_mask is not None for i in images):
            masks = torch.cat([i.pixel_attention_mask if i.pixel_attention_mask is not None
                               else torch.ones(i.n_items, *i.pixel_values.shape[2:],
                                               dtype=torch.bool) for i in images])
        return ImageInputs(pixel_values=torch.cat([i.pixel_values for i in images]),
                           pixel_attention_mask=masks,
                           image_grid_thw=None if grids[0] is None else torch.cat(grids))


def _encode(t: torch.Tensor, dtype: str) -> dict[str, Any]:
    data = t.detach().cpu().contiguous().numpy().astype(dtype).tobytes()
    return {"shape": list(t.shape), "data": base64.b64encode(data).decode("ascii")}


def _decode(d: Any, dtype: str, torch_dtype: torch.dtype) -> torch.Tensor:
    import numpy as np

    try:
        data = np.frombuffer(base64.b64decode(d["data"], validate=True), dtype=dtype)
        return torch.from_numpy(data.copy()).view(*d["shape"]).to(torch_dtype)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"an image tensor must be {{'shape': [...], 'data': base64 of {dtype} "
                         f"values}} whose size fits its shape: {e}") from None


@dataclass(kw_only=True)
class GenerationRequest:
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Requests with one affinity key go to one server while it lives (the turns of an agent
    # session share their prefix there); None: the rid is the key. Not sent to servers.
    affinity: str | None = None
    # The images the prompt's image tokens stand for (a vision-language model); None: text.
    images: ImageInputs | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"rid": self.rid, "input_ids": list(self.input_ids),
               "sampling": self.sampling.to_dict()}
        if self.images is not None:
            out["images"] = self.images.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerationRequest:
        images = d.get("images")
        return cls(input_ids=list(d["input_ids"]), sampling=SamplingParams(**d.get("sampling", {})),
                   rid=d.get("rid") or uuid.uuid4().hex,
                   images=None if images is None else ImageInputs.from_dict(images))


def _check_routes(routes: torch.Tensor | None, n_tokens: int, what: str) -> None:
    """ValueError unless `routes` is None or int16 [n_tokens, MoE layers, top_k]."""
    if routes is None:
        return
    if routes.dtype != torch.int16 or routes.dim() != 3 or routes.shape[0] != n_tokens:
        raise ValueError(f"{what}: routed_experts must be int16 [{n_tokens} tokens, MoE layers, "
                         f"top_k], got {routes.dtype} {list(routes.shape)}")


def encode_routes(routes: torch.Tensor) -> dict[str, Any]:
    """int16 routed experts as JSON: the shape and the little-endian bytes in base64."""
    data = routes.contiguous().numpy().astype("<i2").tobytes()
    return {"shape": list(routes.shape), "int16": base64.b64encode(data).decode("ascii")}


def decode_routes(d: dict[str, Any]) -> torch.Tensor:
    """The tensor `encode_routes` encoded."""
    import numpy as np

    data = np.frombuffer(base64.b64decode(d["int16"]), dtype="<i2").astype(np.int16)
    return torch.from_numpy(data.copy()).view(*d["shape"])


@dataclass(kw_only=True)
class GenerationResponse:
    """One finished completion: its tokens, their log-probs and weight versions.

    `routed_experts` (MoE models, where the server records them; else None): int16 [prompt
    + output tokens, MoE layers, top_k], row t the experts each MoE layer chose for token t
    when the server ran it through the model. The last token, sampled but never run, holds
    -1 (the trainer's own routing; no log-prob depends on it).
    """

    rid: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: StopReason
    latency_s: float = 0.0
    routed_experts: torch.Tensor | None = None
    # With sampling.top_logprobs = k: per output token, the k most likely tokens {id: logprob}.
    output_top_logprobs: list[dict[int, float]] | None = None

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        if len(self.output_logprobs) != n or len(self.output_versions) != n:
            raise ValueError(
                f"response {self.rid}: {n} output ids but {len(self.output_logprobs)} logprobs "
                f"and {len(self.output_versions)} versions"
            )
        if self.output_top_logprobs is not None and len(self.output_top_logprobs) != n:
            raise ValueError(f"response {self.rid}: {n} output ids but "
                             f"{len(self.output_top_logprobs)} top log-prob entries")
        _check_routes(self.routed_experts, len(self.input_ids) + n, f"response {self.rid}")
        self.stop_reason = StopReason(self.stop_reason)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "rid": self.rid,
            "input_ids": self.input_ids,
            "output_ids": self.output_ids,
            "output_logprobs": self.output_logprobs,
            "output_versions": self.output_versions,
            "stop_reason": self.stop_reason.value,
            "latency_s": self.latency_s,
        }
        if self.routed_experts is not None:
            out["routed_experts"] = encode_routes(self.routed_experts)
        if self.output_top_logprobs is not None:  # JSON keys are strings: [id, logprob] pairs
            out["output_top_logprobs"] = [list(map(list, top.items()))
                                          for top in self.output_top_logprobs]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerationResponse:
        routes = d.get("routed_experts")
        tops = d.get("output_top_logprobs")
        return cls(**{k: d[k] for k in (
            "rid", "input_ids", "output_ids", "output_logprobs", "output_versions", "stop_reason"
        )}, latency_s=d.get("latency_s", 0.0),
            routed_experts=decode_routes(routes) if routes is not None else None,
            output_top_logprobs=None if tops is None else [
                {int(t): float(lp) for t, lp in top} for top in tops])


@dataclass(kw_only=True)
class Trajectory:
    """One sampled answer (or one multi-turn episode), ready for training."""

    input_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    versions: list[int]
    reward: float
    group_id: str
    stop_reason: StopReason = StopReason.STOP
    meta: dict[str, Any] = field(default_factory=dict)
    # MoE: the experts the rollout chose per token (GenerationResponse.routed_experts'
    # layout, one row per token of input_ids, -1 where not recorded); None: not recorded.
    routed_experts: torch.Tensor | None = None
    # A vision-language prompt's images, as the engine took them (its prompt's image tokens
    # stand for their features); None: text only.
    images: ImageInputs | None = None

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        for name in ("loss_mask", "behavior_logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"trajectory {self.group_id}: {name} has {len(getattr(self, name))} entries, "
                    f"input_ids has {n}"
                )
        _check_routes(self.routed_experts, n, f"trajectory {self.group_id}")
        self.stop_reason = StopReason(self.stop_reason)

    @classmethod
    def from_response(cls, resp: GenerationResponse, *, reward: float, group_id: str,
                      meta: dict[str, Any] | None = None,
                      images: ImageInputs | None = None) -> Trajectory:
        """Prompt + completion of one single-turn generation (`images`: its request's)."""
        n_prompt = len(resp.input_ids)
        return cls(
            input_ids=resp.input_ids + resp.output_ids,
            loss_mask=[0] * n_prompt + [1] * len(resp.output_ids),
            behavior_logprobs=[0.0] * n_prompt + list(resp.output_logprobs),
            versions=[-1] * n_prompt + list(resp.output_versions),
            reward=reward,
            group_id=group_id,
            stop_reason=resp.stop_reason,
            meta=dict(meta or {}),
            routed_experts=resp.routed_experts,
            images=images,
        )

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def n_output_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def output_versions(self) -> list[int]:
        return [v for v, m in zip(self.versions, self.loss_mask) if m]

    @property
    def start_version(self) -> int:
        """The weight version current when the episode was submitted (set by the executor)."""
        return int(self.meta["start_version"])


def image_fields(images: list[ImageInputs | None]) -> dict[str, torch.Tensor]:
    """TensorBatch's image fields for rows with these images (None: a text-only row); an
    empty dict if no row has any."""
    rows = [(i, im) for i, im in enumerate(images) if im is not None]
    if not rows:
        return {}
    shapes = {tuple(im.pixel_values.shape[1:]) for _, im in rows}
    if len(shapes) > 1:
        raise ValueError(f"rows carry image tiles of different shapes {sorted(shapes)} "
                         "(channels, height, width): they come from different processors")
    cat = ImageInputs.cat([im for _, im in rows])
    out = {"pixel_values": cat.pixel_values,
           "image_rows": torch.cat([torch.full((im.n_items,), i, dtype=torch.long)
                                    for i, im in rows])}
    if cat.image_grid_thw is not None:
        out["image_grid_thw"] = cat.image_grid_thw
    else:
        out["pixel_attention_mask"] = cat.pixel_attention_mask if \
            cat.pixel_attention_mask is not None else torch.ones(
                cat.n_items, *cat.pixel_values.shape[2:], dtype=torch.bool)
    return out


_IMAGE_FIELDS = ("pixel_values", "pixel_attention_mask", "image_rows", "image_grid_thw")


@dataclass
class TensorBatch:
    """Right-padded tensors of a list of trajectories, all [B, T] unless noted."""

    input_ids: torch.Tensor  # long
    attention_mask: torch.Tensor  # bool, True on real tokens
    loss_mask: torch.Tensor  # float, 1 on tokens the policy produced
    behavior_logprobs: torch.Tensor  # float32
    versions: torch.Tensor  # long, -1 on prompt and padding
    rewards: torch.Tensor  # [B] float32
    advantages: torch.Tensor | None = None  # [B, T] float32, set by the algorithm
    prox_logprobs: torch.Tensor | None = None  # [B, T] float32, set by the trainer
    ref_logprobs: torch.Tensor | None = None  # [B, T] float32, the reference model's (KL)
    # The critic's V of the state before token t (aligned like the log-probs), and the
    # GAE returns it is trained towards: [B, T] float32, 0 off the loss tokens.
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None  # [B, T] float32, the distillation teacher's
    # [B] long: each row's group (rows of one group_id, numbered in order). Set by
    # `Batch.to_tensors`, so groups may differ in size (agent sessions); None: rows form
    # groups of the configured group_size.
    group_index: torch.Tensor | None = None
    # [B, T, MoE layers, top_k] int16: the experts the rollout chose per token, -1 where
    # not recorded (the trainer routes those itself); None: no row recorded any.
    routed_experts: torch.Tensor | None = None
    # The rows' images, row by row (`ImageInputs`' layouts): image_rows [items] long, the
    # row of each item (rows in increasing order); tiles: pixel_values [tiles, C, H, W]
    # float32 and pixel_attention_mask [tiles, H, W] bool; patches: pixel_values [patches,
    # D] float32 and image_grid_thw [images, 3] long. None: no row has images.
    pixel_values: torch.Tensor | None = None
    pixel_attention_mask: torch.Tensor | None = None
    image_rows: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    @property
    def images(self) -> ImageInputs | None:
        """All rows' images as one `ImageInputs` (their items in row order)."""
        if self.pixel_values is None:
            return None
        return ImageInputs(pixel_values=self.pixel_values,
                           pixel_attention_mask=self.pixel_attention_mask,
                           image_grid_thw=self.image_grid_thw)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.attention_mask.sum(-1)

    def select(self, idx: torch.Tensor | list[int]) -> TensorBatch:
        """Rows `idx`, trimmed to their longest sequence."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        width = int(self.attention_mask[idx].sum(-1).max()) if len(idx) else 0
        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return t[idx][:, :width] if t.dim() >= 2 else t[idx]
        out = TensorBatch(**{name: take(getattr(self, name)) for name in self.__dataclass_fields__
                             if name not in _IMAGE_FIELDS})
        if self.image_rows is not None:
            items = [(self.image_rows == int(r)).nonzero()[:, 0] for r in idx]
            order = torch.cat(items)
            if len(order):
                # the rows of pixel_values each kept item takes (a tile: one; an image: its
                # patches)
                sizes = torch.tensor(self.images.item_sizes())
                starts = sizes.cumsum(0) - sizes
                rows = torch.cat([torch.arange(int(starts[i]), int(starts[i] + sizes[i]))
                                  for i in order])
                out.pixel_values = self.pixel_values[rows]
                if self.pixel_attention_mask is not None:
                    out.pixel_attention_mask = self.pixel_attention_mask[rows]
                if self.image_grid_thw is not None:
                    out.image_grid_thw = self.image_grid_thw[order]
                out.image_rows = torch.cat([torch.full((len(t),), k, dtype=torch.long)
                                            for k, t in enumerate(items)])
        return out


@dataclass
class Batch:
    """The trajectories of one training step, in groups of `group_size`."""

    trajectories: list[Trajectory]

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self):
        return iter(self.trajectories)

    @property
    def rewards(self) -> torch.Tensor:
        return torch.tensor([t.reward for t in self.trajectories], dtype=torch.float32)

    @property
    def group_ids(self) -> list[str]:
        return [t.group_id for t in self.trajectories]

    def to_tensors(self, pad_token_id: int = 0) -> TensorBatch:
        """Collate to right-padded tensors (the trainer's input)."""
        if not self.trajectories:
            raise ValueError("cannot collate an empty batch")
        width = max(t.n_tokens for t in self.trajectories)
        n = len(self.trajectories)

        def pad(rows: list[list], value, dtype) -> torch.Tensor:
            out = torch.full((n, width), value, dtype=dtype)
            for i, row in enumerate(rows):
                out[i, : len(row)] = torch.tensor(row, dtype=dtype)
            return out

        trajs = self.trajectories
        input_ids = pad([t.input_ids for t in trajs], pad_token_id, torch.long)
        attention_mask = pad([[1] * t.n_tokens for t in trajs], 0, torch.bool)
        return TensorBatch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            loss_mask=pad([t.loss_mask for t in trajs], 0, torch.float32),
            behavior_logprobs=pad([t.behavior_logprobs for t in trajs], 0.0, torch.float32),
            versions=pad([t.versions for t in trajs], -1, torch.long),
            rewards=self.rewards,
            group_index=group_numbers(self.group_ids),
            routed_experts=self._routes(width),
            **self._images(),
        )

    def _images(self) -> dict[str, torch.Tensor]:
        """The rows' image tiles as TensorBatch's image fields (none if no row has images)."""
        return image_fields([t.images for t in self.trajectories])

    def _routes(self, width: int) -> torch.Tensor | None:
        """The rows' routed experts, right-padded with -1 (rows without any: all -1)."""
        recorded = [t.routed_experts for t in self.trajectories if t.routed_experts is not None]
        if not recorded:
            return None
        shape = recorded[0].shape[1:]
        if any(r.shape[1:] != shape for r in recorded):
            raise ValueError("trajectories carry routed experts of different shapes "
                             f"{sorted({tuple(r.shape[1:]) for r in recorded})} (MoE layers, "
                             "top_k): they come from different models")
        out = torch.full((len(self.trajectories), width, *shape), -1, dtype=torch.int16)
        for i, t in enumerate(self.trajectories):
            if t.routed_experts is not None:
                out[i, :t.n_tokens] = t.routed_experts
        return out


def group_numbers(group_ids: list[str]) -> torch.Tensor:
    """Row -> group number; a group is a run of equal ids (a batch holds each group once)."""
    numbers, previous, n = [], None, -1
    for gid in group_ids:
        if gid != previous:
            n, previous = n + 1, gid
        numbers.append(n)
    return torch.tensor(numbers, dtype=torch.long)
