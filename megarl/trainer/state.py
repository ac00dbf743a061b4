"""Checkpoints of a run: where they live, which is the latest intact one, the driver's own state.

Layout: `run_dir/checkpoints/step_000020/{actor,critic}/` (engine checkpoints, each atomic),
`manifest.json` (every file of the checkpoint with its size, and a CRC-32 of the small ones) and
`driver_state.pt` (step, dataloader position, KL coefficient, driver RNG), written *last* and
atomically (temp file + rename). A checkpoint counts only when `driver_state.pt` exists, so a run
killed while saving resumes from the previous complete one. Old checkpoints beyond
`keep_checkpoints` are renamed out of the way, then deleted, after a new one is complete.

Resume is never blocked by damaged state (`plan_resume`, `resume_from`): a checkpoint whose files
do not match its manifest, or whose driver state does not load, is reported (file named); with
trainer.resume=auto the previous intact one is used (the damaged one is set aside as
`step_N.damaged-<time>`), and a checkpoint the workers fail to load falls back the same way; an
explicit trainer.resume=PATH that fails names the file and the checkpoint to use instead.
Pure Python + torch.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from megarl.utils.atomic import stale_writes, write_file
from megarl.utils.faults import hold

DRIVER_STATE = "driver_state.pt"
MANIFEST = "manifest.json"
CHECKSUM_MAX_BYTES = 1 << 20
"""Files up to this size get a CRC-32 in the manifest (metadata, small shards); larger ones only a size."""
_STEP_DIR = re.compile(r"^step_(\d+)$")


class ResumeError(ValueError):
    """trainer.resume cannot be honoured: names the damaged file and what to resume from instead."""


@dataclass
class DriverState:
    """What the driver needs, beside the engines' checkpoints, to continue a run exactly."""

    step: int
    """Last completed RL step."""
    loader: dict = field(default_factory=dict)
    """PromptLoader.state_dict() after that step."""
    kl_coef: Optional[float] = None
    """Current KL-in-reward coefficient (the adaptive controller moves it)."""
    rng: dict = field(default_factory=dict)
    """Python, numpy and torch RNG states of the driver."""
    rollouts: Optional[dict] = None
    """trainer.mode=async: the data cursor aligned with what was trained and the prompts in flight or
    buffered then (`megarl.trainer.async_loop.Producer.state_dict`); None in synchronous runs."""


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step_{step:06d}"


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    if state:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])


def save_driver_state(directory: str | Path, state: DriverState) -> Path:
    """Write the manifest of what the engines saved, then `driver_state.pt`, each atomically; the driver
    state's presence marks the checkpoint complete."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_file(
        directory / MANIFEST,
        lambda tmp: tmp.write_text(
            json.dumps({"step": state.step, "files": file_table(directory)}, indent=1, sort_keys=True)
        ),
    )
    hold("checkpoint.driver_state")
    target = directory / DRIVER_STATE
    write_file(target, lambda tmp: torch.save(state.__dict__, tmp))
    return target


def load_driver_state(directory: str | Path) -> DriverState:
    return DriverState(**torch.load(Path(directory) / DRIVER_STATE, weights_only=False))


# ----------------------------------------------------------------------------- integrity


def file_table(directory: Path) -> dict[str, dict]:
    """{relative path: {"size", "crc32" (files up to CHECKSUM_MAX_BYTES)}} of the checkpoint's files."""
    table = {}
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory)
        hidden_dir = any(part.startswith(".") for part in rel.parts[:-1])  # staging dirs of unfinished saves
        if not path.is_file() or str(rel) in (MANIFEST, DRIVER_STATE) or hidden_dir or ".tmp-" in rel.name:
            continue
        size = path.stat().st_size
        entry = {"size": size}
        if size <= CHECKSUM_MAX_BYTES:
            entry["crc32"] = zlib.crc32(path.read_bytes())
        table[str(rel)] = entry
    return table


def checkpoint_problem(directory: str | Path) -> Optional[str]:
    """Why the checkpoint at `directory` cannot be resumed from (naming the file), or None if intact."""
    directory = Path(directory)
    state_file = directory / DRIVER_STATE
    if not state_file.is_file():
        return f"{state_file} is missing: not a complete checkpoint (a save was interrupted, or not a step_N directory)"
    try:
        saved = load_driver_state(directory)
    except Exception as err:  # noqa: BLE001 -- any unreadable driver state (EOFError, unpickling, zip) is damage
        return f"{state_file} is unreadable ({type(err).__name__}: {err}; {state_file.stat().st_size} bytes)"
    match = _STEP_DIR.match(directory.name)
    if match and int(match.group(1)) != saved.step:
        return f"{state_file} is of step {saved.step}, not of {directory.name}"
    return _manifest_problem(directory) or _distcp_problem(directory)


