"""Supervised fine-tuning on prompt/answer, chat or GSM8K-solution JSONL (loss on answers only)."""

from __future__ import annotations

from typing import Any

from asyncrl.algorithms import make_sft_loss_fn
from asyncrl.config.offline import SFTConfig
from asyncrl.data.offline import load_sft_examples
from asyncrl.offline.loop import OfflineTrainer


def train(cfg: SFTConfig) -> dict[str, Any]:
    """Fine-tune `cfg.model`; the summary has the held-out loss before and after, the run dir."""
    with OfflineTrainer(cfg) as trainer:
        train_ex = load_sft_examples(cfg.train_dataset, trainer.tokenizer, cfg.system_prompt)
        valid_ex = (load_sft_examples(cfg.valid_dataset, trainer.tokenizer, cfg.system_prompt)
                    if cfg.valid_dataset else [])
        return trainer.fit(train_ex, valid_ex, make_sft_loss_fn())
