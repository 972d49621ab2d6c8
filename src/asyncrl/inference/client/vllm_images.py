"""A request's images as vLLM's /inference/v1/generate takes them: already processed.

The route (vLLM >= 0.32, served with --enable-scale-out) takes the prompt's token ids as
they are and, in `features`, each image item's processor output, so vLLM's own processor
neither sees the image nor expands its tokens: the image tokens stay where our processor
put them, and the pixels the server encodes are the ones the trainer gets.

`features` holds, per item, a placeholder range (offset, length) of the prompt, a hash
that names the item in vLLM's caches, and the item's tensors as vLLM's msgpack encoding
of a MultiModalKwargsItem, in base64 (vllm/v1/serial_utils.py `MsgpackEncoder`; decoded
by `decode_mm_kwargs_item` in the route's mm_serde.py). A placeholder range carries no
mask of which of its tokens take features, so every token of a range must be an image
token; Idefics3 writes tile markers between the tiles of an image, so each run of image
tokens (one tile, or several adjacent tiles) is its own item. The vision encoder and
connector see each tile alone, so items cut at tile bounds give the same features.

The tensors are those of the served model's vLLM implementation:
- Idefics3 / SmolVLM (vllm/model_executor/models/idefics3.py): `pixel_values` and
  `pixel_attention_mask` flat over the item's tiles, and `num_patches`, its tile count.
- Qwen2-VL / Qwen2.5-VL (qwen2_vl.py `_create_qwen2vl_field_factory`): an item is an image,
  its `pixel_values` its patches (flat) and `image_grid_thw` its grid (batched); its
  placeholder is its t * h * w / merge_size^2 image tokens. vLLM derives the decoder's
  three-dimensional positions from the placeholders' offsets and the grids, as the trainer
  does (`trainer/vision.py`).
A model whose vLLM implementation takes other tensors is refused by `image_layout` (the
worker extension reports the served model's type).
"""

from __future__ import annotations

import base64
import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.api.types import ImageInputs
from asyncrl.models.processors import QWEN_VL_TYPES

# The model types whose vLLM implementation takes the tensors above.
IDEFICS3_TYPES = ("idefics3", "smolvlm")
_RAW_VIEW = 3  # vLLM's msgpack extension type of a tensor's raw bytes (CUSTOM_TYPE_RAW_VIEW)


@dataclass(frozen=True)
class ImageLayout:
    """How a served model's prompt stands for its images: `tokens_per_tile` image tokens
    per tile (Idefics3), or per image its grid's patches over `merge_size`^2 (Qwen2-VL)."""

    image_token_id: int
    tokens_per_tile: int = 0
    merge_size: int = 0


def image_layout(config: dict[str, Any], address: str) -> ImageLayout:
    """The image layout of the model a vLLM server serves, from its worker's report
    (`WeightSyncExtension.asyncrl_image_layout`); ValueError for a model whose vLLM
    implementation takes other image tensors."""
    kind = config.get("model_type")
    if kind in IDEFICS3_TYPES:
        return ImageLayout(int(config["image_token_id"]),
                           tokens_per_tile=int(config["tokens_per_tile"]))
    if kind in QWEN_VL_TYPES:
        return ImageLayout(int(config["image_token_id"]), merge_size=int(config["merge_size"]))
    raise ValueError(f"{address} serves a {kind!r} model; the vLLM client sends processed "
                     f"images to {', '.join(IDEFICS3_TYPES + QWEN_VL_TYPES)} models only: "
                     "serve one of those, or this model with our engine (allocation_mode "
                     "local:...)")


def image_features(input_ids: list[int], images: ImageInputs, layout: ImageLayout,
                   rid: str = "") -> dict[str, Any]:
    """The generate route's `features` for a prompt's `images`; ValueError if the prompt's
    image tokens do not stand for exactly the images' items."""
    runs = image_token_runs(input_ids, layout.image_token_id)
    if layout.merge_size:
        return _grid_features(runs, images, layout, rid)
    tokens_per_tile = layout.tokens_per_tile
    n_tokens = sum(length for _, length in runs)
    if images.image_grid_thw is not None or n_tokens != images.n_items * tokens_per_tile or any(
            length % tokens_per_tile for _, length in runs):
        raise ValueError(
            f"request {rid}: its prompt has {n_tokens} image tokens (id "
            f"{layout.image_token_id}) in runs of {[length for _, length in runs]}, but its "
            f"{images.n_items} image tiles take {tokens_per_tile} tokens each; build the "
            "prompt and the images with the served model's processor, one call for both")
    mask = images.pixel_attention_mask
    if mask is None:
        mask = torch.ones(images.n_items, *images.pixel_values.shape[2:], dtype=torch.bool)
    hashes, placeholders, items = [], [], []
    tile = 0
    for offset, length in runs:
        n = length // tokens_per_tile
        pixels, pixel_mask = images.pixel_values[tile:tile + n], mask[tile:tile + n]
        tile += n
        hashes.append(_item_hash(pixels, pixel_mask))
        placeholders.append({"offset": offset, "length": length})
        items.append(base64.b64encode(_pack(_kwargs_item(pixels, pixel_mask))).decode())
    return {"mm_hashes": {"image": hashes}, "mm_placeholders": {"image": placeholders},
            "kwargs_data": {"image": items}}


