"""The reward model's engine: FSDPTrainEngine with a sequence score, pairs kept together.

Everything but the model is the policy engine's (FSDP2, micro-batches, optimiser and
schedule, save_hf); the model is `models.reward`'s one-label sequence classifier.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncrl.api.types import TensorBatch
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.models.reward import last_token_scores, load_reward_model
from asyncrl.trainer.engine import FSDPTrainEngine, targets_loss


class RewardModel(nn.Module):
    """FSDP root: each row's reward, placed at its last real token ([B, T], 0 elsewhere).

    The [B, T] shape is the engine's per-token contract; a row's reward is its sum.
    """

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                targets: torch.Tensor) -> torch.Tensor:
        scores = last_token_scores(self.hf, input_ids, attention_mask)
        last = attention_mask.long().sum(-1, keepdim=True) - 1
        out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        return out.scatter(1, last, scores[:, None])


class FSDPRewardEngine(FSDPTrainEngine):
    """A data-parallel FSDP2 reward model trained on (chosen, rejected) row pairs.

    Batches hold pairs as consecutive rows (2i chosen, 2i + 1 rejected); an even
    `mb_spec.granularity` (RMConfig sets 2) gives micro-batches and ranks whole pairs.
    `system_prompt` (the one the training rows were rendered with) is stored in the saved
    model's config, where RL scoring (`rewards/reward_model.py`) reads it back.
    """

    def __init__(self, spec: TrainEngineSpec, *, total_steps: int, seed: int = 1,
                 system_prompt: str | None = None) -> None:
        if spec.mb_spec.granularity % 2:
            # Rows sorted by length into micro-batches would pair a chosen row with the
            # wrong rejected one, silently.
            raise ValueError(f"mb_spec.granularity={spec.mb_spec.granularity}: a reward model "
                             "trains on (chosen, rejected) pairs; make it even (RMConfig sets 2)")
        super().__init__(spec, total_steps=total_steps, seed=seed)
        self.system_prompt = system_prompt

    def _train_forward(self, model: nn.Module, mb: TensorBatch,
                       n_tokens: int) -> tuple[torch.Tensor, dict[str, float]]:
        return model(mb.input_ids, mb.attention_mask, targets_loss(mb)), {}

    def _wrap(self, hf_model: nn.Module) -> nn.Module:
        return RewardModel(hf_model)

    def _load_hf_model(self, path: str) -> nn.Module:
        model = load_reward_model(path, from_scratch=self.spec.init_from_scratch)
        # Set even when None: a reward model retrained without one must not keep the old one.
        model.config.system_prompt = self.system_prompt
        return model

    def compute_logprobs(self, batch: TensorBatch) -> torch.Tensor:
        raise TypeError("a reward model has no log-probs; call compute_outputs (its scores, "
                        "at each row's last token)")
