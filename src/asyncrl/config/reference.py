"""The config reference (docs/reference/config.md), generated from the config dataclasses.

Every key's type and default come from its dataclass field; its meaning is the comment
written next to the field (the comment lines right above it, then a comment at the end of
its line). A test compares the committed page with this module's output, so the page cannot
fall behind the code. Regenerate it with

    python -m asyncrl.config.reference > docs/reference/config.md

Fields without a comment get an empty meaning and are listed on stderr.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import tokenize
import typing
from dataclasses import MISSING, dataclass
from functools import cache
from typing import Any, Literal, Optional, Union

from asyncrl.config.offline import DPOConfig, OfflineConfig, RMConfig, SFTConfig
from asyncrl.config.schema import ExperimentConfig

REGENERATE = "python -m asyncrl.config.reference > docs/reference/config.md"


@dataclass(frozen=True)
class Key:
    """One row of the reference: a dotted key, its type, default and meaning."""

    name: str
    type: str
    default: str
    meaning: str
    section: bool = False  # a nested section (its keys follow), not a value
    owner: str = ""  # `Class.field` where the key is declared


@cache
def _comments(module_name: str) -> tuple[dict[int, str], list[str], ast.Module]:
    """The module's comments by line number, its source lines and its syntax tree."""
    source = inspect.getsource(sys.modules[module_name])
    comments = {tok.start[0]: tok.string
                for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    return comments, source.splitlines(), ast.parse(source)


def _comment_text(text: str) -> str:
    return text.lstrip("#").strip()


def _own_comment(cls: type, name: str) -> Optional[str]:
    """The comment of field `name` where `cls` declares it; None if `cls` does not."""
    comments, lines, tree = _comments(cls.__module__)
    node = next((n for n in ast.walk(tree)
                 if isinstance(n, ast.ClassDef) and n.name == cls.__name__), None)
    if node is None:
        return None
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and stmt.target.id == name):
            continue
        above, line = [], stmt.lineno - 1
        while line in comments and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, _comment_text(comments[line]))
            line -= 1
        beside = [_comment_text(comments[n]) for n in range(stmt.lineno, stmt.end_lineno + 1)
                  if n in comments and not lines[n - 1].lstrip().startswith("#")]
        return " ".join(above + beside)
    return None


def _declaring(cls: type, name: str) -> list[type]:
    """The classes of `cls`'s MRO that declare field `name`, most derived first."""
    return [k for k in cls.__mro__ if name in k.__dict__.get("__annotations__", {})]


def field_comment(cls: type, name: str) -> str:
    """The comment of field `name` of `cls`, from the most derived class that comments it."""
    for klass in _declaring(cls, name):
        text = _own_comment(klass, name)
        if text:
            return text
    return ""


def _docstring(cls: type) -> str:
    """The first paragraph of a class's own docstring, on one line ('' if none)."""
    doc = cls.__dict__.get("__doc__") or ""
    if not doc or doc.startswith(f"{cls.__name__}("):  # dataclass's generated signature
        return ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def _section_class(tp: Any) -> Optional[type]:
    """The dataclass of a (possibly optional) section annotation, else None."""
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0] if len(args) == 1 else tp
    return tp if dataclasses.is_dataclass(tp) else None


def format_type(tp: Any) -> str:
    """A type annotation as a reader writes YAML values: `int`, `"a", "b"`, `float or null`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        rest = [a for a in args if a is not type(None)]
        text = " or ".join(format_type(a) for a in rest)
        return f"{text} or null" if type(None) in args else text
    if origin is Literal:
        return ", ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(format_type(a) for a in args)}]"
    if tp is Any:
        return "any"
    if dataclasses.is_dataclass(tp):
        return "section"
    return getattr(tp, "__name__", str(tp))


def format_default(value: Any) -> str:
    """A default value as YAML writes it: null, true, "text", [], 1e-06."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, dict)):
        return repr(value).replace("'", '"') if value else ("[]" if isinstance(value, list)
                                                           else "{}")
    return repr(value)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise ValueError(f"config field {f.name!r} has no default; every config key needs one")


