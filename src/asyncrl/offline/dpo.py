"""DPO / IPO on (prompt, chosen, rejected) JSONL against a frozen reference model.

The reference log-probs are computed once, for the training and held-out sets, stored on
the rows, and the reference model is freed before the policy is loaded: training then
costs one model, like SFT.
"""

from __future__ import annotations

from typing import Any

from asyncrl.algorithms import make_dpo_loss_fn
from asyncrl.config.offline import DPOConfig
from asyncrl.data.offline import Example, collate, load_preference_examples
from asyncrl.offline.loop import OfflineTrainer, chunks
from asyncrl.trainer import FSDPTrainEngine
from asyncrl.trainer.frozen import frozen_engine

SHOWN = ("train/loss", "train/reward_margin", "train/reward_accuracy")


def train(cfg: DPOConfig) -> dict[str, Any]:
    """Run DPO; the summary has the held-out loss, reward margin and accuracy before/after."""
    with OfflineTrainer(cfg) as trainer:
        tok, system = trainer.tokenizer, cfg.system_prompt
        train_ex = load_preference_examples(cfg.train_dataset, tok, system)
        valid_ex = (load_preference_examples(cfg.valid_dataset, tok, system)
                    if cfg.valid_dataset else [])
        compute_reference_logprobs(make_reference_engine(cfg), train_ex + valid_ex,
                                   batch_size=cfg.train_dataset.batch_size,
                                   pad_token_id=trainer.pad_token_id)
        loss_fn = make_dpo_loss_fn(beta=cfg.beta, loss_type=cfg.loss_type,
                                   label_smoothing=cfg.label_smoothing)
        return trainer.fit(train_ex, valid_ex, loss_fn, show=SHOWN)


def make_reference_engine(cfg: DPOConfig) -> FSDPTrainEngine:
    """The frozen reference policy (not initialised): never stepped, so no optimiser state."""
    return frozen_engine(path=cfg.ref.path, dtype=cfg.ref.dtype, mb_spec=cfg.ref.mb_spec,
                         seed=cfg.seed, device=cfg.cluster.device,
                         init_from_scratch=cfg.model.init_from_scratch)


def compute_reference_logprobs(engine: FSDPTrainEngine, examples: list[Example], *, batch_size: int,
                               pad_token_id: int) -> None:
    """Set every row's `ref_logprobs` in one no-grad pass of `engine`, then free the engine."""
    engine.initialize()
    try:
        for chunk in chunks(examples, batch_size):
            rows = [r for ex in chunk for r in ex]
            logprobs = engine.compute_logprobs(collate(rows, pad_token_id))
            for i, row in enumerate(rows):
                row.ref_logprobs = logprobs[i, :len(row.input_ids)].clone()
    finally:
        engine.destroy()
