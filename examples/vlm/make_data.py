"""Write the generated visual task (asyncrl.data.visual_tasks) as JSONL: SFT rows and a
held-out set.

    python examples/vlm/make_data.py --out runs/visual_shapes

writes <out>/train.jsonl and <out>/held_out.jsonl. Each line is an item: id, question,
answer (a digit, a colour, or yes/no), images (one PNG data URL), task, metadata (the
scene). `asyncrl sft` reads them as {question, answer} rows with images (shapes_sft_cpu.yaml);
the held-out file is the same items shapes_grpo_cpu.yaml evaluates on (same size and seed).
"""

import argparse
import json
from pathlib import Path

from asyncrl.data.visual_tasks import generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSONL files")
    parser.add_argument("--train-size", type=int, default=3000)
    parser.add_argument("--held-out-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--canvas", type=int, default=64, help="image side, in pixels")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for split, size in (("train", args.train_size), ("held_out", args.held_out_size)):
        items = generate(size=size, seed=args.seed, split=split, canvas=args.canvas)
        with open(args.out / f"{split}.jsonl", "w") as f:
            for item in items:
                f.write(json.dumps(item) + "\n")
        print(f"{args.out / f'{split}.jsonl'}: {len(items)} items")


if __name__ == "__main__":
    main()
