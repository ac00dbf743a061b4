"""Reuse what a prepare script built (a tiny model after its warm-up, generated data) while its inputs stay the same.

Owns: `PreparedCache`. The quickstarts' prepare scripts (`scripts/prepare_*quickstart.py`) spend most of
a minute (the tool quickstart: minutes) of CPU on a warm-up whose result their inputs fix; a second
quickstart (PPO after GRPO, another config) reuses it:

    cache = PreparedCache(Path(args.model) / MARKER, script=__file__, args=args, inputs=[REPO / "megarl"])
    if (results := cache.reuse(args.force)) is not None:
        return results
    ...build...
    cache.save(results, summary, outputs=[model_dir, train_file, test_file])

The key is the script's arguments (`force` left out; `paths`, the ones naming files or directories,
made absolute: the same relative path from another directory is another place), the bytes of the
script and of every file under `inputs`, and the versions of Python and of the libraries a build runs
on (`LIBRARIES`). The marker, written last and atomically, holds the key, the sha256 of every output
file and what the script reported. It is stale when the key differs or any recorded file changed or
went; a build that stops midway leaves no marker (the script deletes the old outputs first).
Only the standard library is imported.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Iterable, Optional

from megarl.utils.atomic import write_file

MARKER = ".megarl-prepared.json"
"""The marker's file name (inside the prepared model's directory)."""
LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "pyarrow")
"""Libraries whose version is part of the key (their kernels and file formats shape the outputs)."""


class PreparedCache:
    """The marker of one prepare script's outputs: whether they are current (`load`), and recording them (`save`)."""

    def __init__(
        self,
        marker: Path,
        *,
        script: str | Path,
        args: argparse.Namespace,
        paths: Iterable[str] = ("model", "data"),
        inputs: Iterable[Path] = (),
    ):
        self.marker = Path(marker)
        paths = set(paths)
        self.key = {
            "script": Path(script).name,
            "args": {
                k: str(Path(v).resolve()) if k in paths else _plain(v)
                for k, v in sorted(vars(args).items())
                if k != "force"
            },
            "code": _digest([Path(script), *inputs]),
            "versions": {"python": platform.python_version(), **{lib: _version(lib) for lib in LIBRARIES}},
        }

    def load(self) -> Optional[dict]:
        """The recorded {"results", "summary", "files"} when the outputs are current, else None."""
        try:
            record = json.loads(self.marker.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("key") != self.key:
            return None
        files = record.get("files")
        if not isinstance(files, dict) or not files:
            return None
        for path, digest in files.items():
            if not Path(path).is_file() or _file_digest(Path(path)) != digest:
                return None
        return record

    def reuse(self, force: bool = False) -> Optional[dict]:
        """The results recorded with current outputs, after printing their summary; None (build) if stale or `force`."""
        record = None if force else self.load()
        if record is None:
            return None
        print(
            f"[prepare] {record['summary']}; reused: built earlier from the same arguments and code (--force rebuilds)"
        )
        return record["results"]

    def save(self, results: dict, summary: str, outputs: Iterable[Path]) -> None:
        """Record the outputs (files, or directories: every file under them but the marker) as current."""
        files = {}
        for output in outputs:
            output = Path(output).resolve()
            files.update({str(p): _file_digest(p) for p in _files(output) if p.name != MARKER})
        record = {"key": self.key, "files": files, "results": results, "summary": summary}
        write_file(self.marker, lambda tmp: tmp.write_text(json.dumps(record, indent=1, default=str)))


def _plain(value):
    return value if isinstance(value, (int, float, bool, str, type(None))) else str(value)


def _version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _digest(paths: Iterable[Path]) -> str:
    """sha256 over the relative names and bytes of the files (directories: every file under them, caches skipped)."""
    sha = hashlib.sha256()
    for root in paths:
        root = Path(root)
        for path in _files(root):
            if "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            sha.update(str(path.relative_to(root.parent)).encode() + b"\0")
            sha.update(path.read_bytes())
    return sha.hexdigest()


def _files(root: Path) -> list[Path]:
    """`root` itself, or every file under it (sorted) when it is a directory."""
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]


def _file_digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()
