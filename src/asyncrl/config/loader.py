"""Load an experiment config (`ExperimentConfig`, or another trainer's schema such as
`SFTConfig`) from YAML plus dotted `key=value` overrides.

Unknown keys and bad values are errors that name the key and suggest the nearest valid
one; `${...}` interpolations are resolved; `__post_init__` checks run on every component.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, ValidationError

from asyncrl.config.schema import ExperimentConfig

Config = TypeVar("Config")


class ConfigError(ValueError):
    """A config that cannot be used, with what to change."""


def _valid_keys(node: Any) -> list[str]:
    if dataclasses.is_dataclass(node):
        return [f.name for f in dataclasses.fields(node)]
    if isinstance(node, DictConfig):
        return [str(k) for k in node.keys()]
    return []


def _unknown_key_error(err: ConfigKeyError, source: str) -> ConfigError:
    full_key = err.full_key or str(err.key)
    parent = full_key.rsplit(".", 1)[0] if "." in full_key else ""
    candidates = _valid_keys(err.parent_node) or _valid_keys(err.object_type)
    close = difflib.get_close_matches(str(err.key), candidates, n=1, cutoff=0.5)
    hint = f"did you mean '{(parent + '.') if parent else ''}{close[0]}'?" if close else (
        f"valid keys{' under ' + parent if parent else ''}: {', '.join(sorted(candidates))}")
    return ConfigError(f"unknown config key '{full_key}' (from {source}); {hint}")


def _merge(base: DictConfig, other: DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)
    except ConfigKeyError as err:
        raise _unknown_key_error(err, source) from None
    except ValidationError as err:
        raise ConfigError(f"bad value for config key '{err.full_key}' (from {source}): "
                          f"{str(err).splitlines()[0]}") from None


def parse_overrides(overrides: list[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form key=value "
                              "(e.g. actor.optimizer.lr=1e-6)")
    return OmegaConf.from_dotlist(list(overrides))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *,
                schema: type[Config] = ExperimentConfig) -> Config:
    """`schema`'s defaults <- YAML file <- overrides, resolved and validated."""
    cfg = OmegaConf.structured(schema)
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        cfg = _merge(cfg, OmegaConf.load(path), str(path))
    if overrides:
        cfg = _merge(cfg, parse_overrides(overrides), "command-line overrides")
    try:
        return OmegaConf.to_object(cfg)
    except InterpolationResolutionError as err:
        raise ConfigError(f"config interpolation failed at '{getattr(err, 'full_key', '?')}': "
                          f"{str(err).splitlines()[0]}") from None
    except ValidationError as err:
        raise ConfigError(f"bad value for config key '{err.full_key}': {str(err).splitlines()[0]}") from None
    except ValueError as err:
        raise ConfigError(str(err)) from None


def to_yaml(cfg: Any) -> str:
    """The fully resolved config, as YAML (written into each run directory)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
