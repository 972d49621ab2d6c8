"""A process's spec as a JSON file: what the controller writes, what the process reads.

A spec is a frozen dataclass of exactly what one process reads (`TrainerSpec`,
`AgentServiceSpec`, `WeightUpdateSpec`); its fields may be config sections (dataclasses,
optional ones too), numbers, strings, booleans, lists and dicts. The file holds every field
and nothing else: a missing or unknown key, or a value of the wrong type, is a `ConfigError`
naming the file and the dotted key. A spec read back equals the one written.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

from asyncrl.config.loader import ConfigError

Spec = TypeVar("Spec")


def spec_to_dict(spec: Any) -> dict[str, Any]:
    """Every field of `spec`, nested sections as dicts."""
    if not dataclasses.is_dataclass(spec) or isinstance(spec, type):
        raise TypeError(f"a spec is a dataclass instance, got {type(spec).__name__}")
    return dataclasses.asdict(spec)


def spec_from_dict(cls: type[Spec], data: Any, *, source: str = "spec") -> Spec:
    """`cls` from `spec_to_dict`'s output; ConfigError naming `source` and the key."""
    return _dataclass(cls, data, "", source)


def write_spec(spec: Any, path: str | Path) -> Path:
    """Write `spec` to `path` as JSON (its folder is made if missing); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec_to_dict(spec), indent=1, sort_keys=True) + "\n")
    return path


def read_spec(cls: type[Spec], path: str | Path) -> Spec:
    """The `cls` spec written to `path` by `write_spec`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"spec file {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"spec file {str(path)!r} is not JSON: {err}") from None
    return spec_from_dict(cls, data, source=f"spec file {str(path)!r}")


def _dataclass(cls: type, data: Any, key: str, source: str) -> Any:
    where = f"'{key}'" if key else "the top level"
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {where} must be a mapping of {cls.__name__}'s keys, "
                          f"got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    prefix = f"{key}." if key else ""
    if unknown := sorted(set(data) - set(names)):
        raise ConfigError(f"{source}: unknown key '{prefix}{unknown[0]}' ({cls.__name__} has "
                          f"{', '.join(names)})")
    if missing := [name for name in names if name not in data]:
        raise ConfigError(f"{source}: missing key '{prefix}{missing[0]}' (a spec file holds "
                          f"every key of {cls.__name__}; write it with write_spec)")
    values = {name: _value(hints[name], data[name], prefix + name, source) for name in names}
    try:
        return cls(**values)
    except ValueError as err:  # the section's own checks (`__post_init__`)
        raise ConfigError(f"{source}: {err}") from None


def _value(hint: Any, value: Any, key: str, source: str) -> Any:
    """`value` as type `hint`; ConfigError naming `key` when it is not one."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _value(options[0], value, key, source)
        for option in options:
            try:
                return _value(option, value, key, source)
            except ConfigError:
                continue
        raise _bad(key, source, hint, value)
    if origin is Literal:
        if value in args and type(value) in {type(a) for a in args}:
            return value
        raise ConfigError(f"{source}: '{key}' must be one of {list(args)}, got {value!r}")
    if dataclasses.is_dataclass(hint):
        return _dataclass(hint, value, key, source)
    if origin is list:
        if not isinstance(value, list):
            raise _bad(key, source, hint, value)
        [item] = args or (Any,)
        return [_value(item, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _bad(key, source, hint, value)
        item = args[1] if args else Any
        return {k: _value(item, v, f"{key}.{k}", source) for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if isinstance(value, hint) and (hint is bool or not isinstance(value, bool)):
            return value
        raise _bad(key, source, hint, value)
    raise TypeError(f"{source}: '{key}' has type {hint}, which a spec file cannot hold")


def _bad(key: str, source: str, hint: Any, value: Any) -> ConfigError:
    name = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
    return ConfigError(f"{source}: '{key}' must be {name}, got {value!r}")
