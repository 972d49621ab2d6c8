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

The tensors are Idefics3 / SmolVLM's (vllm/model_executor/models/idefics3.py):
`pixel_values` and `pixel_attention_mask` flat over the item's tiles, and `num_patches`,
its tile count. A model whose vLLM implementation takes other tensors is refused by
`image_layout` (the worker extension reports the served model's type).
"""

from __future__ import annotations

import base64
import hashlib
import struct
from typing import Any

import torch

from asyncrl.api.types import ImageInputs

# The model types whose vLLM implementation takes the tensors above.
IDEFICS3_TYPES = ("idefics3", "smolvlm")
_RAW_VIEW = 3  # vLLM's msgpack extension type of a tensor's raw bytes (CUSTOM_TYPE_RAW_VIEW)


def image_layout(config: dict[str, Any], address: str) -> tuple[int, int]:
    """(image token id, image tokens per tile) of the model a vLLM server serves, from its
    worker's report (`WeightSyncExtension.asyncrl_image_layout`); ValueError for a model
    whose vLLM implementation takes other image tensors."""
    if config.get("model_type") not in IDEFICS3_TYPES:
        raise ValueError(f"{address} serves a {config.get('model_type')!r} model; the vLLM "
                         f"client sends processed images to {' or '.join(IDEFICS3_TYPES)} "
                         "models only: serve one of those, or this model with our engine "
                         "(rollout.backend local)")
    return int(config["image_token_id"]), int(config["tokens_per_tile"])


def image_features(input_ids: list[int], images: ImageInputs, image_token_id: int,
                   tokens_per_tile: int, rid: str = "") -> dict[str, Any]:
    """The generate route's `features` for a prompt's `images`; ValueError if the prompt's
    image tokens do not stand for exactly the images' tiles."""
    runs = image_token_runs(input_ids, image_token_id)
    n_tokens = sum(length for _, length in runs)
    if n_tokens != images.n_tiles * tokens_per_tile or any(
            length % tokens_per_tile for _, length in runs):
        raise ValueError(
            f"request {rid}: its prompt has {n_tokens} image tokens (id {image_token_id}) in "
            f"runs of {[length for _, length in runs]}, but its {images.n_tiles} image tiles "
            f"take {tokens_per_tile} tokens each; build the prompt and the images with the "
            "served model's processor, one call for both")
    mask = images.pixel_attention_mask
    if mask is None:
        mask = torch.ones(images.n_tiles, *images.pixel_values.shape[2:], dtype=torch.bool)
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


def _item_hash(pixels: torch.Tensor, mask: torch.Tensor) -> str:
    """Names an item by its content: equal tiles share vLLM's cached encoder outputs (a
    weight update clears that cache)."""
    h = hashlib.sha256()
    for t in (pixels, mask):
        h.update(str(list(t.shape)).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


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
