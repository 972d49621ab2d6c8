"""Mixed into vLLM's worker (`--worker-extension-cls`): weight reload that keeps ties, and
the image layout of a vision-language model for the client (vllm_images.py).

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

    def asyncrl_image_layout(self) -> dict[str, Any]:
        """The served model's type and, for an Idefics3-like model, its image token id and
        image tokens per tile (the vision encoder's patches per tile, merged by the
        connector's scale factor in each direction); for Qwen2-VL's family its image token
        id and the merge size of patches in each direction."""
        config = self.model_runner.model_config.hf_config  # type: ignore[attr-defined]
        out: dict[str, Any] = {"model_type": config.model_type}
        vision = getattr(config, "vision_config", None)
        if hasattr(config, "image_token_id") and hasattr(config, "scale_factor") and vision:
            patches = (vision.image_size // vision.patch_size) ** 2
            out.update(image_token_id=config.image_token_id,
                       tokens_per_tile=patches // config.scale_factor ** 2)
        elif hasattr(config, "image_token_id") and hasattr(vision, "spatial_merge_size"):
            out.update(image_token_id=config.image_token_id,
                       merge_size=vision.spatial_merge_size)
        return out


def _shared_parameter_names(model: Any) -> list[list[str]]:
    """Names that refer to one parameter, in registration order, for each shared parameter."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]
