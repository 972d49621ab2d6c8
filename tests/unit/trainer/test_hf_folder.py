"""checkpoint.write_hf_folder: weights written over a folder in place, the tokenizer saved
only where the folder does not hold its last save's files."""

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

from asyncrl.trainer import checkpoint


def test_the_tokenizer_is_saved_again_only_where_its_files_differ(tiny_path, tmp_path,
                                                                  monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    config = AutoConfig.from_pretrained(tiny_path)
    saves = []
    real = type(tokenizer).save_pretrained
    monkeypatch.setattr(type(tokenizer), "save_pretrained",
                        lambda self, *a, **k: saves.append(1) or real(self, *a, **k))
    folder = tmp_path / "v1"
    for version in range(3):  # a publish over the previous version's folder
        weights = {"w": torch.full((4,), float(version), dtype=torch.bfloat16)}
        checkpoint.write_hf_folder(folder, weights, config, tokenizer)
        assert torch.equal(load_file(folder / "model.safetensors")["w"], weights["w"])
    assert len(saves) == 1
    names = {p.name for p in folder.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    (folder / "tokenizer.json").write_text("{}")  # changed under it: saved again
    checkpoint.write_hf_folder(folder, weights, config, tokenizer)
    (folder / "tokenizer_config.json").unlink()  # missing: saved again
    checkpoint.write_hf_folder(folder, weights, config, tokenizer)
    checkpoint.write_hf_folder(tmp_path / "new", weights, config, tokenizer)  # a new folder
    assert len(saves) == 4
    assert AutoTokenizer.from_pretrained(folder).encode("hello") == tokenizer.encode("hello")
    assert {p.name for p in folder.iterdir()} == names
