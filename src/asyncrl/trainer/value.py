"""The critic's engine: FSDPTrainEngine with a scalar value head instead of log-probs.

Everything but the model is the policy engine's: micro-batching, FSDP2 sharding, the
optimiser and lr schedule, gradient clipping, save_state / load_state and save_hf. The
model is an HF `...ForTokenClassification` with one label (TRL's, verl's and AReaL's critic
class), so a saved critic is an ordinary HF folder.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncrl.api.types import TensorBatch
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.trainer.cpu.attention import use_trie_attention
from asyncrl.trainer.engine import FSDPTrainEngine, targets_loss
from asyncrl.trainer.prefix import PrefixPack


class ValueModel(nn.Module):
    """An HF token-classification model (one label) giving V of the state before token t.

    Alignment is that of `TokenLogprobModel`: the state before token t is tokens_<t, whose
    last hidden state is at position t - 1. So entry t of the output is the head applied
    to hidden state t - 1, where `targets` (bool [B, T]) is True; 0 elsewhere and at t = 0.
    A row's values then line up index for index with its log-probs and loss mask.
    Given a `PrefixPack`, the model runs on the rows' trie and each token reads the head's
    output at its node (the same numbers; shared nodes sum the rows' gradients).
    """

    packs_prefixes = True  # its forward takes `pack` (FSDPTrainEngine checks it)

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                targets: torch.Tensor, pack: PrefixPack | None = None) -> torch.Tensor:
        """[B, T] fp32 values where `targets` is True, 0 elsewhere (no gradient there)."""
        if pack is None:
            out = self.hf(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            scores = out.logits[..., 0].float()  # [B, T]: one label, cheap on every position
        else:
            use_trie_attention(self.hf)
            out = self.hf(**pack.model_inputs(), use_cache=False)
            scores = pack.unpack(pack.to_slots(out.logits[..., 0].float()))
        shifted = nn.functional.pad(scores[:, :-1], (1, 0))
        return shifted * targets


class FSDPValueEngine(FSDPTrainEngine):
    """A data-parallel FSDP2 critic; `compute_values` and `train_batch` give/take values."""

    def __init__(self, spec: TrainEngineSpec, *, total_steps: int, seed: int = 1) -> None:
        super().__init__(spec, total_steps=total_steps, seed=seed)

    def _train_forward(self, model: nn.Module, mb: TensorBatch,
                       n_tokens: int) -> tuple[torch.Tensor, dict[str, float]]:
        return self._root_forward(model, mb, targets_loss(mb)), {}

    def _wrap(self, hf_model: nn.Module) -> nn.Module:
        return ValueModel(hf_model)

    def _load_hf_model(self, path: str) -> nn.Module:
        """`path`'s decoder under a fresh one-label head (seeded by `initialize`), no dropout."""
        from transformers import AutoConfig, AutoModelForTokenClassification

        config = AutoConfig.from_pretrained(path, num_labels=1)
        # The head's dropout (0.1 when unset) would make values in training differ from
        # compute_values' (eval mode) ones. An attribute: from_pretrained drops unknown kwargs.
        config.classifier_dropout = 0.0
        if self.spec.init_from_scratch:
            model = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
        else:
            model = AutoModelForTokenClassification.from_pretrained(path, config=config,
                                                                    dtype=torch.float32)
        # An LM's config names its causal-LM class; the saved critic must name its own.
        model.config.architectures = [type(model).__name__]
        return model

    def compute_values(self, batch: TensorBatch) -> torch.Tensor:
        """Token-aligned values [B, T] (fp32, CPU); position 0 and padding hold 0."""
        return self._forward_all(batch)

    def compute_logprobs(self, batch: TensorBatch) -> torch.Tensor:
        raise TypeError("a critic has no log-probs; call compute_values")
