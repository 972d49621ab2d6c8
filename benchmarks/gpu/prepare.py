"""Prepare the assets `check.py` needs on a GPU machine that cannot download anything.

    python benchmarks/gpu/prepare.py              # writes .gpu/ at the repository root
    python benchmarks/gpu/prepare.py --out DIR

Run it on a machine that reaches PyPI, with asyncrl's own environment. It writes:

- `wheels/`: the pure-Python wheels asyncrl imports that a plain PyTorch + transformers
  machine lacks (`WHEELS` below), downloaded for CPython 3.12 without their dependencies;
  `check.py` installs them with `pip install --no-index --no-deps` when an import fails;
- `tokenizer/`: SmolLM2-135M-Instruct's tokenizer files, the tokenizer of every random model
  the check builds (the quickstart's converted HF folder; converted here if absent);
- `manifest.json`: each file with its size and sha256.

The folder is a few MiB; it travels with the working tree, so keep it out of git
(`.git/info/exclude`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What `import asyncrl...` needs on a machine with torch, transformers, tokenizers,
# safetensors, aiohttp, numpy, pyyaml, jinja2 and pytest: `asyncrl.config` imports omegaconf
# (2.4 vendors its antlr4 parser, so no antlr4 runtime for it); the trainers' rewards import
# math_verify, which needs latex2sympy2_extended and an antlr4 runtime it accepts;
# pytest-timeout reads pyproject's `timeout` option and the tests' timeout marks.
WHEELS = ["omegaconf==2.4.0", "math-verify==0.9.0", "latex2sympy2_extended==1.11.0",
          "antlr4-python3-runtime==4.13.2", "pytest-timeout==2.4.0"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja"]
# The platforms `pip download` may pick for: the GPU machine's (pure-Python wheels are "any").
PLATFORM = ["--python-version", "3.12", "--implementation", "cp",
            "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
            "--platform", "any"]


def download_wheels(folder: Path) -> list[Path]:
    """`WHEELS` into `folder`, binary only, each without its dependencies."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    *PLATFORM, "-d", str(folder), *WHEELS], check=True)
    return sorted(folder.glob("*.whl"))


def copy_tokenizer(folder: Path) -> list[Path]:
    """SmolLM2's tokenizer files from the quickstart's HF folder (converted if absent)."""
    from asyncrl.models.hub import resolve_model_path

    source = Path(resolve_model_path("smollm2-135m-instruct"))
    folder.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, folder / name)
            copied.append(folder / name)
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{source} has no tokenizer.json; delete it to convert again")
    # The published config, for the check to compare its hand-written shape against.
    shutil.copy2(source / "config.json", folder / "smollm2_config.json")
    copied.append(folder / "smollm2_config.json")
    return copied


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO / ".gpu")
    args = p.parse_args()
    files = download_wheels(args.out / "wheels") + copy_tokenizer(args.out / "tokenizer")
    manifest = {str(f.relative_to(args.out)): {"bytes": f.stat().st_size, "sha256": sha256(f)}
                for f in files}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(m["bytes"] for m in manifest.values())
    for name, m in manifest.items():
        print(f"{m['bytes'] / 2**20:8.2f} MiB  {name}")
    print(f"{total / 2**20:8.2f} MiB in {args.out}")


if __name__ == "__main__":
    main()
