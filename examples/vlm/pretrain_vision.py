"""Pretrain the vision encoder of a model folder from build_model.py on the task's scenes.

    python examples/vlm/pretrain_vision.py --model runs/smolvlm-shapes

A vision-language model starts from a vision encoder that already sees (SigLIP in
SmolVLM, a ViT trained on images and captions); the one build_model.py writes is random,
and the answer tokens alone, through a language model, teach it little (README.md). This
stands in for that pretraining: the encoder, with a linear head on its patch features,
learns to name what lies in each cell of the scene's 3 x 3 grid (its shape or none, its
colour or none). The head is dropped and the encoder written back into the folder (`--out`
writes a copy instead).

By default half the scenes are held-out-split ones (other seeds than the held-out set
evaluated on), so the encoder has seen every (shape, colour) pair, as a pretrained encoder
has seen green circles; the question-answer training that follows (SFT, GRPO) never shows
the held-out pairs. `--pairs train` pretrains on training-split scenes alone: the encoder
then often misnames the shape of a pair it never saw (README.md).

It prints each label's accuracy on new training-split scenes and on held-out scenes, cell
by cell and for whole scenes.
"""

from __future__ import annotations

import argparse
import math
import shutil
import time
from pathlib import Path

import torch
import transformers

from asyncrl.data.visual_tasks import (COLOURS, GRID, SHAPES, Shape, generate, render,
                                      scene_of)

KINDS = ("none",) + SHAPES
COLOUR_NAMES = ("none",) + tuple(COLOURS)


