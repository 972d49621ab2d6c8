"""Fixtures shared by unit and integration tests."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    """GSM8K train/test JSONL beside the checkout (../shared/data/gsm8k), or $ASYNCRL_GSM8K_DIR."""
    path = Path(os.environ.get("ASYNCRL_GSM8K_DIR", REPO.parent / "shared" / "data" / "gsm8k"))
    if not (path / "test.jsonl").is_file():
        pytest.skip(f"GSM8K data not found at {path} (set ASYNCRL_GSM8K_DIR)")
    return path
