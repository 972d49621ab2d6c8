"""Saving the trained model: HF folders (for inference servers) and resumable train state.

HF folders hold full, unsharded weights under HF parameter names; the train state is a
`torch.distributed.checkpoint` folder (sharded, reloadable at another world size) plus one
small file per rank for the scheduler, step count and RNG.
"""

from __future__ import annotations

import copy
import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from asyncrl.models import safetensors_file

WEIGHTS_FILE = "model.safetensors"  # the name transformers and vLLM look for


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """Names of parameters that are another parameter under a second name (tied embeddings).

    transformers re-ties them when loading, and safetensors refuses shared tensors, so
    they are left out of saved weights.
    """
    first: dict[int, str] = {}
    aliases = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases.add(name)
        else:
            first[id(p)] = name
    return aliases


def full_state_dict(model: torch.nn.Module, *, prefix: str, drop: set[str],
                    dtype: torch.dtype | None,
                    ready: Mapping[int, torch.Tensor] | None = None,
                    trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Unsharded CPU copies of `model`'s weights, keys without `prefix` (a collective).
    `ready`: tensors already in `dtype` by the data pointer of the weight they stand for
    (the trainer's bf16 compute copies on one rank); those are returned themselves, not
    copied, and the model (then a plain module) is read by its own `state_dict()`, not
    through torch.distributed.checkpoint's (~12 ms of name resolution per call).
    `trainable_only`: the parameters that take gradients alone (LoRA's adapters); the
    frozen ones are not gathered."""
    if ready is not None:
        state = model.state_dict()
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True,
                                   ignore_frozen_params=trainable_only)
        state = get_model_state_dict(model, options=options)  # empty off rank 0
    frozen = ({name for name, p in model.named_parameters() if not p.requires_grad}
              if trainable_only else set())
    out = {}
    for key in list(state):
        value = state.pop(key)  # frees each gathered tensor once it is copied
        if not key.startswith(prefix):
            raise ValueError(f"state-dict key {key!r} does not start with {prefix!r}")
        name = key[len(prefix):]
        if name in drop or key in frozen:
            continue
        given = ready.get(value.data_ptr()) if ready else None
        if given is not None and given.dtype == dtype and given.shape == value.shape:
            out[name] = given
            continue
        # A copy: on one CPU rank the gathered tensor can be the live parameter itself.
        out[name] = value.to(dtype=dtype, copy=True).contiguous()
    return out


def write_hf_folder(path: str | os.PathLike, weights: dict[str, torch.Tensor], config: Any,
                    tokenizer: Any, generation_config: Any | None = None,
                    processor: Any | None = None) -> None:
    """Write safetensors weights, config (its dtype set to the weights') and tokenizer (and
    a vision-language model's processor, without which the folder reads text only).
    A weights file of the same layout already there is overwritten in place."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    safetensors_file.write(out / WEIGHTS_FILE, weights, metadata={"format": "pt"})
    config = copy.deepcopy(config)
    dtypes = {t.dtype for t in weights.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        config.dtype = dtypes.pop()  # vLLM's dtype="auto" reads this
    config.save_pretrained(out)
    if generation_config is not None:
        generation_config.save_pretrained(out)
    _save_tokenizer(tokenizer, out)
    if processor is not None:
        _save_tokenizer(processor, out)  # its processor_config.json, skipped the same way


# id of a tokenizer -> (the tokenizer, {file name: sha256 of what its save wrote})
_TOKENIZER_FILES: dict[int, tuple[Any, dict[str, str]]] = {}


def _save_tokenizer(tokenizer: Any, out: Path) -> None:
    """`tokenizer.save_pretrained(out)`, skipped where `out` already holds exactly the files
    its last save wrote: publishing writes each version over a pruned one's folder, and
    serialising the tokenizer was ~30 ms of every publish."""
    known = _TOKENIZER_FILES.get(id(tokenizer))
    if known is not None and known[0] is tokenizer and known[1] and all(
            _digest(out / name) == digest for name, digest in known[1].items()):
        return
    written = tokenizer.save_pretrained(out)
    _TOKENIZER_FILES[id(tokenizer)] = (tokenizer, {
        Path(f).name: _digest(Path(f)) for f in written if Path(f).parent == out})


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _extra_file(path: Path, rank: int) -> Path:
    return path / f"extra_rank{rank}.pt"


def save_train_state(path: str | os.PathLike, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer, extra: dict[str, Any], *,
                     trainable_only: bool = False) -> None:
    """Model and optimiser as a sharded DCP checkpoint; `extra` (scheduler, RNG...) per rank.
    `trainable_only`: the model's trainable parameters alone (LoRA: the adapters)."""
    out = Path(path)
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out))
    torch.save(extra, _extra_file(out, dist.get_rank()))
    dist.barrier()


def load_train_state(path: str | os.PathLike, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer, *,
                     trainable_only: bool = False) -> dict[str, Any]:
    """Load what `save_train_state` wrote into `model` and `optimizer`; returns this rank's extra.

    A rank that did not exist when saving (a larger world) gets rank 0's extra.
    """
    src = Path(path)
    if not (src / ".metadata").exists():
        raise FileNotFoundError(f"{src} is not a train-state checkpoint (no .metadata file)")
    # A frozen parameter is left out of both sides (strict would ask for it).
    options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(src))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=options)
    extra_file = _extra_file(src, dist.get_rank())
    if not extra_file.exists():
        extra_file = _extra_file(src, 0)
    return torch.load(extra_file, weights_only=True)
