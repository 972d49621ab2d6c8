"""Write the generated visual task (asyncrl.data.visual_tasks) as JSONL: SFT rows and a
held-out set.

    python examples/vlm/make_data.py --out runs/visual_shapes

writes <out>/train.jsonl and <out>/held_out.jsonl. Each line is an item: id, question,
answer (a digit, a colour, or yes/no), images (one PNG data URL), task, metadata (the
scene). `asyncrl sft` reads them as {question, answer} rows with images (shapes_sft_cpu.yaml);
the held-out file is the same items shapes_grpo_cpu.yaml evaluates on (same size and seed).

Each training image also gets a description row ("Describe the image." -> "red square,
blue circle", the shapes in reading order of their cells): a target that names every
shape, where a question's answer names one fact. Trained on the questions alone, the new
vision encoder learns little of the image, and the model answers about as well with a
blank one (examples/vlm/README.md). `--no-descriptions` writes the questions alone.

`--worked` writes each question's answer worked from the scene instead, the shapes named
and then the answer ("red square, blue circle. Answer: 2"; `visual_tasks.worked_answer`),
with no separate description rows: every row names the shapes before it answers, as
shapes_worked_sft_cpu.yaml and shapes_worked_grpo_cpu.yaml expect.
"""

import argparse
import json
from pathlib import Path

from asyncrl.data.visual_tasks import DESCRIBE, describe, generate, scene_of, worked_answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSONL files")
    parser.add_argument("--train-size", type=int, default=3000)
    parser.add_argument("--held-out-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--canvas", type=int, default=64, help="image side, in pixels")
    parser.add_argument("--no-descriptions", action="store_true",
                        help="write the questions alone, without a description row per "
                             "training image")
    parser.add_argument("--worked", action="store_true",
                        help="answers worked from the scene: the shapes, then 'Answer: ...' "
                             "(no description rows)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for split, size in (("train", args.train_size), ("held_out", args.held_out_size)):
        items = generate(size=size, seed=args.seed, split=split, canvas=args.canvas)
        rows = list(items)
        if args.worked:
            rows = [{**item, "answer": worked_answer(item, args.canvas)} for item in items]
        elif split == "train" and not args.no_descriptions:
            rows += [description_row(item, args.canvas) for item in items]
        with open(args.out / f"{split}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"{args.out / f'{split}.jsonl'}: {len(rows)} rows")


def description_row(item: dict, canvas: int) -> dict:
    """An SFT row of `item`'s image: the question DESCRIBE, the scene in words."""
    return {**item, "id": item["id"] + "-describe", "question": DESCRIBE,
            "answer": describe(scene_of(item), canvas)}


if __name__ == "__main__":
    main()
