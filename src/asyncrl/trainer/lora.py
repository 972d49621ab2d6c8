"""LoRA in the trainer: PEFT's adapters injected into the HF model, the base frozen.

`add_adapters` puts PEFT's `lora.Linear` around each targeted projection in place
(`peft.inject_adapter_in_model`): the model stays the HF class it was, so the engine's
forward, its CPU paths and FSDP2 see the same modules, now with `base_layer` and
`lora_A` / `lora_B` children. Only the adapters take gradients and reach the optimiser.

On a Mixture-of-Experts model (Qwen3-MoE in transformers 5) the experts are one module of
fused 3-D weights and the router a module of its own, neither an `nn.Linear`; PEFT's
"all-linear" there also adapts those parameters (its `target_parameters`). Here
"all-linear" is the decoder's linear layers alone, the attention projections, and naming
the router or the experts is refused: the servers merge or serve adapters on linear
layers, and an adapted router would route otherwise than the rollout that recorded the
routes it replays.

The KL reference under LoRA is the same model with the adapters switched off
(`adapters_off`), not a second copy. What the engine saves and publishes are the adapters
alone, in PEFT's folder format (`models/lora.py`): our engine merges it into its base,
vLLM and SGLang load it as an adapter.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asyncrl.config.engine import TrainEngineSpec, moe_adapter_error
from asyncrl.models import lora as lora_files
from asyncrl.models import safetensors_file

ADAPTER_NAME = "default"  # PEFT's name of the one adapter
_FACTOR = {f"lora_A.{ADAPTER_NAME}.weight": "lora_A", f"lora_B.{ADAPTER_NAME}.weight": "lora_B"}


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ImportError("actor.use_lora=true needs PEFT: pip install 'asyncrl[lora]' (or "
                          "set use_lora=false)") from None
    return peft


def add_adapters(hf_model: nn.Module, spec: TrainEngineSpec) -> Any:
    """Inject LoRA adapters into `hf_model` in place and freeze everything else; returns
    PEFT's LoraConfig with target_modules resolved to the names adapted."""
    peft = _peft()
    modules = list(spec.target_modules)
    target = "all-linear" if modules == ["all-linear"] else modules
    if target == "all-linear" and _is_moe(hf_model):
        target = linear_layer_names(hf_model)  # PEFT's all-linear, without its MoE weights
    moe_names = sorted(set(modules) & _moe_module_names(hf_model))
    if moe_names:
        _refuse_moe(modules, moe_names)
    config = peft.LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha,
                             target_modules=target, lora_dropout=0.0, bias="none")
    try:
        peft.inject_adapter_in_model(config, hf_model, adapter_name=ADAPTER_NAME)
    except ValueError as e:  # PEFT's "Target modules ... not found in the base model"
        raise ValueError(f"target_modules={modules}: {e}; name modules of this model "
                         "(e.g. q_proj, v_proj) or use [all-linear]") from None
    layers = adapter_layers(hf_model)
    moe_parts = sorted(name for name, m in layers.items() if type(m).__name__ == "ParamWrapper")
    if moe_parts:  # PEFT's target_parameters, which a module name may also bring in
        _refuse_moe(modules, moe_parts)
    wrong = sorted({type(m).__name__ for m in layers.values()} - {"Linear"})
    head = hf_model.get_output_embeddings()
    if wrong or any(m is head for m in layers.values()):
        # The log-prob head reads the output projection's weight itself, and the servers
        # merge linear layers only.
        raise ValueError(f"target_modules={modules} adapts {wrong or ['the output projection']}"
                         "; only the decoder's linear layers can take adapters here")
    for name, param in hf_model.named_parameters():
        param.requires_grad_(_factor(name) is not None)
    return config


def _is_moe(hf_model: nn.Module) -> bool:
    from asyncrl.trainer.experts import is_experts

    return any(is_experts(m) for m in hf_model.modules())


def _moe_module_names(hf_model: nn.Module) -> set[str]:
    """The last path parts of the MoE routers and experts modules ("gate", "experts")."""
    from asyncrl.trainer.experts import is_experts
    from asyncrl.trainer.moe import is_router

    return {name.rsplit(".", 1)[-1] for name, m in hf_model.named_modules()
            if name and (is_router(m) or is_experts(m))}


def _refuse_moe(modules: list[str], names: list[str]) -> None:
    raise moe_adapter_error(modules, names)


def linear_layer_names(hf_model: nn.Module) -> list[str]:
    """The names (last part of the path) of the decoder's `nn.Linear` layers, the output
    projection left out."""
    head = hf_model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, m in hf_model.named_modules()
                   if isinstance(m, nn.Linear) and m is not head})


def adapter_layers(model: nn.Module) -> dict[str, nn.Module]:
    """PEFT's adapter-bearing modules of `model`, by module path."""
    base = _peft().tuners.tuners_utils.BaseTunerLayer
    return {name: m for name, m in model.named_modules() if isinstance(m, base)}


def _factor(name: str) -> str | None:
    """'lora_A' / 'lora_B' if `name` is one of an adapter's two weights, else None."""
    for suffix, part in _FACTOR.items():
        if name.endswith("." + suffix):
            return part
    return None


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Inside the block the model computes as its base: every adapter layer skipped.

    PEFT's own `enable_adapters(False)` also flips the adapters' requires_grad, which the
    engine's compute copies and FSDP's parameter groups were built around; the flag that
    its layers' forward reads is set here instead.
    """
    layers = list(adapter_layers(model).values())
    previous = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, was in zip(layers, previous):
            layer._disable_adapters = was


def to_peft_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter weights of an HF-named state dict, under PEFT's file keys."""
    out = {}
    for name, tensor in state.items():
        part = _factor(name)
        if part is None:
            continue
        module = name[: -len(f".{part}.{ADAPTER_NAME}.weight")]
        out[lora_files.peft_name(module, part)] = tensor
    return out


def write_adapter_folder(path: str | Path, adapters: dict[str, torch.Tensor], config: Any,
                         base_path: str, tokenizer: Any) -> None:
    """PEFT's adapter folder: its config (with the base model's path), the weights under
    PEFT's keys, and the tokenizer. A weights file of the same layout is written over."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    safetensors_file.write(out / lora_files.WEIGHTS_FILE, adapters, metadata={"format": "pt"})
    config.base_model_name_or_path = base_path
    config.save_pretrained(str(out))  # adapter_config.json
    tokenizer.save_pretrained(out)

