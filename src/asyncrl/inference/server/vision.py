"""The vision side of a vision-language model served by our engine: HF's own vision encoder
and connector, run in torch; their output replaces the embeddings of the prompt's image
tokens before our decoder runs (the text part is a Llama-family decoder, model.py).

Supported `model_type`s: idefics3 and smolvlm (SmolVLM), whose checkpoints hold the text
decoder under `model.text_model.`, the vision encoder under `model.vision_model.` and the
connector (pixel shuffle, then a projection to the text width) under `model.connector.`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from asyncrl.api.types import ImageInputs

# model_type -> the transformers module of its vision encoder and connector classes
VISION_LANGUAGE_TYPES = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}
TEXT_PREFIX = "model.text_model."
VISION_PREFIXES = ("model.vision_model.", "model.connector.")


def is_vision_language(raw: dict[str, Any]) -> bool:
    """Whether an HF config.json dict is of a vision-language model we serve."""
    return raw.get("model_type") in VISION_LANGUAGE_TYPES


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's config.json dict of a vision-language config (Llama by default,
    as HF reads it); the output projection is tied as the outer config says."""
    text = dict(raw.get("text_config") or {})
    text.setdefault("model_type", "llama")
    text["tie_word_embeddings"] = raw.get("tie_word_embeddings", False)
    return text


def image_seq_len(raw: dict[str, Any]) -> int:
    """Image tokens per tile: the tile's patches, merged scale_factor x scale_factor."""
    vision = raw["vision_config"]
    side = vision["image_size"] // vision["patch_size"]
    return side * side // raw.get("scale_factor", 2) ** 2


class VisionEncoder:
    """HF's vision encoder and connector of a vision-language folder, for inference."""

    def __init__(self, raw: dict[str, Any], tensors: dict[str, torch.Tensor], *,
                 dtype: torch.dtype, device: torch.device):
        import importlib

        import transformers

        kind, name = raw["model_type"], VISION_LANGUAGE_TYPES[raw["model_type"]]
        config = transformers.AutoConfig.for_model(**raw)
        modeling = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
        self.vision = getattr(modeling, f"{name}VisionTransformer")(config.vision_config)
        self.connector = getattr(modeling, f"{name}Connector")(config)
        self.image_token_id: int = config.image_token_id
        self.patch_size: int = config.vision_config.patch_size
        self.tile_size: int = config.vision_config.image_size
        self.tokens_per_tile = image_seq_len(raw)
        self.dtype, self.device = dtype, device
        self.load(tensors.items())
        for module in (self.vision, self.connector):
            module.to(dtype=dtype, device=device).eval()

    @staticmethod
    def own(name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to the vision encoder or connector."""
        return name.startswith(VISION_PREFIXES)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint name of the vision encoder and connector, with its shape."""
        return {prefix + n: tuple(t.shape)
                for prefix, module in zip(VISION_PREFIXES, (self.vision, self.connector))
                for n, t in module.state_dict().items()}

    @torch.inference_mode()
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the vision tensors of (HF name, tensor) pairs into place; every one of
        them must come (ValueError naming those missing or unexpected)."""
        parts = {prefix: {} for prefix in VISION_PREFIXES}
        for name, tensor in named_tensors:
            for prefix in VISION_PREFIXES:
                if name.startswith(prefix):
                    parts[prefix][name[len(prefix):]] = tensor
        for (prefix, tensors), module in zip(parts.items(), (self.vision, self.connector)):
            missing, unexpected = module.load_state_dict(tensors, strict=False)
            if missing or unexpected:
                raise ValueError(f"the vision tensors under {prefix!r} do not fit the model: "
                                 f"missing {sorted(missing)[:5]}, unexpected "
                                 f"{sorted(unexpected)[:5]}")

    def check(self, images: ImageInputs, n_image_tokens: int) -> None:
        """ValueError unless `images` are tiles this encoder takes and the prompt has one
        image token per feature they give."""
        _, channels, h, w = images.pixel_values.shape
        if (h, w) != (self.tile_size, self.tile_size) or channels != 3:
            raise ValueError(f"images: tiles of {channels} x {h} x {w} pixels, but the model "
                             f"takes 3 x {self.tile_size} x {self.tile_size}; make them with "
                             "the model's image processor")
        expected = images.n_items * self.tokens_per_tile
        if n_image_tokens != expected:
            raise ValueError(f"input_ids holds {n_image_tokens} image tokens (id "
                             f"{self.image_token_id}) but {images.n_items} image tiles give "
                             f"{expected} features ({self.tokens_per_tile} a tile); the "
                             "prompt and the images must come from one processor call")

    @torch.inference_mode()
    def embed(self, images: ImageInputs) -> torch.Tensor:
        """The embeddings [tiles * tokens per tile, text hidden] of the images' tokens."""
        pixels = images.pixel_values.to(self.device, self.dtype)
        mask = images.pixel_attention_mask
        p = self.patch_size
        if mask is None:
            patches = torch.ones(pixels.shape[0], self.tile_size // p, self.tile_size // p,
                                 dtype=torch.bool, device=self.device)
        else:  # a patch takes part if any of its pixels is real
            n, h, w = mask.shape
            patches = mask.to(self.device).view(n, h // p, p, w // p, p).any(4).any(2)
        hidden = self.vision(pixel_values=pixels, patch_attention_mask=patches).last_hidden_state
        return self.connector(hidden).flatten(0, 1)
