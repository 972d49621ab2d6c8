"""Generated visual questions: coloured shapes on a small canvas, short exact answers.

A scene is one to four shapes (square, circle, triangle), each red, green, blue or yellow,
drawn with Pillow without anti-aliasing on a white canvas, one shape per cell of a 3 x 3
grid (shapes never touch, so each is one connected region of its colour). A question asks
for a count ("How many red shapes are there?"), the colour of the only shape of a kind
("What colour is the circle?") or whether a shape is there ("Is there a blue square?"), and
the answer is a digit, a colour or yes/no.

The two splits differ in what they show, as CLEVR's CoGenT split does: three
(shape, colour) pairs (`HELD_OUT_PAIRS`, one per shape and colour) never appear in a
`train` scene, and every `held_out` scene holds at least one of them, so no image is in
both and the held-out score measures transfer to unseen combinations of known parts.

An item carries its image as a PNG data URL in `images` (what the RLVR workflow and the
SFT rows take) and the scene in `metadata`; the same (size, seed, split) gives the same
items. `train_tasks` and `held_out_tasks` are dataset generators
(`train_dataset.path: python:asyncrl.data.visual_tasks:train_tasks`); `eval_tasks` holds
new scenes of both splits, whose items' tasks (`visual_shapes`, `visual_shapes_held_out`)
an evaluation reports apart.

`hf_image_tasks` maps an HF image-question dataset (CLEVR counting, Geometry3K: rows of
"images", "problem" and "answer") to the same item shape, for the GPU examples.
"""

from __future__ import annotations

import base64
import io
import random
import re
from dataclasses import dataclass
from typing import Any

SPLITS = ("train", "held_out")
TASKS = {"train": "visual_shapes", "held_out": "visual_shapes_held_out"}  # items' "task"
SHAPES = ("square", "circle", "triangle")
# Saturated and far apart, so a pixel's colour names its shape's colour exactly.
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 40), "blue": (30, 60, 220),
           "yellow": (235, 200, 20)}
BACKGROUND = (255, 255, 255)
HELD_OUT_PAIRS = frozenset({("circle", "green"), ("square", "yellow"), ("triangle", "blue")})
GRID = 3  # cells per side; one shape per cell
MAX_SHAPES = 4
MIN_CANVAS = 48  # a cell must hold a shape of at least 8 pixels with a margin
DESCRIBE = "Describe the image."  # the question `describe` answers (SFT rows only)


@dataclass(frozen=True)
class Shape:
    kind: str    # one of SHAPES
    colour: str  # one of COLOURS
    box: tuple[int, int, int, int]  # left, top, right, bottom (inclusive), in pixels


