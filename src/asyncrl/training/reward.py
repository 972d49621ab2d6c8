"""The reward model's engine: FSDPTrainEngine with a sequence score, pairs kept together.

Everything but the model is the policy engine's (FSDP2, micro-batches, optimiser and
schedule, save_hf); the model is `models.reward`'s one-label sequence classifier.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncrl.api.types import TensorBatch
from asyncrl.config.rm import RMModelConfig
from asyncrl.models.reward import last_token_scores, load_reward_model
from asyncrl.training.engine import FSDPTrainEngine, targets_loss
from asyncrl.training.microbatch import plan_micro_batches


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

    Batches hold pairs as consecutive rows (2i chosen, 2i + 1 rejected). Micro-batches and
    ranks get whole pairs, in order, so a pair loss sees both of its rows.
    """

    def __init__(self, cfg: RMModelConfig, *, total_steps: int, seed: int = 1) -> None:
        super().__init__(cfg, total_steps=total_steps, seed=seed)  # reads the shared keys

    def _train_forward(self, model: nn.Module, mb: TensorBatch,
                       n_tokens: int) -> tuple[torch.Tensor, dict[str, float]]:
        return model(mb.input_ids, mb.attention_mask, targets_loss(mb)), {}

    def _wrap(self, hf_model: nn.Module) -> nn.Module:
        return RewardModel(hf_model)

    def _load_hf_model(self, path: str) -> nn.Module:
        return load_reward_model(path, from_scratch=self.cfg.init_from_scratch)

    def _my_micro_batches(self, batch: TensorBatch) -> list[tuple[list[int], bool]]:
        """The base planner over pairs (a pair is as long as its longer row), rows in order."""
        lengths = batch.seq_lens.tolist()
        if len(lengths) % 2:
            raise ValueError(f"a reward-model batch holds (chosen, rejected) pairs; got "
                             f"{len(lengths)} rows")
        pair_lengths = [max(lengths[i], lengths[i + 1]) for i in range(0, len(lengths), 2)]
        # Two rows per pair: half the token budget per pair keeps micro-batches in budget.
        budget = max(1, self.cfg.mb_spec.max_tokens_per_mb // 2)
        plans = plan_micro_batches(pair_lengths, budget, self.world_size)
        mine = [sorted(mb) for mb in plans[self.rank]]
        mine = [[row for p in mb for row in (2 * p, 2 * p + 1)] for mb in mine]
        n = max(len(p) for p in plans)
        return [(mine[i], True) if i < len(mine) else (mine[0], False) for i in range(n)]

    def compute_rewards(self, batch: TensorBatch) -> torch.Tensor:
        """[B] rewards (fp32, CPU), one per row."""
        return self._forward_all(batch).sum(-1)

    def compute_logprobs(self, batch: TensorBatch) -> torch.Tensor:
        raise TypeError("a reward model has no log-probs; call compute_rewards")
