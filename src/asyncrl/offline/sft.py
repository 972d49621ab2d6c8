"""Supervised fine-tuning on prompt/answer, chat or GSM8K-solution JSONL (loss on answers only).

Rows with "images" train a vision-language model: its folder's processor (the one its
prompts are served with) makes their image tokens and pixels.
"""

from __future__ import annotations

from typing import Any

from asyncrl.algorithms import make_sft_loss_fn
from asyncrl.config.offline import SFTConfig
from asyncrl.data.offline import load_sft_examples
from asyncrl.models.hub import resolve_model_path
from asyncrl.offline.loop import OfflineTrainer
from asyncrl.openai.images import load_image_prompts


def train(cfg: SFTConfig) -> dict[str, Any]:
    """Fine-tune `cfg.model`; the summary has the held-out loss before and after, the run dir."""
    with OfflineTrainer(cfg) as trainer:
        images = load_image_prompts(resolve_model_path(cfg.tokenizer_path))
        processor = None if images is None else images.processor

        def load(dataset):
            return load_sft_examples(dataset, trainer.tokenizer, cfg.system_prompt,
                                     processor=processor)

        train_ex = load(cfg.train_dataset)
        valid_ex = load(cfg.valid_dataset) if cfg.valid_dataset else []
        return trainer.fit(train_ex, valid_ex, make_sft_loss_fn())
