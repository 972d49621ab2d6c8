"""The generated visual task: the pixels hold what the answer says (read back by flood
fill, not from the generator's scene), the splits share no image, and the reward by hand."""

import base64
import functools
import io
import json
import re
from collections import Counter, deque

import numpy as np
import pytest
from example_scripts import load_example
from PIL import Image

from asyncrl.config.schema import DatasetConfig
from asyncrl.data.loading import held_out, load_dataset
from asyncrl.data.visual_tasks import (
    COLOURS,
    HELD_OUT_PAIRS,
    Shape,
    describe,
    generate,
    held_out_tasks,
    hf_image_item,
    scene_of,
    train_tasks,
    worked_answer,
)
from asyncrl.rewards.registry import resolve_answer_fn, resolve_reward_fn
from asyncrl.rewards.short_answer import marked_short_answer_reward, short_answer_reward

TRAIN = train_tasks(size=200, seed=0)
HELD_OUT = held_out_tasks(size=100, seed=0)


def pixels(item) -> np.ndarray:
    data = item["images"][0].removeprefix("data:image/png;base64,")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))


@functools.cache
def item_regions(item_id: str) -> list[tuple[str, str]]:
    """`regions` of a TRAIN or HELD_OUT item's image, read once."""
    (item,) = [i for i in TRAIN + HELD_OUT if i["id"] == item_id]
    return regions(pixels(item))


def regions(image: np.ndarray) -> list[tuple[str, str]]:
    """(colour, kind) of each 4-connected region of one shape colour. The kind is read from
    how much of its bounding box the region fills: a square all of it, a circle pi/4
    (0.785), a triangle half."""
    names = {rgb: name for name, rgb in COLOURS.items()}
    h, w, _ = image.shape
    seen = np.zeros((h, w), dtype=bool)
    found = []
    for y in range(h):
        for x in range(w):
            rgb = tuple(int(v) for v in image[y, x])
            if seen[y, x] or rgb not in names:
                continue
            queue, cells = deque([(y, x)]), []
            seen[y, x] = True
            while queue:
                cy, cx = queue.popleft()
                cells.append((cy, cx))
                for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                    if 0 <= ny < h and 0 <= nx < w and not seen[ny, nx] \
                            and tuple(int(v) for v in image[ny, nx]) == rgb:
                        seen[ny, nx] = True
                        queue.append((ny, nx))
            ys, xs = zip(*cells)
            fill = len(cells) / ((max(ys) - min(ys) + 1) * (max(xs) - min(xs) + 1))
            kind = "square" if fill > 0.95 else "circle" if fill > 0.65 else "triangle"
            found.append((names[rgb], kind))
    return found


def answer_from_pixels(question: str, found: list[tuple[str, str]]) -> str:
    if question == "How many shapes are there?":
        return str(len(found))
    if m := re.fullmatch(r"How many (\w+) shapes are there\?", question):
        return str(sum(c == m[1] for c, _ in found))
    if m := re.fullmatch(r"How many (\w+)s are there\?", question):
        return str(sum(k == m[1] for _, k in found))
    if m := re.fullmatch(r"What colour is the (\w+)\?", question):
        (colour,) = [c for c, k in found if k == m[1]]  # exactly one such shape
        return colour
    m = re.fullmatch(r"Is there a (\w+) (\w+)\?", question)
    return "yes" if (m[1], m[2]) in found else "no"


def test_the_pixels_hold_what_each_answer_says():
    for item in TRAIN + HELD_OUT:
        image = pixels(item)
        assert image.shape == (64, 64, 3)
        # only the background and the four shape colours: no anti-aliased edge colours
        assert {tuple(int(v) for v in p) for p in image.reshape(-1, 3)} <= \
            {(255, 255, 255), *COLOURS.values()}
        found = item_regions(item["id"])
        assert answer_from_pixels(item["question"], found) == item["answer"], item["id"]


def test_a_description_names_every_shape_in_reading_order_of_the_cells():
    # 64 px, cells of 21: the circle is in row 0 column 2, the square row 0 column 0, the
    # triangle row 2 column 1
    shapes = [Shape("circle", "blue", (45, 3, 55, 13)), Shape("square", "red", (2, 2, 12, 12)),
              Shape("triangle", "green", (24, 45, 36, 57))]
    assert describe(shapes, 64) == "red square, blue circle, green triangle"
    for item in TRAIN:  # the same shapes as the pixels show
        scene = scene_of(item)
        assert sorted(describe(scene, 64).split(", ")) == \
            sorted(f"{c} {k}" for c, k in item_regions(item["id"])), item["id"]


