"""YAML config files and dot-list overrides → one untyped tree (OmegaConf), before any typing.

Owns: `ConfigError`, `read_tree(files, overrides)` (each file with its `defaults:` chain, then each
override, interpolations kept as written), `read_yaml_chain`, `merge`, `parse_override` and
`omegaconf_error` (OmegaConf's error as a ConfigError naming the field). `megarl.config.loader` types
the tree (`load_config`); `megarl.controller.fork_server` reads a few of its values before torch is
imported. Imports OmegaConf, PyYAML and the standard library only.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A configuration value, key, file or combination is wrong; the message names the field and the fix."""


def read_tree(files: str | os.PathLike | Iterable[str | os.PathLike] = (), overrides: Sequence[str] = ()) -> dict:
    """Each YAML file in order (with its `defaults:` chain), then each dot-list override, merged into one tree of
    plain dicts and lists; interpolations are kept as written."""
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    tree = OmegaConf.create()
    for file in files:
        _merge_into(tree, _read_chain(Path(file)))
    for text in overrides:
        _apply_override(tree, text)
    return OmegaConf.to_container(tree)


def read_yaml_chain(path: str | os.PathLike) -> dict:
    """The overrides of `path` merged over those of the files its `defaults:` names (recursively);
    interpolations are kept as written (`load_config` resolves them once everything is merged)."""
    return OmegaConf.to_container(_read_chain(Path(path)))


def merge(base: Mapping, update: Mapping) -> dict:
    """A copy of `base` with `update` merged in (`OmegaConf.merge`): mappings key by key, everything
    else replaced; interpolations stay unresolved."""
    tree = OmegaConf.create(dict(base))
    _merge_into(tree, update)
    return OmegaConf.to_container(tree)


def parse_override(text: str) -> dict:
    """`a.b.c=value` → {"a": {"b": {"c": value}}} (OmegaConf dot-list: the value read as YAML,
    `null`, `[1, 2]`, `1e-6`, `${other.key}`)."""
    tree = OmegaConf.create()
    _apply_override(tree, text)
    return OmegaConf.to_container(tree)


def _read_chain(path: Path, _seen: tuple[Path, ...] = ()) -> DictConfig:
    path = path.resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ConfigError(f"config files include each other in a cycle: {chain}")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    node = _load_yaml(path)
    merged = OmegaConf.create()
    for parent in _parents(node, path):
        _merge_into(merged, _read_chain(path.parent / parent, (*_seen, path)))
    _merge_into(merged, node)
    return merged


def _parents(node: DictConfig, path: Path) -> list[str]:
    """The files `defaults:` names (removed from `node`)."""
    parents = node.pop("defaults", None)
    parents = OmegaConf.to_container(parents) if isinstance(parents, ListConfig) else parents
    parents = [] if parents is None else [parents] if isinstance(parents, str) else parents
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"{path}: defaults must name a file or a list of files (relative to it), got {parents!r}")
    return parents


def _load_yaml(path: Path) -> DictConfig:
    try:
        node = OmegaConf.load(path)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    except OmegaConfBaseException as err:
        raise omegaconf_error(err, {}, f"{path}: ") from None
    except OSError as err:  # OmegaConf refuses a file holding a bare number
        raise ConfigError(f"{path} must hold a mapping of config sections ({err})") from None
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path} must hold a mapping of config sections, got {type(node).__name__}")
    return node


def _merge_into(tree: DictConfig, update: Any) -> None:
    try:
        tree.merge_with(update)
    except OmegaConfBaseException as err:
        raise omegaconf_error(err, update) from None


def _apply_override(tree: DictConfig, text: str) -> None:
    """Merge one dot-list override into `tree` (`OmegaConf.update` through `merge_with_dotlist`)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} must look like section.field=value (e.g. actor.optim.lr=1e-6)")
    try:
        tree.merge_with_dotlist([f"{key}={raw}"])
    except yaml.YAMLError as err:
        raise ConfigError(
            f"override {text!r}: the value is not valid YAML ({' '.join(str(err).split())}); "
            "quote an interpolation inside a list or mapping: ['${a.b}', c]"
        ) from None
    except OmegaConfBaseException as err:
        raise omegaconf_error(err, {}, f"override {text!r}: ") from None


def omegaconf_error(err: OmegaConfBaseException, tree: Any, where: str = "", known: Sequence[str] = ()) -> ConfigError:
    """OmegaConf's error as a ConfigError naming the field, the interpolation written there and, for a
    key that does not exist, the closest of the `known` dotted keys."""
    key, first = getattr(err, "full_key", None), str(err).splitlines()[0]
    missing = re.search(r"Interpolation key '([^']+)' not found", first)
    close = difflib.get_close_matches(missing.group(1), known, n=1, cutoff=0.6) if missing else []
    first += f"; did you mean ${{{close[0]}}}?" if close else ""
    raw = lookup(tree, key) if key else None
    if isinstance(raw, str) and "${" in raw:
        return ConfigError(f"{where}{key}: cannot resolve {raw!r}: {first}")
    return ConfigError(f"{where}{key}: {first}" if key else f"{where}{first}")


def lookup(tree: Any, key: str) -> Any:
    """The value at an OmegaConf full key (`a.b[0].c`) of nested dicts/lists; None if absent."""
    for part in re.findall(r"[^.\[\]]+", key):
        if isinstance(tree, Mapping) and part in tree:
            tree = tree[part]
        elif isinstance(tree, list) and part.isdigit() and int(part) < len(tree):
            tree = tree[int(part)]
        else:
            return None
    return tree
