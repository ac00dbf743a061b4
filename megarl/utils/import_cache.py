"""transformers imported without re-reading its model files in every process.

`import transformers` reads the ~2,400 files under `transformers/models` to build its lazy module's import
structure (`import_utils.define_import_structure`: each file's `__all__` and required backends; twice where
`transformers.models` is imported too) and maps every installed distribution to its top-level packages
(`importlib.metadata.packages_distributions()`): ~1.5 s of CPU in each process that imports it, on this 2-core
VM, whether it then uses one model or none: the driver of `megarl train`, its fork server, each conversion and
test process. Both results depend only on files: the first on the files under the directory, the second on
what is installed.

`install()` (called by `import megarl`) puts a finder on `sys.meta_path` that, on the first import of
`transformers.utils.import_utils`, runs that module with `packages_distributions` answered through the cache
and then replaces its `define_import_structure` with `cached_import_structure` (transformers' package
`__init__`s import the name from there afterwards). Each value is a pickle under
`$MEGARL_CACHE_DIR/imports` (default `$XDG_CACHE_HOME/megarl`, else `~/.cache/megarl`), one file per
directory or per `sys.path`, holding the key it was computed for: the name of every directory and the size
and mtime of every `.py` file under the directory; the mtime of every `sys.path` directory holding
distributions (an install or removal changes it). A different key, a missing or unreadable file computes the
value as transformers would and writes it (atomically; an unwritable cache is skipped). `MEGARL_IMPORT_CACHE=0`
turns the cache off; a process that imported transformers before megarl keeps the normal import.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from megarl.utils.first_import import FirstImportHook

TARGET = "transformers.utils.import_utils"


def cache_dir() -> Path:
    root = os.environ.get("MEGARL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megarl"
    )
    return Path(root) / "imports"


def cached(name: str, key: Any, compute: Callable[[], Any]) -> Any:
    """`compute()`, or what it returned for the same `key` before (kept in the cache file `name`)."""
    path = cache_dir() / f"{hashlib.sha256(name.encode()).hexdigest()[:32]}.pkl"
    with contextlib.suppress(Exception):  # missing, truncated, from another Python: computed again
        with open(path, "rb") as f:
            stored_key, value = pickle.load(f)
        if stored_key == key:
            return value
    value = compute()
    with contextlib.suppress(Exception):  # unwritable, full, unpicklable: a cache never fails the import
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump((key, value), f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return value


@functools.lru_cache(maxsize=None)
def tree_fingerprint(directory: str) -> str:
    """A digest of the name of every directory and the name, size and mtime of every `.py` file under `directory`
    (what `define_import_structure` reads; `__pycache__` is skipped), once per process."""
    digest = hashlib.sha256()
    pending = [directory]
    while pending:
        with os.scandir(pending.pop()) as scan:
            entries = sorted(scan, key=lambda e: e.name)
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if entry.name != "__pycache__":
                    digest.update(f"{entry.path}/\n".encode())
                    pending.append(entry.path)
            elif entry.name.endswith(".py"):
                stat = entry.stat()
                digest.update(f"{entry.path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def cached_import_structure(define_import_structure):
    """`define_import_structure(module_path, prefix=None)` answered from the cache, keyed on its directory's files."""

    @functools.wraps(define_import_structure)
    def define(module_path, prefix=None):
        directory = os.path.abspath(module_path if os.path.isdir(module_path) else os.path.dirname(module_path))
        try:
            fingerprint = tree_fingerprint(directory)
        except OSError:  # a directory changing under the walk: read it as transformers does
            return define_import_structure(module_path, prefix)
        return cached(
            f"import-structure:{directory}:{prefix}", fingerprint, lambda: define_import_structure(module_path, prefix)
        )

    define.megarl_cached = True
    return define


def cached_packages_distributions(packages_distributions):
    """`importlib.metadata.packages_distributions()` answered from the cache, keyed on `sys.path`'s distributions."""

    @functools.wraps(packages_distributions)
    def mapping():
        return cached(f"packages-distributions:{sys.path}", _installed_key(), packages_distributions)

    return mapping


def _installed_key() -> list[tuple[str, int]]:
    key = []
    for entry in sys.path:
        with contextlib.suppress(OSError):
            if any(name.endswith((".dist-info", ".egg-info")) for name in os.listdir(entry or ".")):
                key.append((entry, os.stat(entry or ".").st_mtime_ns))
    return key


@contextlib.contextmanager
def _distributions_cached():
    real = importlib.metadata.packages_distributions
    importlib.metadata.packages_distributions = cached_packages_distributions(real)
    try:
        yield
    finally:
        importlib.metadata.packages_distributions = real


def _cached_import(execute, module) -> None:
    """`transformers.utils.import_utils` run with the distributions cached, then its import structures cached."""
    with _distributions_cached():
        execute(module)
    if callable(getattr(module, "define_import_structure", None)):
        module.define_import_structure = cached_import_structure(module.define_import_structure)


_hook = FirstImportHook(TARGET, _cached_import)


def install() -> None:
    """Cache transformers' import-time scans in this process (idempotent; nothing if transformers is already
    imported or `MEGARL_IMPORT_CACHE=0`)."""
    if os.environ.get("MEGARL_IMPORT_CACHE", "1") != "0":
        _hook.install()
