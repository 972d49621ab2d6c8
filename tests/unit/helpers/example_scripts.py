"""The example scripts under examples/ as modules, and a model folder's tensors."""

import importlib.util
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import load_file

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def load_example(path: str) -> ModuleType:
    """examples/<path> (a .py script) imported as a module named after its file."""
    script = EXAMPLES / path
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def folder_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in `folder`, by name."""
    return {k: v for f in Path(folder).glob("*.safetensors") for k, v in load_file(f).items()}
