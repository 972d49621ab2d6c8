"""LoRA adapter folders in PEFT's format, and merging them into base weights.

A folder holds `adapter_config.json` (PEFT's LoraConfig: r, lora_alpha, target_modules,
...) and `adapter_model.safetensors`, whose keys are PEFT's:
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r] for the
module whose base weight is `<module>.weight` [out, in]. PEFT, vLLM and SGLang load such
folders as they are.

Merging is W + scaling * B @ A, in fp32, with scaling = lora_alpha / r (lora_alpha /
sqrt(r) with use_rslora). Our inference engine merges each published version into the
base it keeps (vLLM and SGLang load the folder as an adapter instead); `asyncrl
export-merged` writes the merged model. Neither needs PEFT.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter folder that cannot be read or does not fit the base weights."""


def is_adapter_folder(path: str | Path) -> bool:
    """True where `path` holds a PEFT adapter (its config file)."""
    return (Path(path) / CONFIG_FILE).is_file()


def peft_name(module: str, part: str) -> str:
    """The PEFT file's key of `part` (lora_A or lora_B) of `module` (an HF module path)."""
    return f"{PEFT_PREFIX}{module}.{part}.weight"


@dataclass(frozen=True)
class Adapter:
    """The low-rank pairs of a LoRA adapter, by the HF name of the weight each one adapts."""

    scaling: float
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "<module>.weight" -> (A, B)

    @property
    def n_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.pairs.values())


def scaling_of(config: Mapping[str, Any]) -> float:
    """lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (PEFT's rule)."""
    r, alpha = config["r"], config["lora_alpha"]
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def read_adapter(path: str | Path) -> Adapter:
    """The adapter in the folder `path`; AdapterError naming what does not fit."""
    folder = Path(path)
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{folder}: no readable {CONFIG_FILE} ({e})") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{folder}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, ok in (("fan_in_fan_out", False), ("bias", "none")):
        if config.get(key, ok) != ok:
            raise AdapterError(f"{folder}: {key}={config[key]!r} is not supported "
                               f"(only {ok!r}); save the adapter with {key}={ok!r}")
    if config.get("use_dora"):
        raise AdapterError(f"{folder}: DoRA adapters (use_dora=true) are not supported")
    tensors = load_file(str(folder / WEIGHTS_FILE))
    return Adapter(scaling_of(config), _pairs(tensors, folder))


def _pairs(tensors: Mapping[str, torch.Tensor],
           folder: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) by the adapted weight's HF name, from PEFT's keys."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if name.endswith(suffix):
                parts.setdefault(name[: -len(suffix)], {})[part] = tensor
                break
        else:
            raise AdapterError(f"{folder}: tensor {key!r} is not a LoRA factor "
                               "(<module>.lora_A.weight or <module>.lora_B.weight)")
    pairs = {}
    for module, found in parts.items():
        if set(found) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{folder}: {module} has {sorted(found)} but needs both "
                               "lora_A and lora_B")
        a, b = found["lora_A"], found["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{folder}: {module}'s lora_A {tuple(a.shape)} and lora_B "
                               f"{tuple(b.shape)} are not [r, in] and [out, r]")
        pairs[f"{module}.weight"] = (a, b)
    return pairs


def merge_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 scaling: float) -> torch.Tensor:
    """W + scaling * B @ A in fp32."""
    return weight.float() + scaling * (b.float() @ a.float())


def merged(base: Iterable[tuple[str, torch.Tensor]], adapter: Adapter
           ) -> Iterator[tuple[str, torch.Tensor]]:
    """The base's (name, tensor) pairs with each adapted weight merged (fp32), the others
    as they are. AdapterError if the adapter names a weight the base lacks or of another
    shape."""
    left = set(adapter.pairs)
    for name, tensor in base:
        pair = adapter.pairs.get(name)
        if pair is None:
            yield name, tensor
            continue
        a, b = pair
        if tuple(tensor.shape) != (b.shape[0], a.shape[1]):
            raise AdapterError(f"the adapter of {name} is {b.shape[0]}x{a.shape[1]} but the "
                               f"base weight is {tuple(tensor.shape)}: another model's adapter")
        left.discard(name)
        yield name, merge_weight(tensor, a, b, adapter.scaling)
    if left:
        raise AdapterError(f"the adapter has weights for {sorted(left)[:3]} (of {len(left)}) "
                           "that the base model lacks: another model's adapter")


def export_merged(adapter_dir: str | Path, out_dir: str | Path,
                  base: str | None = None) -> dict[str, int]:
    """Write the base model with the adapter of `adapter_dir` merged as an HF folder at
    `out_dir`: every weight in its base dtype (merged ones computed in fp32 first), the
    base's config and the adapter folder's tokenizer. `base`: the base model (an HF
    folder or name), default the adapter config's base_model_name_or_path. Returns
    counts: weights, merged."""
    from safetensors.torch import save_file

    from asyncrl.models.hub import resolve_model_path

    adapter_dir, out = Path(adapter_dir), Path(out_dir)
    if not is_adapter_folder(adapter_dir):
        raise AdapterError(f"{adapter_dir} is not a LoRA adapter folder (no {CONFIG_FILE}); "
                           "give a folder that a LoRA run saved")
    if base is None:
        base = json.loads((adapter_dir / CONFIG_FILE).read_text()).get(
            "base_model_name_or_path")
        if not base:
            raise AdapterError(f"{adapter_dir / CONFIG_FILE} names no base_model_name_or_path;"
                               " give the base model with --base")
    base_dir = Path(resolve_model_path(base))
    files = sorted(base_dir.glob("*.safetensors"))
    if not files:
        raise AdapterError(f"the base model {base_dir} has no *.safetensors weights")
    if out.resolve() in (base_dir.resolve(), adapter_dir.resolve()):
        raise AdapterError(f"--out {out} is the base or the adapter folder; choose a new one")
    adapter = read_adapter(adapter_dir)
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    weights = {name: value.to(tensors[name].dtype).contiguous()
               for name, value in merged(tensors.items(), adapter)}
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        if (base_dir / name).is_file():
            (out / name).write_bytes((base_dir / name).read_bytes())
    for src in adapter_dir.iterdir():  # the tokenizer files the trainer saved beside it
        if src.is_file() and src.name not in (CONFIG_FILE, WEIGHTS_FILE):
            (out / src.name).write_bytes(src.read_bytes())
    return {"weights": len(weights), "merged": len(adapter.pairs)}
