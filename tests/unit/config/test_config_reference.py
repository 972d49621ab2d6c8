"""The generated config reference: in step with the dataclasses, and read from them right."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from asyncrl.config.reference import (
    REGENERATE,
    config_keys,
    field_comment,
    format_default,
    format_type,
    render,
)
from asyncrl.config.schema import ExperimentConfig, RolloutConfig


def _repo_root() -> Path:
    here = Path(__file__).resolve()
    return next(p for p in here.parents if (p / "pyproject.toml").is_file())


def _row(page: str, key: str) -> list[str]:
    """The cells of the first table row of `key` on the page."""
    line = next(line for line in page.splitlines()
                if line.startswith((f"| `{key}` |", f"| **`{key}`** |")))
    return [cell.strip() for cell in line.strip("|").split(" | ")]


def test_committed_reference_is_the_generated_one():
    committed = (_repo_root() / "docs" / "reference" / "config.md").read_text()
    assert committed == render(), (
        f"docs/reference/config.md is stale (a config field or its comment changed); "
        f"regenerate it: {REGENERATE}")


def test_known_keys_show_the_dataclass_type_and_default():
    page = render()
    # RolloutConfig.max_head_offpolicyness: int = 0, commented above with the admission rule.
    key, type_, default, meaning = _row(page, "rollout.max_head_offpolicyness")
    assert (key, type_, default) == ("`rollout.max_head_offpolicyness`", "int", "`0`")
    assert meaning.startswith("eta: an episode may start only while accepted + running &lt;")
    # ActorConfig.eps_clip: float = 0.2 with a trailing comment.
    assert _row(page, "actor.eps_clip") == [
        "`actor.eps_clip`", "float", "`0.2`",
        "PPO clip: ratio in [1 - eps_clip, 1 + eps_clip_higher]"]
    assert _row(page, "actor.optimizer.lr")[1:3] == ["float", "`1e-06`"]
    # The offline model's optimiser is built by a factory with lr=1e-5, not the class's 1e-6.
    assert _row(page, "model.optimizer.lr")[1:3] == ["float", "`1e-05`"]
    assert _row(page, "rollout.admission")[1:3] == ['"demand", "bound"', '`"demand"`']
    assert _row(page, "rollout.backend")[1:3] == ["str or null", "`null`"]  # or "vllm:d2t4"
    assert _row(page, "critic")[1:3] == ["section or null", "`null`"]


def test_every_rollout_field_has_one_row():
    keys = [k.name for k in config_keys(ExperimentConfig) if k.name.startswith("rollout.")]
    assert keys == [f"rollout.{f.name}" for f in dataclasses.fields(RolloutConfig)]


@dataclass(kw_only=True)
class _Commented:
    # Two lines above
    # the field.
    above: int = 3  # and one beside
    beside: str = "a # not a comment"  # only beside

    bare: Optional[Literal["x", "y"]] = None
    items: list[int] = field(default_factory=lambda: [1, 2])


def test_comments_above_and_beside_a_field_make_its_meaning():
    assert field_comment(_Commented, "above") == "Two lines above the field. and one beside"
    assert field_comment(_Commented, "beside") == "only beside"
    assert field_comment(_Commented, "bare") == ""
    keys = {k.name: k for k in config_keys(_Commented)}
    assert (keys["beside"].type, keys["beside"].default) == ("str", '"a # not a comment"')
    assert (keys["bare"].type, keys["bare"].default) == ('"x", "y" or null', "null")
    assert (keys["items"].type, keys["items"].default) == ("list[int]", "[1, 2]")


def test_defaults_are_written_as_yaml():
    assert [format_default(v) for v in (None, True, False, "", 1e-6, [], {})] == [
        "null", "true", "false", '""', "1e-06", "[]", "{}"]
    assert format_type(Optional[float]) == "float or null"
