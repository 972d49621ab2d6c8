"""models/tiny.py: the random test models' options."""

import json

import pytest

from asyncrl.models.tiny import make_tiny_model, make_tiny_tokenizer


def test_a_tiny_model_takes_a_larger_vocabulary_and_refuses_a_smaller_one(tmp_path):
    tokens = len(make_tiny_tokenizer())
    assert make_tiny_model(tmp_path / "wide", vocab_size=1024) == str(tmp_path / "wide")
    assert json.loads((tmp_path / "wide" / "config.json").read_text())["vocab_size"] == 1024
    make_tiny_model(tmp_path / "default")
    default = json.loads((tmp_path / "default" / "config.json").read_text())["vocab_size"]
    assert default == (tokens + 63) // 64 * 64
    with pytest.raises(ValueError, match=rf"vocab_size=100 is below the tokenizer's {tokens}"):
        make_tiny_model(tmp_path / "narrow", vocab_size=100)
