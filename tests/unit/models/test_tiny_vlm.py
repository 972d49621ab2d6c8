"""models/tiny_vlm.py: the tiny Idefics3 model's processor places image tokens as the
tiling rule says."""

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from asyncrl.models.tiny_vlm import make_tiny_vlm

# make_tiny_vlm's defaults: 32-pixel tiles, 8-pixel patches, 2 x 2 patches per token, images
# resized to 64 pixels on their longest side.
TILE, PATCH, SCALE, LONGEST = 32, 8, 2, 64
TOKENS_PER_TILE = (TILE // PATCH // SCALE) ** 2  # 4 x 4 patches -> 2 x 2 tokens = 4


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return AutoProcessor.from_pretrained(make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "m"))


def expected_image_tokens(rows: int, cols: int) -> list[str]:
    """Idefics3's layout: each tile as <fake><row_r_col_c> + its tokens, a newline after
    each row of tiles, a blank line, then the global image between two <fake> tokens."""
    image = ["<image>"] * TOKENS_PER_TILE
    out = []
    for r in range(1, rows + 1):
        for c in range(1, cols + 1):
            out += ["<fake_token_around_image>", f"<row_{r}_col_{c}>", *image]
        out.append("Ċ")  # "\n" as its byte token
    return out + ["Ċ", "<fake_token_around_image>", "<global-img>", *image,
                  "<fake_token_around_image>"]


# (width, height) -> tiles (rows, cols): the longest side becomes 64 = 2 tiles; the other
# keeps the aspect ratio and is rounded up to whole tiles (64 x 16 -> 64 x 16 -> 2 x 1 tiles
# wide, 1 high).
@pytest.mark.parametrize("size,tiles", [((40, 40), (2, 2)), ((64, 16), (1, 2)),
                                        ((10, 40), (2, 1))])
def test_processor_places_one_block_of_image_tokens_per_tile_and_one_for_the_whole(
        processor, size, tiles):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    out = processor(text=text, images=[Image.new("RGB", size, (200, 10, 30))],
                    return_tensors="pt")
    tokens = processor.tokenizer.convert_ids_to_tokens(out["input_ids"][0])
    rows, cols = tiles
    expected = (["<|im_start|>", *"user", "Ċ"] + expected_image_tokens(rows, cols)
                + [*"hi", "<|im_end|>", "Ċ", "<|im_start|>", *"assistant", "Ċ"])
    assert tokens == expected
    assert tokens.count("<image>") == (rows * cols + 1) * TOKENS_PER_TILE
    # one tile per block of image tokens, each TILE x TILE, all of it real pixels
    assert out["pixel_values"].shape == (1, rows * cols + 1, 3, TILE, TILE)
    assert out["pixel_attention_mask"].shape == (1, rows * cols + 1, TILE, TILE)
    assert bool(out["pixel_attention_mask"].all())


def test_image_tokens_of_the_tokenizer_are_single_tokens(processor):
    tok = processor.tokenizer
    for token in ["<image>", "<fake_token_around_image>", "<global-img>", "<row_6_col_6>"]:
        assert len(tok(token, add_special_tokens=False)["input_ids"]) == 1
    assert processor.image_seq_len == TOKENS_PER_TILE
    assert torch.tensor(tok("<image>", add_special_tokens=False)["input_ids"]).item() == \
        tok.convert_tokens_to_ids("<image>")
