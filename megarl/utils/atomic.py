"""Files and directories that appear complete or not at all.

Owns: `write_file` (a file written beside its target and renamed onto it; `stale_writes`: what killed
writers left), `check_target` (refuse to overwrite a checkpoint unless asked) and `atomic_directory`,
which writes into a hidden sibling and renames it into place only after the writer finished and
wrote its completion marker. A crash leaves the old directory (if any) intact and a
`.<name>.incomplete-*` sibling that nothing mistakes for a checkpoint. `shared_staging_dir` and
`publish_collective` are the same protocol for a directory written by every rank of a world.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from megarl.utils.faults import hold


def write_file(target: str | Path, write: Callable[[Path], object], *, fault: Optional[str] = None) -> Path:
    """`write(tmp)` into a hidden sibling of `target`, then rename it onto `target`: a crash leaves the old
    file or the new one, never half of one. `fault`: a fault-soak point (`faults.hold`) between the two."""
    target = Path(target)
    tmp = _sibling(target, str(os.getpid()))
    try:
        write(tmp)
        if fault is not None:
            hold(fault)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a writer that raised leaves nothing behind (a killed one: its tmp)
        raise
    return target


def stale_writes(target: str | Path) -> list[Path]:
    """The hidden siblings `write_file` leaves for `target` when its process is killed before the rename."""
    target = Path(target)
    return sorted(target.parent.glob(_sibling(target, "*").name))


def _sibling(target: Path, writer: str) -> Path:
    """`write_file`'s hidden sibling of `target` for a writer (its pid; "*" matches every writer's)."""
    return target.with_name(f".{target.name}.tmp-{writer}")


class TargetExistsError(FileExistsError):
    """The output directory already holds something and overwriting was not asked for."""


def check_target(path: str | Path, overwrite: bool) -> Path:
    """Fail early (before any work) when `path` is a non-empty directory or a file and not `overwrite`."""
    path = Path(path)
    if path.is_file():
        raise TargetExistsError(f"{path} is a file; pass a directory path")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise TargetExistsError(f"{path} already exists and is not empty; pass --overwrite to replace it")
    return path


def staging_path(path: Path) -> Path:
    return path.parent / f".{path.name}.incomplete-{os.getpid()}-{int(time.time())}"


def commit_directory(staging: Path, target: Path, marker: str) -> None:
    """Move a finished staging directory onto `target` (replacing it), after checking its marker."""
    if not (staging / marker).is_file():
        raise RuntimeError(f"refusing to publish {staging}: completion marker {marker} was not written")
    backup = None
    if target.exists():
        backup = target.parent / f".{target.name}.replaced-{os.getpid()}-{int(time.time())}"
        target.rename(backup)
    staging.rename(target)
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(path: str | Path, marker: str, overwrite: bool = False) -> Iterator[Path]:
    """Yield a staging directory; on success publish it at `path`, on error delete it."""
    target = check_target(path, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(target)
    staging.mkdir()
    try:
        yield staging
        commit_directory(staging, target, marker)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def shared_staging_dir(target: Path) -> Path:
    """Collective: rank 0 creates the staging directory next to `target`; every rank learns its path."""
    import torch.distributed as dist

    box = [None]
    if dist.get_rank() == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        box[0] = str(staging_path(target))
        Path(box[0]).mkdir()
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def publish_collective(staging: Path, target: Path, marker: str, meta: dict) -> None:
    """Collective: once every rank has written, rank 0 writes the marker (`meta` as JSON) and publishes."""
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        hold(f"publish.{target.name}")  # fault soak: every rank has written, nothing is published yet
        (staging / marker).write_text(json.dumps(meta, indent=2))
        commit_directory(staging, target, marker)
    dist.barrier()
