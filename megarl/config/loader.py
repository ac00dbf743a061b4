"""Defaults in code ← YAML files ← command-line dot-list overrides, on OmegaConf → a typed `RunConfig`, and back.

Owns: `load_config(files, overrides)`, `build(cls, values)` (a nested dict → dataclasses, checking
every key and type), `to_dict`, `dump_yaml`, `save_resolved(cfg, run_dir)` and `field_docs`. Reading
the files and overrides into one untyped tree is `megarl.utils.yaml_tree`'s (torch-free).

* The defaults are the dataclasses' own (`OmegaConf.structured(RunConfig)`), so `${...}` may refer to
  a value nobody wrote.
* A YAML file (read by OmegaConf) holds a nested mapping of overrides; `defaults: other.yaml` (or a
  list) names files it extends, resolved relative to it; later files and keys win. Mappings merge key
  by key; lists and scalars replace (`OmegaConf.merge` of untyped containers).
* An override is OmegaConf dot-list syntax, `dotted.key=value` (`actor.optim.lr=1e-6`,
  `data.files=[a.parquet,b.parquet]`, `rollout.max_model_len=null`, `ref.hf_path=${model.hf_path}`).
* `${...}` interpolations (and resolvers such as `${oc.env:VAR,default}`) are resolved once, over
  defaults + files + overrides; a bad one fails naming the field. A string an interpolation produced
  for a number / bool / list field is read as YAML (`${oc.env:STEPS,100}` for an int works).
* The resolved values of the keys the files and overrides set go through `build`, which keeps the
  project's messages: an unknown key names the closest valid one ("did you mean ..."), a value of the
  wrong type names the field and the expected type, a dataclass's own check (`__post_init__`) fails
  with the field's dotted path in front.

Imports OmegaConf, PyYAML and the standard library (plus the schema's imports); no megatron, vLLM or Ray.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import linecache
import os
import re
import types
import typing
from collections import abc
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, Union

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megarl.config.schema import RunConfig
from megarl.utils.atomic import write_file
from megarl.utils.yaml_tree import ConfigError, omegaconf_error, read_tree
from megarl.utils.yaml_tree import merge as merge  # the files' side, re-exported as `megarl.config`'s
from megarl.utils.yaml_tree import parse_override as parse_override
from megarl.utils.yaml_tree import read_yaml_chain as read_yaml_chain

_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^[-+]?(inf|nan)$", re.IGNORECASE)


# ----------------------------------------------------------------------------- interpolation


def _resolve(values: dict, cls: type) -> dict:
    """`values` with every `${...}` resolved over the defaults of `cls` merged with them; values without
    `${` are returned as they are. `???` (OmegaConf's "mandatory") still left in a field is an error."""
    missing = _mandatory(values)
    if missing:
        raise ConfigError(
            f"{missing} is ??? (mandatory): set it in a later config file or as an override {missing}=..."
        )
    if not _needs_resolving(values):
        return values
    try:
        return OmegaConf.to_container(OmegaConf.merge(_defaults(cls), values), resolve=True)
    except OmegaConfBaseException as err:
        known = [*_dotted(OmegaConf.to_container(_defaults(cls))), *_dotted(values)]
        raise omegaconf_error(err, values, known=known) from None


def _mandatory(tree: Mapping, prefix: str = "") -> str | None:
    """The dotted key of the first `???` value in `tree`, if any."""
    for key, value in tree.items():
        found = f"{prefix}{key}" if value == "???" else None
        if isinstance(value, Mapping):
            found = _mandatory(value, f"{prefix}{key}.")
        if found:
            return found
    return None


def _needs_resolving(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, dict):
        return any(_needs_resolving(v) for v in value.values())
    return isinstance(value, list) and any(_needs_resolving(v) for v in value)


def _defaults(cls: type) -> DictConfig:
    """Every default of dataclass `cls` (from `OmegaConf.structured`) as an untyped container, cached:
    merged over it, the files' values are checked by `build`, not by OmegaConf's type rules."""
    if cls not in _DEFAULTS:
        _DEFAULTS[cls] = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(cls)))
    return _DEFAULTS[cls]


_DEFAULTS: dict[type, DictConfig] = {}


def _dotted(tree: Mapping, prefix: str = "") -> Iterable[str]:
    for key, value in tree.items():
        yield f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _dotted(value, f"{prefix}{key}.")


