"""Defaults in code ← YAML files ← command-line dotted overrides → a typed `RunConfig`, and back to YAML.

Owns: `load_config(files, overrides)`, `build(cls, values)` (a nested dict → dataclasses, checking
every key and type), `to_dict`, `save_resolved(cfg, run_dir)` and `field_docs`.

* A YAML file holds a nested mapping of overrides; `defaults: other.yaml` (or a list) names files
  it extends, resolved relative to it; later files and keys win. Mappings merge key by key; lists
  and scalars replace.
* An override is `dotted.key=value` (`actor.optim.lr=1e-6`, `data.files=[a.parquet,b.parquet]`);
  the value is read as YAML.
* An unknown key fails with the closest valid name ("did you mean ..."); a value of the wrong type
  fails naming the field and the expected type; a dataclass's own check (`__post_init__`) fails
  with the field's dotted path in front.

Imports PyYAML and the standard library (plus the schema's imports); no megatron, vLLM or Ray.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import os
import re
import types
import typing
from collections import abc
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, Union

import yaml

from megarl.config.schema import RunConfig


class ConfigError(ValueError):
    """A configuration value, key, file or combination is wrong; the message names the field and the fix."""


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^[-+]?(inf|nan)$", re.IGNORECASE)


# ----------------------------------------------------------------------------- reading YAML and overrides


def read_yaml_chain(path: str | os.PathLike, _seen: tuple[Path, ...] = ()) -> dict:
    """The overrides of `path` merged over those of the files its `defaults:` names (recursively)."""
    path = Path(path).resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ConfigError(f"config files include each other in a cycle: {chain}")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config sections, got {type(data).__name__}")
    parents = data.pop("defaults", None) or []
    merged: dict = {}
    for parent in [parents] if isinstance(parents, str) else parents:
        merged = merge(merged, read_yaml_chain(path.parent / parent, (*_seen, path)))
    return merge(merged, data)


def merge(base: Mapping, update: Mapping) -> dict:
    """A copy of `base` with `update` merged in: mappings key by key, everything else replaced."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override(text: str) -> dict:
    """`a.b.c=value` → {"a": {"b": {"c": value}}}, the value read as YAML (`null`, `[1, 2]`, `1e-6`)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} must look like section.field=value (e.g. actor.optim.lr=1e-6)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({err})") from None
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


# ----------------------------------------------------------------------------- dict → dataclasses


def build(cls: type, values: Mapping | None = None, path: str = "") -> Any:
    """An instance of dataclass `cls`: its defaults with `values` (a nested mapping) applied."""
    values = {} if values is None else values
    if not isinstance(values, Mapping):
        raise ConfigError(f"{path or 'config'} must be a mapping of fields, got {_show(values)}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(_unknown_key(cls, path, str(key), names))
        kwargs[key] = _coerce(value, hints[key], _join(path, key))
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{path or cls.__name__}: {err}") from None


def _unknown_key(cls: type, path: str, key: str, names: list[str]) -> str:
    where = f"{path}." if path else ""
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    hint = f"did you mean {where}{close[0]}?" if close else f"valid keys of {path or 'the config'}: {', '.join(names)}"
    return f"unknown config key {where}{key} ({cls.__name__} has no field {key!r}); {hint}"


def _coerce(value: Any, hint: Any, path: str) -> Any:
    """`value` checked (and, for numbers written as strings or ints for floats, converted) to `hint`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _coerce(value, options[0], path)
        return _first_fit(value, options, path)
    if dataclasses.is_dataclass(hint):
        if dataclasses.is_dataclass(value) and isinstance(value, hint):
            return value
        return build(hint, value, path)
    if origin in (list, tuple, abc.Sequence):
        return _coerce_list(value, hint, origin, args, path)
    if origin in (dict, abc.Mapping):
        return _coerce_dict(value, args, path)
    return _coerce_scalar(value, hint, path)


def _first_fit(value: Any, options: list, path: str) -> Any:
    for option in options:
        try:
            return _coerce(value, option, path)
        except ConfigError:
            continue
    raise ConfigError(f"{path}: expected {' or '.join(_type_name(o) for o in options)}, got {_show(value)}")


def _coerce_list(value, hint, origin, args, path):
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path}: expected a list ({_type_name(hint)}), got {_show(value)}")
    item = args[0] if args else Any
    items = [_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


def _coerce_dict(value, args, path):
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {_show(value)}")
    key_t, val_t = args if args else (Any, Any)
    return {_coerce(k, key_t, f"{path} key"): _coerce(v, val_t, f"{path}.{k}") for k, v in value.items()}


def _coerce_scalar(value: Any, hint: Any, path: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT.match(value.strip()):  # YAML 1.1 reads 1e-6 as a string
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif isinstance(hint, type) and isinstance(value, hint):
        return value
    raise ConfigError(f"{path}: expected {_type_name(hint)}, got {_show(value)}")


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


_HINTS: dict[type, dict] = {}


def _hints(cls: type) -> dict:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


# ----------------------------------------------------------------------------- public entry points


def load_config(files: str | os.PathLike | Iterable[str | os.PathLike] = (), overrides: Sequence[str] = (),
                cls: type = RunConfig) -> RunConfig:
    """Defaults of `cls` ← each YAML file in order (with its `defaults:` chain) ← each dotted override."""
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    values: dict = {}
    for file in files:
        values = merge(values, read_yaml_chain(file))
    for text in overrides:
        values = merge(values, parse_override(text))
    return build(cls, values)


def to_dict(cfg: Any) -> dict:
    """The config as plain nested dicts/lists/scalars (what `save_resolved` writes, `build` reads back)."""
    return _plain(dataclasses.asdict(cfg))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def dump_yaml(cfg: Any, comments: bool = False) -> str:
    """The resolved config as YAML text, sections in schema order; `comments` puts each field's
    docstring above it (what `megarl config --explain` prints and `save_resolved` writes)."""
    if not comments:
        return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False, width=120)
    return "\n".join(_commented(cfg, 0)) + "\n"


def _commented(obj: Any, depth: int) -> list[str]:
    docs, pad, lines = field_docs(type(obj)), "  " * depth, []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if docs.get(f.name):
            lines.append(f"{pad}# {' '.join(docs[f.name].split())}")
        if dataclasses.is_dataclass(value):
            lines += [f"{pad}{f.name}:", *_commented(value, depth + 1)]
        else:
            flow = yaml.safe_dump(_plain(value), default_flow_style=True, width=10_000).strip()
            lines.append(f"{pad}{f.name}: {flow.removesuffix('...').strip()}")
    return lines


def save_resolved(cfg: Any, run_dir: str | os.PathLike, name: str = "config.yaml") -> Path:
    """Write the resolved config to run_dir/config.yaml (atomically: a crash never leaves half a file)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / name
    tmp = run_dir / f".{name}.tmp.{os.getpid()}"
    tmp.write_text("# megarl resolved config: every field, defaults included. Rerun with\n"
                   f"#   megarl train --config {target}\n\n" + dump_yaml(cfg, comments=True))
    os.replace(tmp, target)
    return target


def field_docs(cls: type) -> dict[str, str]:
    """{field: one-line docstring} of a dataclass (and its bases), read from the string under each field."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _is_doc(after):
                docs[node.target.id] = after.value.value.strip()
    return docs


def _is_doc(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
