"""Reward-model training (`asyncrl rm`, `python -m asyncrl.offline.rm`): Bradley-Terry.

The offline loop of SFT and DPO (`offline/loop.py`) with the reward model's engine
(a scalar head read at each row's last token) and loss, on the preference rows DPO reads
(`load_preference_examples`), the loss mask on each row's last token. The held-out loss,
accuracy and margin are reported before, every `evaluator.freq_*` and after training; the
final model is an HF folder `checkpoints/step<N>/` (a one-label sequence classifier).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from asyncrl.algorithms.rm import make_bradley_terry_loss_fn
from asyncrl.config.offline import RMConfig
from asyncrl.data.offline import last_token_row, load_preference_examples
from asyncrl.offline import launch
from asyncrl.offline.loop import OfflineTrainer
from asyncrl.trainer.reward import FSDPRewardEngine

SHOWN = ("train/loss", "train/accuracy", "train/margin")


def train(cfg: RMConfig) -> dict[str, Any]:
    """Train a reward model as `cfg` says; the summary has held-out figures and the model dir."""
    with OfflineTrainer(cfg) as trainer:
        load = functools.partial(load_preference_examples, tokenizer=trainer.tokenizer,
                                 system_prompt=cfg.system_prompt, to_row=last_token_row)
        train_ex = load(cfg.train_dataset)
        valid_ex = load(cfg.valid_dataset) if cfg.valid_dataset else []
        engine = functools.partial(FSDPRewardEngine, system_prompt=cfg.system_prompt)
        return trainer.fit(train_ex, valid_ex, make_bradley_terry_loss_fn(), show=SHOWN,
                           engine_cls=engine)


def main(argv: list[str] | None = None) -> int:
    """`python -m asyncrl.offline.rm --config rm.yaml key=value ...`: as `asyncrl rm`."""
    return launch.main("rm", sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