def config_keys(cls: type, prefix: str = "", instance: Any = None) -> list[Key]:
    """Every key of config class `cls`, depth first, with defaults read from `instance`
    (a default-built section, so that a parent's default_factory overrides are seen)."""
    hints = typing.get_type_hints(cls)
    keys: list[Key] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        name, tp = f"{prefix}{f.name}", hints[f.name]
        value = getattr(instance, f.name) if instance is not None else _default(f)
        meaning = field_comment(cls, f.name)
        owner = f"{_declaring(cls, f.name)[-1].__name__}.{f.name}"
        section = _section_class(tp)
        if section is None:
            keys.append(Key(name, format_type(tp), format_default(value), meaning, owner=owner))
            continue
        about = " ".join(_sentence(t) for t in (meaning, _docstring(section)) if t)
        optional = typing.get_origin(tp) is Union
        keys.append(Key(name, "section or null" if optional else "section",
                        "null" if value is None else "", about, section=True, owner=owner))
        keys.extend(config_keys(section, f"{name}.", value if value is not None else section()))
    return keys


def _sentence(text: str) -> str:
    return text if text.endswith((".", "!", "?", ")")) else f"{text}."


def _escape(text: str) -> str:
    """Table-cell text shown as written: `|`, `<` and `*` outside code spans are not markup
    (a table does not split cells at a pipe inside a code span)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")
    return "`".join(parts)


def _table(keys: list[Key]) -> list[str]:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key in keys:
        name = f"**`{key.name}`**" if key.section else f"`{key.name}`"
        default = f"`{key.default}`" if key.default else ""
        rows.append(f"| {name} | {_escape(key.type)} | {default} | {_escape(key.meaning)} |")
    return rows


def _by_section(keys: list[Key]) -> list[tuple[str, list[Key]]]:
    """Keys grouped by their top-level name: plain top-level keys first, then each section."""
    top = [k for k in keys if "." not in k.name and not k.section]
    groups: list[tuple[str, list[Key]]] = [("Top level", top)] if top else []
    for key in keys:
        if key.section and "." not in key.name:
            groups.append((key.name, [k for k in keys if k.name == key.name
                                      or k.name.startswith(f"{key.name}.")]))
    return groups


def _schema_pages(title: str, intro: str, keys: list[Key]) -> list[str]:
    lines = [f"## {title}", "", intro, ""]
    for heading, group in _by_section(keys):
        lines += [f"### {heading}", "", *_table(group), ""]
    return lines


def _differences(base: list[Key], derived: list[Key]) -> list[Key]:
    """Keys of `derived` that `base` lacks or has with another default."""
    known = {(k.name, k.default) for k in base}
    return [k for k in derived if (k.name, k.default) not in known]


RL_INTRO = ("`asyncrl train --config <file.yaml> key=value ...` and `asyncrl quickstart` read "
            "`ExperimentConfig` (`asyncrl.config.schema`). Keys are written `section.key` on "
            "the command line and nested in YAML; `${...}` refers to another key. A section of "
            "type `section or null` is off when null; `section: {}` turns it on with the "
            "defaults below.")
OFFLINE_INTRO = ("`asyncrl sft`, `asyncrl dpo` and `asyncrl rm` read `OfflineConfig` "
                 "(`asyncrl.config.offline`) plus the keys of their trainer below.")
TRAINERS = (("sft", SFTConfig), ("dpo", DPOConfig), ("rm", RMConfig))


def render() -> str:
    """The whole reference page, as Markdown."""
    rl = config_keys(ExperimentConfig)
    offline = config_keys(OfflineConfig)
    lines = ["# Config reference", "",
             "<!-- Generated from the config dataclasses; do not edit by hand. Regenerate:",
             REGENERATE, "-->", "",
             "Every key, its type, its default and what it does. Unknown keys are errors, and "
             "each value is checked when the config is loaded, with a message naming the key.",
             "", *_schema_pages("RL runs", RL_INTRO, rl),
             *_schema_pages("Offline trainers", OFFLINE_INTRO, offline)]
    for command, schema in TRAINERS:
        extra = _differences(offline, config_keys(schema))
        lines += [f"### `asyncrl {command}`", "", _docstring(schema), ""]
        lines += [*_table(extra), ""] if extra else ["No keys besides the shared ones.", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def undocumented() -> dict[str, list[str]]:
    """Fields without a comment, as `Class.field` -> the keys that show it."""
    missing: dict[str, list[str]] = {}
    for schema in (ExperimentConfig, *(s for _, s in TRAINERS)):
        for key in config_keys(schema):
            if not key.meaning and key.name not in missing.setdefault(key.owner, []):
                missing[key.owner].append(key.name)
    return missing


def main() -> None:
    sys.stdout.write(render())
    missing = undocumented()
    if missing:
        print(f"{len(missing)} config fields have no comment (an empty meaning):",
              file=sys.stderr)
        for owner, keys in missing.items():
            print(f"  {owner}: {', '.join(keys)}", file=sys.stderr)


if __name__ == "__main__":
    main()
