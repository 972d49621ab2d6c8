"""Images in chat requests, for a vision-language model: each image arrives inline (an
OpenAI `image_url` part with a data URL, an Anthropic `image` block with a base64 source),
and the model's own processor turns the rendered prompt and the images into the prompt's
token ids (an image's tokens where the chat template put its placeholder) and the pixel
tensors the engine and the trainer take.

Servers fetch nothing: an http(s) image URL is refused with a 400 that says to inline it.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import re
from typing import Any

from asyncrl.api.types import ImageInputs
from asyncrl.models.processors import image_text, load_processor
from asyncrl.openai.errors import OpenAIError

_DATA_URL = re.compile(r"data:(image/[A-Za-z0-9.+-]+);base64,(.*)", re.DOTALL)
INLINE_HINT = "inline the image as a data URL: data:image/png;base64,<the file's bytes in base64>"


def has_image_processor(path: str) -> bool:
    """Whether the model folder `path` holds an image processor's config."""
    if os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        return True
    processor = os.path.join(path, "processor_config.json")
    if not os.path.isfile(processor):
        return False
    with open(processor) as f:
        return "image_processor" in json.load(f)


def load_image_prompts(path: str) -> ImagePrompts | None:
    """The image side of chat prompts for the model folder `path`; None without an image
    processor (the model reads text only)."""
    if not has_image_processor(path):
        return None
    return ImagePrompts(load_processor(path))


class ImagePrompts:
    """A vision-language model's processor, as the chat layer uses it."""

    def __init__(self, processor: Any) -> None:
        token = getattr(processor, "image_token", None)
        if not isinstance(token, str):
            raise ValueError(f"{type(processor).__name__} names no image_token; the chat layer "
                             "needs the placeholder its template writes for an image")
        self.processor = processor
        self.placeholder = token  # the token the processor expands into an image's tokens
        self.image_text = image_text(processor)  # what a chat turn holds for an image

    def decode_url(self, url: Any, param: str) -> Any:
        """The PIL image of a data URL; a 400 naming `param` for anything else."""
        if not isinstance(url, str):
            raise OpenAIError(f"{param} must be a string: a data URL", param=param)
        if url.startswith(("http://", "https://")):
            raise OpenAIError(f"{param}: this server fetches no URLs; {INLINE_HINT}", param=param)
        match = _DATA_URL.fullmatch(url)
        if match is None:
            raise OpenAIError(f"{param} must be a data URL of an image; {INLINE_HINT}",
                              param=param)
        return self.decode_bytes(match.group(2), param)

    def decode_bytes(self, data: Any, param: str) -> Any:
        """The PIL image of base64 `data`; a 400 naming `param` if it is not one."""
        from PIL import Image, UnidentifiedImageError

        try:
            raw = base64.b64decode(data, validate=True)
            image = Image.open(io.BytesIO(raw))
            image.load()
        except (TypeError, binascii.Error, ValueError) as e:
            raise OpenAIError(f"{param} is not valid base64: {e}", param=param) from None
        except (UnidentifiedImageError, OSError) as e:
            raise OpenAIError(f"{param} holds no image this server can read (PNG, JPEG, GIF, "
                              f"WebP): {e}", param=param) from None
        return image.convert("RGB")

    def encode(self, text: str, images: list[Any]) -> tuple[list[int], ImageInputs]:
        """The token ids of the rendered prompt `text` with each placeholder expanded into
        its image's tokens, and the images' pixel tensors."""
        found = text.count(self.placeholder)
        if found != len(images):
            raise OpenAIError(f"the rendered prompt holds {found} image placeholders "
                              f"{self.placeholder!r} for {len(images)} images: remove the "
                              "placeholder from the messages' text", param="messages")
        out = self.processor(text=text, images=images, add_special_tokens=False,
                             return_tensors="pt")
        return out["input_ids"][0].tolist(), ImageInputs.from_processor(out)
