"""A tiny random Qwen2.5-VL model and its processor, built at test time (no downloads).

The text part is a Qwen2 decoder with multimodal rotary positions (M-RoPE) over the
byte-level tokenizer of `tiny.py`, with Qwen's vision tokens. The image processor resizes
an image to multiples of `patch * merge` pixels (within `min_pixels`..`max_pixels`) and
cuts it into `patch` x `patch` patches, two frames deep (a still image is repeated); the
vision encoder's merger joins `merge` x `merge` patches into one image token, so an image
of h x w patches stands as h * w / merge^2 `<|image_pad|>` tokens between
`<|vision_start|>` and `<|vision_end|>`.
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.models.tiny import SPECIAL_TOKENS, make_tiny_tokenizer
from asyncrl.models.tiny_vlm import widen_init

# ChatML with Qwen2-VL's image parts: {"type": "image"} is written as the vision tokens,
# which the processor expands into the image's tokens.
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN_VL_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]


def make_tiny_qwen_vl(path: str | Path, *, seed: int = 0, patch: int = 4, merge: int = 2,
                      min_pixels: int = 16 * 16, max_pixels: int = 48 * 48,
                      hidden_size: int = 64, num_layers: int = 2, vision_hidden_size: int = 32,
                      vision_layers: int = 2) -> str:
    """Save a randomly initialised Qwen2_5_VLForConditionalGeneration, its tokenizer and
    processor to `path` (images as the module doc says)."""
    import torch
    import transformers
    try:  # transformers 5: the PIL implementation, without torchvision
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as ImageProcessor,
        )
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
            Qwen2VLImageProcessor as ImageProcessor,
        )

    tokenizer = make_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS + QWEN_VL_TOKENS})
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VL_TOKENS}
    head_dim = hidden_size // 2
    text = {
        "vocab_size": (len(tokenizer) + 63) // 64 * 64, "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size, "num_hidden_layers": num_layers,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        # the rotary halves split among (temporal, height, width) positions
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8]},
        "rope_scaling": {"type": "default", "rope_type": "default",
                         "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8]},
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision = {
        "depth": vision_layers, "hidden_size": vision_hidden_size,
        "intermediate_size": 2 * vision_hidden_size, "num_heads": 2, "patch_size": patch,
        "spatial_merge_size": merge, "temporal_patch_size": 2, "out_hidden_size": hidden_size,
        # windowed attention over windows of `window_size` pixels; the last layer sees all
        "window_size": 2 * patch * merge, "fullatt_block_indexes": [vision_layers - 1],
    }
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    # Larger than HF's init (std 0.02), so that outputs depend visibly on the input (as in
    # tiny.py); the vision side too, so that the image changes the text's log-probs.
    widen_init(model)
    image_processor = ImageProcessor(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, patch_size=patch,
        merge_size=merge, temporal_patch_size=2)
    path = Path(path)
    model.save_pretrained(path)
    # The processor's parts one by one: Qwen2_5_VLProcessor itself needs torchvision (for
    # its video processor), which the CPU build goes without (`openai/images.py`).
    image_processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