def test_every_question_family_and_answer_kind_appears():
    answers = {item["answer"] for item in TRAIN}
    assert {"1", "2", "3", "4", "yes", "no", "red", "green", "blue", "yellow"} <= answers
    starts = {item["question"].split()[0] for item in TRAIN}
    assert starts == {"How", "What", "Is"}


def test_held_out_scenes_each_hold_a_held_out_pair_and_training_scenes_none():
    for item in TRAIN:
        assert not set(item_regions(item["id"])) & {(c, k) for k, c in HELD_OUT_PAIRS}
    for item in HELD_OUT:
        assert set(item_regions(item["id"])) & {(c, k) for k, c in HELD_OUT_PAIRS}
    assert not {i["images"][0] for i in TRAIN} & {i["images"][0] for i in HELD_OUT}
    assert not {i["id"] for i in TRAIN} & {i["id"] for i in HELD_OUT}


def test_both_splits_draw_one_to_four_shapes_uniformly():
    # Were the count redrawn with the pairs, a training scene of n shapes would be kept
    # with probability 0.75^n: counts 1-4 at about 0.37, 0.28, 0.20, 0.15 of the scenes.
    for split in ("train", "held_out"):
        items = generate(size=2000, seed=5, split=split)
        counts = Counter(len(item["metadata"]["shapes"]) for item in items)
        assert sorted(counts) == [1, 2, 3, 4]
        for n in counts:  # 0.25 within 4 standard deviations (0.0097 each)
            assert abs(counts[n] / 2000 - 0.25) < 0.04, (split, counts)


def test_the_same_seed_gives_the_same_items_and_another_seed_others():
    assert train_tasks(size=200, seed=0) == TRAIN
    assert [i["images"] for i in train_tasks(size=50, seed=1)] != [i["images"] for i in TRAIN[:50]]


def test_a_config_loads_the_items_by_name_with_the_canvas_as_a_task_kwarg():
    cfg = DatasetConfig(path="python:asyncrl.data.visual_tasks:held_out_tasks", size=5, seed=3,
                        task_kwargs={"canvas": 96})
    items = load_dataset(cfg)
    assert items == held_out_tasks(size=5, seed=3, canvas=96)
    assert pixels(items[0]).shape == (96, 96, 3)


def test_an_eval_set_holds_both_splits_as_two_tasks():
    cfg = DatasetConfig(path="python:asyncrl.data.visual_tasks:eval_tasks", size=6, seed=98,
                        task_kwargs={"held_out_size": 4, "held_out_seed": 3})
    items = load_dataset(cfg)
    assert items == train_tasks(size=6, seed=98) + held_out_tasks(size=4, seed=3)
    assert [i["task"] for i in items] == ["visual_shapes"] * 6 + ["visual_shapes_held_out"] * 4
    assert {i["task"] for i in TRAIN} == {"visual_shapes"}
    assert {i["task"] for i in HELD_OUT} == {"visual_shapes_held_out"}


def test_bad_arguments_name_what_to_change():
    with pytest.raises(ValueError, match="split 'test' is not one of"):
        generate(size=1, seed=0, split="test")
    with pytest.raises(ValueError, match="canvas >= 48"):
        generate(size=1, seed=0, canvas=32)


def test_short_answer_reward_matches_after_normalisation_only():
    item = {"id": "q", "answer": "3"}
    assert short_answer_reward("3", item) == 1.0
    assert short_answer_reward(" Three.\n", item) == 1.0
    assert short_answer_reward("3 shapes", item) == 0.0
    assert short_answer_reward("4", item) == 0.0
    assert short_answer_reward("Yellow!", {"answer": "yellow"}) == 1.0
    assert short_answer_reward("\"yes\"", {"answer": "yes"}) == 1.0
    assert short_answer_reward("no", {"answer": "yes"}) == 0.0
    assert resolve_reward_fn("short_answer") is short_answer_reward
    assert resolve_answer_fn("short_answer")("Two.") == "2"
    with pytest.raises(KeyError, match="item 'q' has no 'answer'"):
        short_answer_reward("3", {"id": "q"})