def cell_labels(shapes: list[Shape], canvas: int) -> tuple[list[int], list[int]]:
    """Each grid cell's shape and colour, as indices into KINDS and COLOUR_NAMES, in
    reading order of the cells."""
    cell = canvas // GRID
    kinds, colours = [0] * GRID * GRID, [0] * GRID * GRID
    for s in shapes:
        index = (s.box[1] // cell) * GRID + s.box[0] // cell
        kinds[index] = KINDS.index(s.kind)
        colours[index] = COLOUR_NAMES.index(s.colour)
    return kinds, colours


def scenes(processor, *, size: int, seed: int, split: str, canvas: int):
    """`size` scenes of `split` as (pixel_values, kind labels, colour labels)."""
    items = generate(size=size, seed=seed, split=split, canvas=canvas)
    shapes = [scene_of(item) for item in items]
    pixels = processor.image_processor([render(s, canvas) for s in shapes],
                                       return_tensors="pt")["pixel_values"]
    labels = [cell_labels(s, canvas) for s in shapes]
    return (pixels.reshape(size, *pixels.shape[-3:]),
            torch.tensor([k for k, _ in labels]), torch.tensor([c for _, c in labels]))


class CellHead(torch.nn.Module):
    """The encoder's patch features, flattened, to each cell's shape and colour logits."""

    def __init__(self, patches: int, hidden: int):
        super().__init__()
        cells = GRID * GRID
        self.kind = torch.nn.Linear(patches * hidden, cells * len(KINDS))
        self.colour = torch.nn.Linear(patches * hidden, cells * len(COLOUR_NAMES))

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = features.flatten(1)
        return (self.kind(flat).view(len(flat), -1, len(KINDS)),
                self.colour(flat).view(len(flat), -1, len(COLOUR_NAMES)))


@torch.no_grad()
def accuracy(encoder, head, data, batch_size: int = 256) -> dict[str, float]:
    """Cells whose shape (colour) is right, scenes whose every cell is right, and the cells
    the all-empty guess gets right."""
    pixels, kinds, colours = data
    kind_pred, colour_pred = [], []
    for i in range(0, len(pixels), batch_size):
        k, c = head(encoder(pixel_values=pixels[i:i + batch_size]).last_hidden_state)
        kind_pred.append(k.argmax(-1))
        colour_pred.append(c.argmax(-1))
    kind_ok = torch.cat(kind_pred) == kinds
    colour_ok = torch.cat(colour_pred) == colours
    return {"kind": kind_ok.float().mean().item(), "colour": colour_ok.float().mean().item(),
            "scene": (kind_ok & colour_ok).all(-1).float().mean().item(),
            "empty": (kinds == 0).float().mean().item()}


def pretrain(model_dir: str | Path, out: str | Path | None = None, *, steps: int = 600,
             batch_size: int = 64, lr: float = 1e-3, train_size: int = 20000,
             pairs: str = "all", eval_size: int = 512, seed: int = 0,
             log_every: int = 100) -> dict[str, dict]:
    """Train the encoder of `model_dir`, save the model to `out` (default: in place);
    returns the accuracies on new training-split and held-out scenes."""
    if pairs not in ("all", "train"):
        raise ValueError(f"pairs={pairs!r}: use 'all' (scenes of every (shape, colour) pair) "
                         "or 'train' (training-split scenes alone)")
    torch.manual_seed(seed)
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir,
                                                                     dtype=torch.float32)
    encoder = model.model.vision_model
    vision = model.config.vision_config
    canvas = vision.image_size
    patches = (canvas // vision.patch_size) ** 2
    head = CellHead(patches, vision.hidden_size)
    parts = [scenes(processor, size=train_size - train_size // 2 * (pairs == "all"), seed=seed,
                    split="train", canvas=canvas)]
    if pairs == "all":  # seeds from 2000 on: none of the held-out set's (seed 0) scenes
        parts.append(scenes(processor, size=train_size // 2, seed=seed + 2000,
                            split="held_out", canvas=canvas))
    train = tuple(torch.cat(tensors) for tensors in zip(*parts))
    # Scenes for the report, drawn from other seeds than training's.
    checks = {split: scenes(processor, size=eval_size, seed=seed + 1000, split=split,
                            canvas=canvas) for split in ("train", "held_out")}
    params = list(encoder.parameters()) + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup,
                                 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    generator = torch.Generator().manual_seed(seed)
    encoder.train()
    start = time.time()
    for step in range(1, steps + 1):
        idx = torch.randint(len(train[0]), (batch_size,), generator=generator)
        kind_logits, colour_logits = head(encoder(pixel_values=train[0][idx]).last_hidden_state)
        loss = (torch.nn.functional.cross_entropy(kind_logits.flatten(0, 1), train[1][idx].flatten())
                + torch.nn.functional.cross_entropy(colour_logits.flatten(0, 1),
                                                    train[2][idx].flatten()))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        if step % log_every == 0 or step == steps:
            print(f"step {step}: loss {loss.item():.4f} ({time.time() - start:.0f} s)",
                  flush=True)
    encoder.eval()
    result = {split: accuracy(encoder, head, data) for split, data in checks.items()}
    out = Path(out or model_dir)
    if out != Path(model_dir):
        shutil.copytree(model_dir, out, dirs_exist_ok=True)
    model.save_pretrained(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True,
                        help="a folder from build_model.py")
    parser.add_argument("--out", type=Path, help="write the model here (default: --model)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--train-size", type=int, default=20000,
                        help="scenes to draw batches from")
    parser.add_argument("--pairs", choices=("all", "train"), default="all",
                        help="'all': scenes of every (shape, colour) pair; 'train': "
                             "training-split scenes alone")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = pretrain(args.model, args.out, steps=args.steps, batch_size=args.batch_size,
                      lr=args.lr, train_size=args.train_size, pairs=args.pairs,
                      seed=args.seed)
    for split, acc in result.items():
        print(f"{split} scenes: cells with the right shape {acc['kind']:.3f}, colour "
              f"{acc['colour']:.3f} (the all-empty guess {acc['empty']:.3f}); scenes all right "
              f"{acc['scene']:.3f}")


if __name__ == "__main__":
    main()