def _grid_features(runs: list[tuple[int, int]], images: ImageInputs, layout: ImageLayout,
                   rid: str) -> dict[str, Any]:
    """`image_features` for Qwen2-VL's family: one item per image, whose tokens are one run
    (its own, or the start of a run that the next image's tokens continue)."""
    grid = images.image_grid_thw
    counts = [] if grid is None else (grid.prod(-1) // layout.merge_size ** 2).tolist()
    starts: list[int] = []
    for offset, length in runs:
        while length > 0 and len(starts) < len(counts):
            n = counts[len(starts)]
            if n > length:
                break
            starts.append(offset)
            offset, length = offset + n, length - n
        if length:
            starts = []
            break
    if grid is None or len(starts) != len(counts):
        raise ValueError(
            f"request {rid}: its prompt has image tokens (id {layout.image_token_id}) in runs "
            f"of {[length for _, length in runs]}, but its images "
            f"{'have no image_grid_thw' if grid is None else grid.tolist()} take "
            f"{counts} tokens each (t * h * w / {layout.merge_size}^2); build the prompt and "
            "the images with the served model's processor, one call for both")
    hashes, placeholders, items = [], [], []
    for k, (offset, n) in enumerate(zip(starts, counts)):
        image = images.items(k, k + 1)
        hashes.append(_item_hash(image.pixel_values, image.image_grid_thw))
        placeholders.append({"offset": offset, "length": n})
        items.append(base64.b64encode(_pack(_grid_item(image))).decode())
    return {"mm_hashes": {"image": hashes}, "mm_placeholders": {"image": placeholders},
            "kwargs_data": {"image": items}}


def image_token_runs(input_ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of `image_token_id` in `input_ids`."""
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(input_ids):
        if token != image_token_id:
            continue
        if runs and sum(runs[-1]) == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _item_hash(*tensors: torch.Tensor) -> str:
    """Names an item by its content: equal tiles share vLLM's cached encoder outputs (a
    weight update clears that cache)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(list(t.shape)).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def _grid_item(image: ImageInputs) -> dict[str, Any]:
    """One image of Qwen2-VL's family as a MultiModalKwargsItem (see `_kwargs_item`)."""
    n = image.pixel_values.shape[0]
    flat = ("flat", {"keep_on_cpu": False, "slices": [[[0, n, None]]], "dim": 0})
    return {
        "pixel_values": {"data": _tensor(image.pixel_values.float()), "field": flat},
        "image_grid_thw": {"data": _tensor(image.image_grid_thw[0].long()),
                           "field": ("batched", {"keep_on_cpu": True})},
    }


def _kwargs_item(pixels: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """One MultiModalKwargsItem as vLLM's encoder writes it: per key, the tensor as
    (dtype, shape, raw bytes) and its field as (factory name, factory arguments)."""
    n = pixels.shape[0]
    flat = ("flat", {"keep_on_cpu": False, "slices": [[[0, n, None]]], "dim": 0})
    return {
        "pixel_values": {"data": _tensor(pixels.float()), "field": flat},
        "pixel_attention_mask": {"data": _tensor(mask.bool()), "field": flat},
        "num_patches": {"data": _tensor(torch.tensor(n, dtype=torch.int64)),
                        "field": ("batched", {"keep_on_cpu": True})},
    }


def _tensor(t: torch.Tensor) -> tuple[str, list[int], _Ext]:
    dtype = str(t.dtype).removeprefix("torch.")
    return dtype, list(t.shape), _Ext(_RAW_VIEW, t.contiguous().numpy().tobytes())


class _Ext:
    """A msgpack extension value: a type code and bytes."""

    def __init__(self, code: int, data: bytes) -> None:
        self.code, self.data = code, data


def _pack(obj: Any) -> bytes:
    """`obj` (None, bool, int, str, list / tuple, dict, _Ext) in msgpack."""
    out = bytearray()
    _pack_into(obj, out)
    return bytes(out)


def _pack_into(obj: Any, out: bytearray) -> None:
    if obj is None:
        out.append(0xC0)
    elif isinstance(obj, bool):
        out.append(0xC3 if obj else 0xC2)
    elif isinstance(obj, int):
        if 0 <= obj < 0x80:
            out.append(obj)
        elif -32 <= obj < 0:
            out += struct.pack(">b", obj)
        else:
            out += struct.pack(">Bq", 0xD3, obj)  # int 64
    elif isinstance(obj, str):
        data = obj.encode()
        _header(out, len(data), fix=(0xA0, 32), sized=(0xD9, 0xDA, 0xDB))
        out += data
    elif isinstance(obj, (list, tuple)):
        _header(out, len(obj), fix=(0x90, 16), sized=(None, 0xDC, 0xDD))
        for x in obj:
            _pack_into(x, out)
    elif isinstance(obj, dict):
        _header(out, len(obj), fix=(0x80, 16), sized=(None, 0xDE, 0xDF))
        for k, v in obj.items():
            _pack_into(k, out)
            _pack_into(v, out)
    elif isinstance(obj, _Ext):
        _header(out, len(obj.data), fix=None, sized=(0xC7, 0xC8, 0xC9))
        out += struct.pack(">b", obj.code)
        out += obj.data
    else:
        raise TypeError(f"cannot pack a {type(obj).__name__} into msgpack")


def _header(out: bytearray, n: int, fix: tuple[int, int] | None,
            sized: tuple[int | None, int, int]) -> None:
    """A length header: the fix form below its limit, else 8-, 16- or 32-bit lengths."""
    if fix is not None and n < fix[1]:
        out.append(fix[0] | n)
    elif sized[0] is not None and n < 1 << 8:
        out += struct.pack(">BB", sized[0], n)
    elif n < 1 << 16:
        out += struct.pack(">BH", sized[1], n)
    else:
        out += struct.pack(">BI", sized[2], n)