class _Interpolated(str):
    """A string an interpolation produced (`${oc.env:VAR}`); `build` reads it as YAML for a non-str field."""


def _pick(raw: Any, resolved: Any) -> Any:
    """The resolved values of exactly the keys `raw` (files + overrides) sets: untouched fields keep
    the defaults their dataclasses compute, and unknown keys reach `build` (did you mean ...)."""
    if isinstance(raw, dict) and isinstance(resolved, dict):
        return {k: _pick(v, resolved[k]) for k, v in raw.items()}
    if isinstance(raw, list) and isinstance(resolved, list) and len(raw) == len(resolved):
        return [_pick(r, v) for r, v in zip(raw, resolved)]
    if isinstance(raw, str) and "${" in raw and isinstance(resolved, str):
        return _Interpolated(resolved)
    return resolved


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
    if isinstance(value, _Interpolated):
        return _coerce_interpolated(value, hint, path)
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


def _coerce_interpolated(value: _Interpolated, hint: Any, path: str) -> Any:
    """An interpolated string read as YAML when that fits the field (`"100"` for an int), else as text."""
    text = str(value)
    try:
        decoded = yaml.safe_load(text) if hint is not Any else text
    except yaml.YAMLError:
        decoded = text
    if not isinstance(decoded, str):
        try:
            return _coerce(decoded, hint, path)
        except ConfigError:
            pass
    return _coerce(text, hint, path)


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


def load_config(
    files: str | os.PathLike | Iterable[str | os.PathLike] = (), overrides: Sequence[str] = (), cls: type = RunConfig
) -> RunConfig:
    """Defaults of `cls` ← each YAML file in order (with its `defaults:` chain) ← each dot-list override,
    interpolations resolved over all of them, then checked and typed by `build`."""
    values = read_tree(files, overrides)
    return build(cls, _pick(values, _resolve(values, cls)))


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
        return yaml.safe_dump(_escape(to_dict(cfg)), sort_keys=False, default_flow_style=False, width=120)
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
            flow = yaml.safe_dump(_escape(_plain(value)), default_flow_style=True, width=10_000).strip()
            lines.append(f"{pad}{f.name}: {flow.removesuffix('...').strip()}")
    return lines


def _escape(value: Any) -> Any:
    """Plain values with a literal `${` written as `\\${`, so reading the YAML back does not interpolate it."""
    if isinstance(value, str):
        return value.replace("${", "\\${")
    if isinstance(value, dict):
        return {k: _escape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape(v) for v in value]
    return value


def save_resolved(cfg: Any, run_dir: str | os.PathLike, name: str = "config.yaml") -> Path:
    """Write the resolved config to run_dir/config.yaml (atomically: a crash never leaves half a file)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / name
    rerun = f"#   megarl train --config {target}\n\n"
    header = "# megarl resolved config: every field, defaults included. Rerun with\n" + rerun
    return write_file(target, lambda tmp: tmp.write_text(header + dump_yaml(cfg, comments=True)))


def field_docs(cls: type) -> dict[str, str]:
    """{field: one-line docstring} of a dataclass (and its bases), read from the string under each field."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            found = _class_field_docs(inspect.getsourcefile(klass) or "").get(klass.__qualname__)
            if found is None:  # a class defined inside a function: its own source
                found = _field_docs_in(ast.parse(inspect.getsource(klass)).body[0])
        except (OSError, TypeError, SyntaxError):
            continue
        docs.update(found)
    return docs


@functools.lru_cache(maxsize=None)
def _class_field_docs(filename: str) -> dict[str, dict[str, str]]:
    """{class qualname: its field docs} for every class of a source file, nested ones included: the file
    parsed once (`inspect.getsource` of a class parses its whole module each time: 0.3 s of `save_resolved`
    for the run config's ~30 dataclasses)."""
    found: dict[str, dict[str, str]] = {}

    def visit(body: list, prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                found[prefix + node.name] = _field_docs_in(node)
                visit(node.body, f"{prefix}{node.name}.")

    visit(ast.parse("".join(linecache.getlines(filename)) or Path(filename).read_text()).body, "")
    return found


def _field_docs_in(node: ast.ClassDef) -> dict[str, str]:
    body, docs = node.body, {}
    for field, after in zip(body, body[1:]):
        if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and _is_doc(after):
            docs[field.target.id] = after.value.value.strip()
    return docs


def _is_doc(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
