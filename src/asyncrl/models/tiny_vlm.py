"""A tiny random Idefics3 (SmolVLM) model and its processor, built at test time (no downloads).

The text part is a Llama decoder over the byte-level tokenizer of `tiny.py`, with the tokens
Idefics3's processor writes around an image. The image processor tiles an image into
squares of `tile` pixels (a grid of them, plus the whole image shrunk to one tile), the
vision encoder cuts a tile into patches of `patch` pixels, and the connector merges
`scale_factor` x `scale_factor` patches into one image token: (tile / patch / scale_factor)^2
tokens per tile.
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.models.tiny import SPECIAL_TOKENS, make_tiny_tokenizer

# ChatML, where a message's content may be a list of parts: {"type": "text", "text": ...}
# or {"type": "image"}, which the processor expands into the image's tokens.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
IMAGE_TOKEN, FAKE_IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN = "<image>", "<fake_token_around_image>", "<global-img>"
# The processor names each tile of an image split into at most 6 x 6 tiles.
TILE_TOKENS = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
VLM_TOKENS = [FAKE_IMAGE_TOKEN, IMAGE_TOKEN, "<end_of_utterance>", GLOBAL_IMAGE_TOKEN, *TILE_TOKENS]


def make_tiny_vlm_tokenizer():
    """`make_tiny_tokenizer` with the image tokens Idefics3's processor needs."""
    tok = make_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS + VLM_TOKENS})
    tok.chat_template = VLM_CHAT_TEMPLATE
    return tok


def make_tiny_vlm(path: str | Path, *, seed: int = 0, tile: int = 32, patch: int = 8,
                  scale_factor: int = 2, max_tiles_per_side: int = 2, hidden_size: int = 64,
                  num_layers: int = 2, vision_hidden_size: int = 32, vision_layers: int = 1,
                  tie_word_embeddings: bool = False) -> str:
    """Save a randomly initialised Idefics3ForConditionalGeneration, its tokenizer and
    processor to `path`. Images are resized to at most `max_tiles_per_side` * `tile` pixels
    on their longest side, then tiled as the module doc says."""
    import torch
    import transformers
    from transformers.models.idefics3 import Idefics3ImageProcessorPil, Idefics3Processor

    if tile % (patch * scale_factor):
        raise ValueError(f"tile={tile} must be a multiple of patch * scale_factor = "
                         f"{patch * scale_factor}")
    tokenizer = make_tiny_vlm_tokenizer()
    vocab_size = (len(tokenizer) + 63) // 64 * 64
    text = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=hidden_size // 2, max_position_embeddings=2048, rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = transformers.Idefics3VisionConfig(
        hidden_size=vision_hidden_size, intermediate_size=2 * vision_hidden_size,
        num_hidden_layers=vision_layers, num_attention_heads=2, image_size=tile,
        patch_size=patch)
    config = transformers.Idefics3Config(
        text_config=text, vision_config=vision, scale_factor=scale_factor,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        tie_word_embeddings=tie_word_embeddings, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(config)
    # Larger than HF's init (std 0.02), so that outputs depend visibly on the input (as in
    # tiny.py); the vision side too, so that the image changes the text's log-probs.
    widen_init(model)
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": max_tiles_per_side * tile}, max_image_size={"longest_edge": tile})
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer,
        image_seq_len=(tile // patch // scale_factor) ** 2, chat_template=VLM_CHAT_TEMPLATE)
    path = Path(path)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def widen_init(model) -> None:
    """Every matrix of `model` drawn wider than HF's init: N(0, 0.2) for token embeddings,
    N(0, 1 / fan-in) for the rest (both sides of a vision-language model)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2 if "embed_tokens" in name else 1.0 / p[0].numel() ** 0.5)