def _scene(rng: random.Random, split: str, canvas: int) -> list[Shape]:
    """Shapes in distinct cells; `held_out` scenes hold a held-out pair, `train` ones none.
    The number of shapes is drawn once, before the pairs, so that it is uniform in both
    splits: redrawing it with the pairs would give training scenes fewer shapes (a scene of
    n shapes avoids the held-out pairs with probability 0.75^n) and held-out ones more."""
    n = rng.randint(1, MAX_SHAPES)
    while True:
        pairs = [(rng.choice(SHAPES), rng.choice(tuple(COLOURS))) for _ in range(n)]
        held = sum(p in HELD_OUT_PAIRS for p in pairs)
        if (held > 0) == (split == "held_out"):
            break
    cell = canvas // GRID
    shapes = []
    for (kind, colour), index in zip(pairs, rng.sample(range(GRID * GRID), n)):
        side = rng.randint(cell // 2, cell - 4)  # a margin of at least 2 pixels to the cell
        left = (index % GRID) * cell + rng.randint(2, cell - side - 2)
        top = (index // GRID) * cell + rng.randint(2, cell - side - 2)
        shapes.append(Shape(kind, colour, (left, top, left + side - 1, top + side - 1)))
    return shapes


def render(shapes: list[Shape], canvas: int) -> Any:
    """The scene as an RGB PIL image of `canvas` x `canvas` pixels."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (canvas, canvas), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for s in shapes:
        fill = COLOURS[s.colour]
        left, top, right, bottom = s.box
        if s.kind == "square":
            draw.rectangle(s.box, fill=fill)
        elif s.kind == "circle":
            draw.ellipse(s.box, fill=fill)
        else:  # apex up, base along the bottom
            draw.polygon([((left + right) / 2, top), (left, bottom), (right, bottom)], fill=fill)
    return image


def _question(rng: random.Random, shapes: list[Shape]) -> tuple[str, str]:
    """A question about `shapes` and its answer."""
    kinds = [s.kind for s in shapes]
    unique = [k for k in SHAPES if kinds.count(k) == 1]
    families = ["count", "count_colour", "count_kind", "exists"] + ["colour_of"] * bool(unique)
    family = rng.choice(families)
    if family == "count":
        return "How many shapes are there?", str(len(shapes))
    if family == "count_colour":
        colour = rng.choice(tuple(COLOURS))
        return (f"How many {colour} shapes are there?",
                str(sum(s.colour == colour for s in shapes)))
    if family == "count_kind":
        kind = rng.choice(SHAPES)
        return f"How many {kind}s are there?", str(kinds.count(kind))
    if family == "colour_of":
        kind = rng.choice(unique)
        return f"What colour is the {kind}?", next(s.colour for s in shapes if s.kind == kind)
    # exists: half the time about a pair in the scene, so "yes" is as common as "no"
    kind, colour = rng.choice([(s.kind, s.colour) for s in shapes]) if rng.random() < 0.5 \
        else (rng.choice(SHAPES), rng.choice(tuple(COLOURS)))
    there = any((s.kind, s.colour) == (kind, colour) for s in shapes)
    return f"Is there a {colour} {kind}?", "yes" if there else "no"


def describe(shapes: list[Shape], canvas: int) -> str:
    """The scene in words, its shapes in reading order of their grid cells ("red square,
    blue circle"): a dense target that names every shape's colour and kind."""
    cell = canvas // GRID
    ordered = sorted(shapes, key=lambda s: (s.box[1] // cell, s.box[0] // cell))
    return ", ".join(f"{s.colour} {s.kind}" for s in ordered)


def worked_answer(item: dict[str, Any], canvas: int = 64) -> str:
    """`item`'s answer worked from the scene: the shapes named as `describe` names them, then
    the answer after "Answer:" ("red square, blue circle. Answer: 2"), the form the
    marked_short_answer reward reads."""
    return f"{describe(scene_of(item), canvas)}. Answer: {item['answer']}"


def data_url(image: Any) -> str:
    """`image` as a PNG data URL."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def generate(*, size: int, seed: int, split: str = "train",
             canvas: int = 64) -> list[dict[str, Any]]:
    """`size` items of `split`, the same for the same arguments."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")
    if canvas < MIN_CANVAS:
        raise ValueError(f"canvas={canvas} pixels is too small for a {GRID} x {GRID} grid of "
                         f"shapes; use canvas >= {MIN_CANVAS}")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    rng = random.Random(f"visual-shapes/{split}/{seed}")  # the splits draw apart
    items = []
    for i in range(size):
        shapes = _scene(rng, split, canvas)
        question, answer = _question(rng, shapes)
        items.append({
            "id": f"shapes-{split}-s{seed}-{i}", "task": TASKS[split],
            "question": question, "answer": answer,
            "images": [data_url(render(shapes, canvas))],
            "metadata": {"shapes": [[s.kind, s.colour, *s.box] for s in shapes]},
        })
    return items


def scene_of(item: dict[str, Any]) -> list[Shape]:
    """The shapes of an item `generate` made, from its metadata."""
    return [Shape(kind, colour, tuple(box)) for kind, colour, *box in item["metadata"]["shapes"]]


def train_tasks(*, size: int, seed: int, canvas: int = 64) -> list[dict[str, Any]]:
    """Training items: scenes without the held-out (shape, colour) pairs."""
    return generate(size=size, seed=seed, split="train", canvas=canvas)


def held_out_tasks(*, size: int, seed: int, canvas: int = 64) -> list[dict[str, Any]]:
    """Held-out items: every scene holds a held-out (shape, colour) pair."""
    return generate(size=size, seed=seed, split="held_out", canvas=canvas)


def eval_tasks(*, size: int, seed: int, held_out_size: int = 192, held_out_seed: int = 0,
               canvas: int = 64) -> list[dict[str, Any]]:
    """An evaluation set of both kinds of new scene: `size` items of the training split
    (`train_tasks(size=size, seed=seed)`: give a seed no training set uses) and then
    `held_out_size` of the held-out split (`held_out_tasks(size=held_out_size,
    seed=held_out_seed)`). Their tasks differ, so an evaluation reports each one's reward."""
    return (train_tasks(size=size, seed=seed, canvas=canvas)
            + held_out_tasks(size=held_out_size, seed=held_out_seed, canvas=canvas))


def hf_image_item(row: dict[str, Any], *, item_id: str, task: str) -> dict[str, Any]:
    """An item from an HF row {"images": [PIL images], "problem" or "question", "answer"};
    the question's own "<image>" markers are dropped (the workflow places the images)."""
    key = "problem" if "problem" in row else "question"
    missing = [k for k in ("images", key, "answer") if k not in row]
    if missing:
        raise ValueError(f"{item_id}: the row lacks {missing} (it has {sorted(row)}); rows "
                         "need images, a problem (or question) and an answer")
    images = row["images"] if isinstance(row["images"], list) else [row["images"]]
    question = re.sub(r"\s*<image>\s*", " ", row[key]).strip()
    return {"id": item_id, "task": task, "question": question,
            "answer": str(row["answer"]).strip(), "images": images}


def hf_image_tasks(*, size: int, seed: int, dataset: str,
                   split: str = "train") -> list[dict[str, Any]]:
    """The first `size` rows of the HF dataset `dataset` (`split`) as items (`seed` unused:
    the dataset's order is fixed)."""
    import datasets

    rows = datasets.load_dataset(dataset, split=split)
    task = dataset.rstrip("/").split("/")[-1]
    return [hf_image_item(row, item_id=f"{task}-{split}-{i}", task=task)
            for i, row in zip(range(size), rows)]