def _distcp_problem(directory: Path) -> Optional[str]:
    """torch_dist engine checkpoints list, in `.metadata`, where each item lies in which .distcp file:
    a file shorter than its last item is truncated (caught even without a manifest)."""
    import pickle

    for metadata in sorted(directory.glob("*/.metadata")):
        try:
            with open(metadata, "rb") as f:
                storage = pickle.load(f).storage_data
            needed: dict[str, int] = {}
            for info in storage.values():
                needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        except Exception as err:  # noqa: BLE001 -- an unreadable .metadata is damage, whatever the error
            return f"{metadata} is unreadable ({type(err).__name__}: {err})"
        for name, end in sorted(needed.items()):
            path = metadata.parent / name
            size = path.stat().st_size if path.is_file() else None
            if size is None or size < end:
                return (
                    f"{path} is missing"
                    if size is None
                    else f"{path} has {size} bytes but its items end at byte {end} (truncated)"
                )
    return None


def _manifest_problem(directory: Path) -> Optional[str]:
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return None  # written before manifests existed: the workers' load is the only check
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as err:
        return f"{manifest} is unreadable ({type(err).__name__}: {err})"
    for rel, entry in files.items():
        path = directory / rel
        if not path.is_file():
            return f"{path} is missing (listed in {MANIFEST})"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{path} has {size} bytes, {entry['size']} when the checkpoint was written (truncated or replaced)"
        if "crc32" in entry and zlib.crc32(path.read_bytes()) != entry["crc32"]:
            return f"{path} does not match its checksum in {MANIFEST} (corrupted)"
    return None


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, dir) of every complete checkpoint, oldest first."""
    root = checkpoints_dir(run_dir)
    found = []
    if root.is_dir():
        for path in root.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and (path / DRIVER_STATE).is_file():
                found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Optional[Path]:
    """The newest complete checkpoint of the run, or None."""
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def resolve_resume(resume: str, run_dir: str | Path) -> Optional[Path]:
    """trainer.resume → the checkpoint to load: auto (latest intact, if any), never, or a path (checked)."""
    return plan_resume(resume, run_dir).directory


# ----------------------------------------------------------------------------- resume


@dataclass
class ResumePlan:
    """Which checkpoint a run continues from, and what was passed over on the way."""

    directory: Optional[Path]
    """The checkpoint to load; None: start from step 0."""
    step: int = 0
    """Its step (0 without one)."""
    fallbacks: list[Path] = field(default_factory=list)
    """Older intact checkpoints, newest first (tried, with resume=auto, if the workers fail to load `directory`)."""
    damaged: list[tuple[Path, str]] = field(default_factory=list)
    """Newer checkpoints passed over (resume=auto), with what is wrong with each."""


def plan_resume(resume: str, run_dir: str | Path) -> ResumePlan:
    """The checkpoint trainer.resume means, checked without starting anything; `ResumeError` if an
    explicit path cannot be resumed from (naming the file and the checkpoint to use instead)."""
    if resume == "never":
        return ResumePlan(None)
    if resume == "auto":
        intact, damaged = [], []
        for _, path in reversed(complete_checkpoints(run_dir)):
            problem = checkpoint_problem(path)
            if problem is None:
                intact.append(path)
            elif not intact:
                damaged.append((path, problem))
        if not intact:
            return ResumePlan(None, damaged=damaged)
        return ResumePlan(intact[0], load_driver_state(intact[0]).step, intact[1:], damaged)
    return _plan_explicit(Path(resume))


def _plan_explicit(path: Path) -> ResumePlan:
    problem = checkpoint_problem(path) if path.is_dir() else f"{path} does not exist"
    older = [p for _, p in reversed(complete_checkpoints(path.parent.parent)) if _step_of(p) < _step_of(path)]
    older = [p for p in older if checkpoint_problem(p) is None]
    if problem is None:
        return ResumePlan(path, load_driver_state(path).step, older)
    if (path / "checkpoints").is_dir():
        hint = (
            f"{path} is a run directory: set trainer.run_dir={path} trainer.resume=auto to continue from its"
            " latest intact checkpoint"
        )
    else:
        hint = _fallback_hint(older)
    raise ResumeError(f"trainer.resume={str(path)!r} cannot be resumed from: {problem}. {hint}")


def _step_of(path: Path) -> int:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else sys.maxsize


def _fallback_hint(older: list[Path]) -> str:
    if older:
        return (
            f"The previous intact checkpoint is {older[0]}: set trainer.resume={older[0]} (or trainer.resume=auto,"
            " which passes over damaged checkpoints)"
        )
    return "There is no earlier intact checkpoint: trainer.resume=never starts over"


def resume_from(resume: str, run_dir: str | Path, load: Callable[[Path], int]) -> int:
    """Load the planned checkpoint with `load(directory) -> step` (the workers' load); damaged newer
    checkpoints are reported and set aside, and with resume=auto a failing load falls back to the previous
    intact checkpoint. Returns the step resumed at (0: none)."""
    plan = plan_resume(resume, run_dir)
    for path, problem in plan.damaged:
        aside = set_aside(path)
        _warn(
            f"checkpoint {path} is damaged: {problem}. Set aside as {aside.name}; continuing from "
            + (f"the previous intact checkpoint, {plan.directory}" if plan.directory else "the beginning")
        )
    candidates = [plan.directory, *plan.fallbacks] if plan.directory is not None else []
    failures = []
    for i, directory in enumerate(candidates):
        try:
            return load(directory)
        except Exception as err:  # noqa: BLE001 -- reported with the file, then the next candidate
            failures.append(f"{directory}: {_short(err)}")
            if resume != "auto":
                raise ResumeError(
                    f"trainer.resume={resume!r}: loading {directory} failed ({_short(err)})."
                    f" {_fallback_hint(plan.fallbacks)}"
                ) from err
            if i + 1 < len(candidates):
                _warn(
                    f"loading checkpoint {directory} failed ({_short(err)}); trying the previous intact"
                    f" checkpoint, {candidates[i + 1]}"
                )
    if failures:
        raise ResumeError(
            "no checkpoint of the run loads: "
            + "; ".join(failures)
            + ". Fix the config to match the checkpoints, or set trainer.resume=never to start over"
        )
    return 0


def _short(err: BaseException, limit: int = 400) -> str:
    """An error in one line: its type, its first line and (a remote traceback's) last line."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    text = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
    text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def set_aside(directory: Path) -> Path:
    """Rename a damaged checkpoint out of the resume path (kept for inspection, not counted, not pruned)."""
    aside = directory.with_name(f"{directory.name}.damaged-{int(time.time())}")
    directory.rename(aside)
    return aside


def _warn(message: str) -> None:
    print(f"[megarl] warning: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- pruning, leftovers


def remove_leftovers(run_dir: str | Path) -> list[Path]:
    """Delete what killed runs leave behind and nothing reads: staging directories of engine checkpoints
    and HF exports that were never published, checkpoints half-way through pruning, temp files of
    metrics.jsonl. Only for the one driver of the run, before it starts writing; the removed paths."""
    run_dir = Path(run_dir)
    found = [
        *run_dir.glob(".hf.incomplete-*"),
        *stale_writes(run_dir / "metrics.jsonl"),
        *checkpoints_dir(run_dir).glob(".step_*.deleting"),
        *checkpoints_dir(run_dir).glob("step_*/.*.incomplete-*"),
    ]
    for path in found:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return found


def prune_checkpoints(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (keep=0: keep all); the deleted dirs.

    Each is first renamed to a hidden `.step_N.deleting` (atomic: a crash never leaves a half-deleted
    directory that still looks like a checkpoint), then removed; leftovers of a crash are removed too."""
    for leftover in checkpoints_dir(run_dir).glob(".step_*.deleting"):
        shutil.rmtree(leftover, ignore_errors=True)
    found = complete_checkpoints(run_dir)
    old = [path for _, path in found[:-keep]] if 0 < keep < len(found) else []
    doomed = [path.with_name(f".{path.name}.deleting") for path in old]
    for path, hidden in zip(old, doomed):
        path.rename(hidden)
    if doomed:
        hold("prune")
    for hidden in doomed:
        shutil.rmtree(hidden, ignore_errors=True)
    return old
