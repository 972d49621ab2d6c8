"""Asynchronous GRPO on GSM8K.

    python examples/math/gsm8k_rl.py --config examples/math/gsm8k_grpo.yaml scheduler.type=local
    python examples/math/gsm8k_rl.py --config examples/math/gsm8k_grpo_cpu.yaml \\
        train_dataset.path=path/to/gsm8k    # a JSONL file or a folder with train.jsonl/test.jsonl

`train_dataset.path` takes a local JSONL file or folder in GSM8K's format (question /
answer ending in "#### N") or an HF dataset id; `actor.path` an HF folder or a named small
model (smollm2-135m-instruct). Any config key can be overridden as key=value.
"""

import argparse
import sys

from asyncrl.cli import print_summary
from asyncrl.config import load_config
from asyncrl.controller.rl import train


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", help="key=value")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    print_summary(train(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
