"""Write the generated code tasks (asyncrl.data.code_tasks) as JSONL, to read or to reuse.

    python examples/code/make_data.py --out runs/code_tasks --train-size 2000 \
        --held-out-size 64 --seed 0

writes <out>/train.jsonl and <out>/held_out.jsonl, the items code_grpo_cpu.yaml generates
when it starts (same sizes and seed, same items). Each line is an item: id, question,
answer (a reference solution), tests (assert statements), entry_point, task. The folder
is a dataset path (`--data <out> --split held_out` for `asyncrl eval`).
"""

import argparse
import json
from pathlib import Path

from asyncrl.data.code_tasks import generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSONL files")
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--held-out-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for split, size in (("train", args.train_size), ("held_out", args.held_out_size)):
        items = generate(size=size, seed=args.seed, split=split)
        path = args.out / f"{split}.jsonl"
        path.write_text("".join(json.dumps(item) + "\n" for item in items))
        print(f"{path}: {len(items)} items")


if __name__ == "__main__":
    main()