def test_marked_short_answer_reads_the_text_after_the_last_marker():
    item = {"id": "q", "answer": "2"}
    assert marked_short_answer_reward("red square, blue circle. Answer: 2", item) == 1.0
    assert marked_short_answer_reward("red square. ANSWER: Two.", item) == 1.0
    # the last marker counts; what comes before it is reasoning, not the answer
    assert marked_short_answer_reward("Answer: 2, no wait. Answer: 3", item) == 0.0
    assert marked_short_answer_reward("Answer: 3. Answer: 2", item) == 1.0
    assert marked_short_answer_reward("2", item) == 0.0  # no marker, no answer
    assert marked_short_answer_reward("Answer: 2 shapes", item) == 0.0
    # "İ" lower-cases to two characters; the answer is still read from the text as written
    assert marked_short_answer_reward("İİİAnswer:10", {"answer": "10"}) == 1.0
    assert resolve_reward_fn("marked_short_answer") is marked_short_answer_reward
    assert resolve_answer_fn("marked_short_answer")("x. answer: Yes!") == "yes"
    assert resolve_answer_fn("marked_short_answer")("yes") is None
    with pytest.raises(KeyError, match="item 'q' has no 'answer'"):
        marked_short_answer_reward("Answer: 3", {"id": "q"})


def test_a_worked_answer_names_the_shapes_then_scores_as_the_answer():
    for item in TRAIN[:50]:
        worked = worked_answer(item)
        shapes, answer = worked.split(". Answer: ")
        assert answer == item["answer"]
        # the shapes as the pixels show them (flood fill), in some order
        assert Counter(tuple(s.split()) for s in shapes.split(", ")) == \
            Counter(item_regions(item["id"]))
        assert marked_short_answer_reward(worked, item) == 1.0
    item = TRAIN[0]
    assert worked_answer({**item, "metadata": {"shapes": [
        ["circle", "blue", 40, 2, 55, 17], ["square", "red", 2, 2, 17, 17]]}}) == \
        f"red square, blue circle. Answer: {item['answer']}"


def test_an_hf_image_row_becomes_an_item_without_its_image_marker():
    image = Image.new("RGB", (8, 8))
    row = {"images": [image], "problem": "<image>How many items are there?", "answer": 3}
    item = hf_image_item(row, item_id="clevr-train-0", task="clevr")
    assert item == {"id": "clevr-train-0", "task": "clevr", "answer": "3", "images": [image],
                    "question": "How many items are there?"}
    with pytest.raises(ValueError, match=r"clevr-train-1: the row lacks \['answer'\]"):
        hf_image_item({"images": [image], "problem": "q"}, item_id="clevr-train-1", task="c")


def test_decontamination_keeps_a_templated_question_about_another_image():
    templated = {i["question"] for i in TRAIN}  # most held-out questions are asked in training
    assert sum(i["question"] in templated for i in HELD_OUT) >= 90
    assert held_out(HELD_OUT, TRAIN) == HELD_OUT
    twin = {**HELD_OUT[0], "id": "copy"}  # the same question and image under another id
    assert held_out(HELD_OUT, TRAIN + [twin]) == HELD_OUT[1:]
    pil = {"id": "p", "question": "q", "images": [Image.new("RGB", (4, 4), (1, 2, 3))]}
    same = {"id": "t", "question": "q", "images": [Image.new("RGB", (4, 4), (1, 2, 3))]}
    other = {"id": "o", "question": "q", "images": [Image.new("RGB", (4, 4), (9, 2, 3))]}
    assert held_out([pil], [other]) == [pil]
    with pytest.raises(ValueError, match="all 1 held-out items also appear"):
        held_out([pil], [same])


@pytest.mark.parametrize("worked", [False, True])
def test_make_data_writes_questions_with_descriptions_or_worked_answers(tmp_path, monkeypatch,
                                                                        worked):
    make_data = load_example("vlm/make_data.py")
    monkeypatch.setattr("sys.argv", ["make_data.py", "--out", str(tmp_path), "--train-size", "5",
                                     "--held-out-size", "3", *(["--worked"] * worked)])
    make_data.main()
    rows = {split: [json.loads(line) for line in open(tmp_path / f"{split}.jsonl")]
            for split in ("train", "held_out")}
    items = {"train": train_tasks(size=5, seed=0), "held_out": held_out_tasks(size=3, seed=0)}
    for split, expected in items.items():
        questions = rows[split][:len(expected)]
        assert [r["id"] for r in questions] == [i["id"] for i in expected]
        assert [r["answer"] for r in questions] == \
            [worked_answer(i) if worked else i["answer"] for i in expected]
    # a description row per training image, unless the answers are worked
    extra = rows["train"][5:]
    assert len(extra) == (0 if worked else 5)
    assert [r["answer"] for r in extra] == \
        ([] if worked else [describe(scene_of(i), 64) for i in items["train"]])
    assert len(rows["held_out"]) == 3
