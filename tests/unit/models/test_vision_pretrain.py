"""examples/vlm/pretrain_vision.py: cell labels by hand, its accuracy counts, and a short
run that trains the vision encoder alone and beats the all-empty guess."""

from types import SimpleNamespace

import pytest
import torch
from example_scripts import folder_weights as weights
from example_scripts import load_example

from asyncrl.data.visual_tasks import Shape
from asyncrl.models.tiny import make_tiny_model

build_model = load_example("vlm/build_model.py")
pretrain_vision = load_example("vlm/pretrain_vision.py")


def test_cell_labels_in_reading_order_of_the_cells():
    # 64 px canvas: cells of 21 px; (44, 23) lies in row 1, column 2, cell 5
    kinds, colours = pretrain_vision.cell_labels(
        [Shape("circle", "red", (0, 0, 9, 9)), Shape("triangle", "yellow", (44, 23, 55, 34))],
        64)
    # KINDS: none, square, circle, triangle; COLOUR_NAMES: none, red, green, blue, yellow
    assert kinds == [2, 0, 0, 0, 0, 3, 0, 0, 0]
    assert colours == [1, 0, 0, 0, 0, 4, 0, 0, 0]


def test_accuracy_counts_cells_and_whole_scenes():
    kinds = torch.tensor([[1, 0, 0, 0, 0, 0, 0, 0, 2], [0, 3, 0, 0, 0, 0, 0, 0, 0]])
    colours = torch.tensor([[1, 0, 0, 0, 0, 0, 0, 0, 4], [0, 2, 0, 0, 0, 0, 0, 0, 0]])
    wrong_kinds = kinds.clone()
    wrong_kinds[1, 1] = 1  # one cell of the second scene misnamed

    def head(features):
        index = features[:, 0, 0].long()
        return (torch.nn.functional.one_hot(wrong_kinds[index], 4).float(),
                torch.nn.functional.one_hot(colours[index], 5).float())

    def encoder(pixel_values):  # passes each scene's index through to the head
        return SimpleNamespace(last_hidden_state=pixel_values)

    pixels = torch.arange(2.0).view(2, 1, 1).expand(2, 1, 1)
    got = pretrain_vision.accuracy(encoder, head, (pixels, kinds, colours), batch_size=1)
    assert got == pytest.approx({"kind": 17 / 18, "colour": 1.0, "scene": 0.5, "empty": 15 / 18})


def test_a_short_run_trains_the_encoder_alone_and_beats_the_empty_guess(tmp_path):
    vlm = build_model.build(make_tiny_model(tmp_path / "lm"), tmp_path / "vlm", image_size=48,
                            patch=8, vision_hidden=32, vision_layers=1, vision_heads=2)
    before = weights(vlm)
    result = pretrain_vision.pretrain(vlm, tmp_path / "out", steps=60, batch_size=32,
                                      lr=3e-3, train_size=512, eval_size=128, log_every=1000)
    after = weights(tmp_path / "out")
    assert before.keys() == after.keys()  # the head is not saved
    for name in before:
        assert torch.equal(before[name], after[name]) != name.startswith("model.vision_model."), name
    assert all(torch.equal(before[k], v) for k, v in weights(vlm).items())  # source kept
    # The all-empty guess is right on the empty cells: 1 to 4 shapes in 9 cells, about 0.72
    # of them. 60 steps of this tiny encoder name 0.81-0.88 of the cells.
    for split in ("train", "held_out"):
        assert 0.6 < result[split]["empty"] < 0.8, result
        assert result[split]["colour"] > result[split]["empty"] + 0.05, result
        assert result[split]["kind"] > result[split]["empty"] + 0.05, result


def test_an_unknown_pairs_choice_is_refused(tmp_path):
    with pytest.raises(ValueError, match="pairs='held_out'"):
        pretrain_vision.pretrain(tmp_path, steps=1, pairs="held_out")
