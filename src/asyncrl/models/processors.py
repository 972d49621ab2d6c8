"""The processors of vision-language model families, as rollout, the chat layer and SFT use
them: what a chat turn holds where an image goes, and for Qwen2-VL's family a processor of
text and images that needs no torchvision (HF's loads a video processor, which does).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# Qwen2-VL's family: an image is written as its image token between these two, and the
# processor repeats the image token once per merged patch of the image.
QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


def load_processor(path: str) -> Any:
    """The HF processor of the vision-language model folder `path` (`GridImageProcessor`
    for Qwen2-VL's family where HF's does not load)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - the fallback below, or this error again
        if _model_type(path) not in QWEN_VL_TYPES:
            raise
        # HF's Qwen2-VL processors load a video processor, which needs torchvision; images
        # alone need only the image processor and the tokenizer.
        logger.info("%s: %s's processor did not load (%s: %s); images are processed by its "
                    "image processor and tokenizer", path, _model_type(path),
                    type(e).__name__, e)
        return GridImageProcessor.from_pretrained(path)


def _model_type(path: str) -> str | None:
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        return json.load(f).get("model_type")


class GridImageProcessor:
    """A Qwen2-VL processor for text and images (no video): the model's image processor
    makes each image's patches and its (t, h, w) grid, and each image token of the text
    becomes t * h * w / merge_size^2 image tokens, as HF's Qwen2-VL processors write them."""

    image_token = "<|image_pad|>"

    def __init__(self, image_processor: Any, tokenizer: Any) -> None:
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.merge = int(image_processor.merge_size)

    @classmethod
    def from_pretrained(cls, path: str) -> GridImageProcessor:
        from transformers import AutoTokenizer

        try:  # transformers 5: the PIL implementation, without torchvision
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
                Qwen2VLImageProcessorPil as ImageProcessor,
            )
        except ImportError:
            from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
                Qwen2VLImageProcessor as ImageProcessor,
            )
        return cls(ImageProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path))

    def save_pretrained(self, path: str) -> list[str]:
        """The image processor's and the tokenizer's files in `path`; the files written."""
        written = list(self.image_processor.save_pretrained(path) or [])
        return written + list(self.tokenizer.save_pretrained(path))

    def __call__(self, *, text: str, images: list[Any], add_special_tokens: bool = False,
                 return_tensors: str = "pt") -> dict[str, Any]:
        features = self.image_processor(images=images, return_tensors=return_tensors)
        grid = features["image_grid_thw"]
        parts = text.split(self.image_token)
        if len(parts) != len(images) + 1:
            raise ValueError(f"the text holds {len(parts) - 1} image tokens "
                             f"{self.image_token!r} for {len(images)} images")
        counts = (grid.prod(-1) // self.merge ** 2).tolist()
        expanded = parts[0] + "".join(self.image_token * n + part
                                      for n, part in zip(counts, parts[1:]))
        ids = self.tokenizer(expanded, add_special_tokens=add_special_tokens,
                             return_tensors=return_tensors)["input_ids"]
        return {"input_ids": ids, "pixel_values": features["pixel_values"],
                "image_grid_thw": grid}


def image_text(processor: Any) -> str:
    """What a chat turn holds where an image goes, for `processor`'s model: its image token,
    between the vision markers for Qwen2-VL's family (as its chat template writes an image
    part)."""
    token = processor.image_token
    tokenizer = getattr(processor, "tokenizer", None)
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    if token == GridImageProcessor.image_token and VISION_START in vocab and VISION_END in vocab:
        return f"{VISION_START}{token}{VISION_END}"
    return token
