"""Mixed into vLLM's worker (`--worker-extension-cls`): weight reload that keeps ties.

vLLM 0.32's in-place `reload_weights` rebuilds each layer's parameters, which unties
weights the model shares: with tie_word_embeddings, `lm_head` keeps the OLD embedding
while `embed_tokens` gets the new one (SmolLM2 and Qwen2.5-0.5B are tied). This reload
records which parameter names share one tensor, reloads, then ties them again to the
first name (the one the checkpoint holds; `lm_head.weight` is not saved when tied) and
redoes the tied layer's post-load processing.
"""

from __future__ import annotations

from typing import Any


class WeightSyncExtension:
    """Worker methods reachable through POST /collective_rpc."""

    def asyncrl_reload_weights(self, weights_path: str) -> int:
        """Reload from the HF folder `weights_path`; returns how many ties were restored."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        groups = _shared_parameter_names(model)
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        for names in groups:
            source = model.get_parameter(names[0])
            for name in names[1:]:
                owner, _, attr = name.rpartition(".")
                module = model.get_submodule(owner)
                setattr(module, attr, source)
                # Layers derive kernel state from their weights once loaded (on CPU a
                # packed GEMM copy of lm_head): derive it again from the re-tied weight.
                method = getattr(module, "quant_method", None)
                if method is not None:
                    method.process_weights_after_loading(module)
        return len(groups)


def _shared_parameter_names(model: Any) -> list[list[str]]:
    """Names that refer to one parameter, in registration order, for each shared parameter."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]
