"""examples/vlm/build_model.py: the VLM's text model is the source LM tensor for tensor
(same logits on text), the processor shows an image as one tile of image tokens."""

import pytest
import torch
from example_scripts import load_example
from PIL import Image
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

from asyncrl.models.tiny import make_tiny_model, make_tiny_tokenizer

build_model = load_example("vlm/build_model.py")
SMALL = dict(image_size=32, patch=8, scale_factor=2, vision_hidden=32, vision_layers=1,
             vision_heads=2)


@pytest.mark.parametrize("tied", [True, False])
def test_text_logits_equal_the_source_lms_and_new_rows_are_the_mean(tmp_path, tied):
    # the tokenizer's own rows only, so the image tokens must grow the embedding
    vocab = len(make_tiny_tokenizer())
    src = make_tiny_model(tmp_path / "src", vocab_size=vocab, tie_word_embeddings=tied)
    out = build_model.build(src, tmp_path / "vlm", **SMALL)
    lm = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    vlm = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    new_vocab = vlm.get_input_embeddings().weight.shape[0]
    assert new_vocab == (vocab + len(build_model.VLM_TOKENS) + 63) // 64 * 64 > vocab
    ids = torch.tensor([[1, 70, 85, 99, 120, 7, 200]])
    with torch.no_grad():
        want, got = lm(input_ids=ids).logits, vlm(input_ids=ids).logits
        hidden = lm.model(input_ids=ids).last_hidden_state
        vlm_hidden = vlm.model.text_model(input_ids=ids).last_hidden_state
    # The text model is the source's bit for bit; the head's product over the padded vocab
    # may round differently from the source's (another matrix shape), within fp32 rounding.
    assert torch.equal(vlm_hidden, hidden)
    torch.testing.assert_close(got[..., :vocab], want, atol=1e-6, rtol=0)
    emb = vlm.get_input_embeddings().weight
    src_emb = lm.get_input_embeddings().weight
    assert torch.equal(emb[:vocab], src_emb)
    assert torch.allclose(emb[vocab:], src_emb.mean(0).expand(new_vocab - vocab, -1))
    head = vlm.get_output_embeddings().weight
    assert torch.allclose(head[vocab:], lm.get_output_embeddings().weight.mean(0).expand(
        new_vocab - vocab, -1))


def test_an_image_is_one_tile_of_four_image_tokens(tmp_path):
    out = build_model.build(make_tiny_model(tmp_path / "src"), tmp_path / "vlm", **SMALL)
    processor = AutoProcessor.from_pretrained(out)
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "<image>What colour?"}], tokenize=False,
        add_generation_prompt=True)
    features = processor(text=text, images=[Image.new("RGB", (64, 48), (200, 10, 10))],
                         add_special_tokens=False, return_tensors="pt")
    assert features["pixel_values"].shape == (1, 1, 3, 32, 32)
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    # (32 px / 8 px patches / 2 merged per side)^2 = 4
    assert features["input_ids"][0].tolist().count(image_id) == 4
    vlm = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    assert vlm.config.image_token_id == image_id


def test_sizes_that_do_not_divide_name_the_option(tmp_path):
    src = make_tiny_model(tmp_path / "src")
    with pytest.raises(ValueError, match="--image-size 30 must be a multiple of --patch 8"):
        build_model.build(src, tmp_path / "vlm", **{**SMALL, "image_size": 30})
    with pytest.raises(ValueError, match="--scale-factor 3 must divide the 4 patches"):
        build_model.build(src, tmp_path / "vlm", **{**SMALL, "scale_factor": 3})
