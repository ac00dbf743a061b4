"""Checkpoints of a run: where they live, which is the latest complete one, the driver's own state.

Layout: `run_dir/checkpoints/step_000020/{actor,critic}/` (engine checkpoints, each atomic) and
`driver_state.pt` (step, dataloader position, KL coefficient, driver RNG), written *last* and
atomically (temp file + rename). A checkpoint counts only when `driver_state.pt` exists, so a run
killed while saving resumes from the previous complete one. Old checkpoints beyond
`keep_checkpoints` are deleted after a new one is complete. Pure Python + torch.
"""
from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

DRIVER_STATE = "driver_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


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
    """Write `driver_state.pt` atomically; its presence marks the checkpoint complete."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / DRIVER_STATE
    tmp = directory / f".{DRIVER_STATE}.tmp-{os.getpid()}"
    torch.save(state.__dict__, tmp)
    os.replace(tmp, target)
    return target


def load_driver_state(directory: str | Path) -> DriverState:
    return DriverState(**torch.load(Path(directory) / DRIVER_STATE, weights_only=False))


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
    """trainer.resume → the checkpoint to load: auto (latest complete, if any), never, or a path."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if not (path / DRIVER_STATE).is_file():
        raise FileNotFoundError(f"trainer.resume={resume!r} is not a complete checkpoint (no {DRIVER_STATE})")
    return path


def prune_checkpoints(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (keep=0: keep all); the deleted dirs."""
    found = complete_checkpoints(run_dir)
    if keep <= 0 or len(found) <= keep:
        return []
    old = [path for _, path in found[:-keep]]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old
